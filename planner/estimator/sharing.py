"""A step on hosts whose workers share CPU cores: the step program under processor sharing.

On the CPU test bed 8 workers share 2 cores. Neither bound of a step is its time there:
the critical path assumes a core per worker, the host's CPU over its cores assumes the
cores never idle, and a pipeline's stages do leave them idle while they wait for each
other (measured: 1.6 to 1.95 of 2 cores busy, depending on the layout). So the same
program ``planner.estimator.timing`` walks is run here the way the kernel runs it: at every moment
the workers of a host that have CPU work to do share its cores equally (each at
min(1, cores / runnable) of a core), and a worker waiting for a message or a barrier
uses none. A message arrives its transfer time after the pass that produced it (the
link's latency holds the fitted wake-up wait: planner.estimator.fit).

Where each operation's CPU goes: passes as ``CostModel`` charges them (layers plus the
runtime's loop per pass), the optimizer after the commit, and the rest of the runtime's
own CPU (a base, each message, each byte, the tail's per parameter:
``estimate.runtime_cpu_s``) at the start of the tail, where most of it is spent
(the bucket exchange, rounding, the store). A ring's all-reduce is posted during the
last backward, where the bucket's layers are done (the backward's CPU is split there),
starts once every holder has posted it and is done with its previous one, and is waited
for at the start of the tail; it takes no worker's CPU beyond what the runtime's share
charges.

Event driven, in virtual time per host (the CPU each of its runnable workers has had):
between two events the runnable set is fixed, so a worker that starts W of work when
its host's virtual time is V finishes when that reaches V + W, and the next to finish is
the least of those (a heap). A step of the test bed is a few hundred events, a fraction
of a millisecond; devices (no shared host) never come here.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from planner.job.cost import CostModel
from planner.plans.program import Bucket, OpKind, StepProgram, TailKind, WorkerProgram

_EPS = 1e-12
# A worker's program as items: ("cpu", seconds, key it produces or None),
# ("wait", key, delay after it is produced), ("sleep", seconds),
# ("barrier", key, members or None for everyone, seconds after the last arrives),
# ("post", key, members, seconds): a collective that produces key once every member
# posted it and ended its previous one, plus seconds; the poster goes on at once.
Item = tuple


class _Host:
    __slots__ = ("finishing", "virtual")

    def __init__(self) -> None:
        self.virtual = 0.0  # CPU seconds each runnable worker has had so far
        self.finishing: list[tuple[float, int]] = []  # (virtual time it finishes, worker)


class _Sim:
    def __init__(self, items: dict[int, list[Item]], host_of: Mapping[int, int], cores: float):
        self.items = items
        self.cores = cores
        self.host_of = dict(host_of)
        self.hosts = {h: _Host() for h in set(self.host_of.values())}
        self.cursor = dict.fromkeys(items, 0)
        self.produces: dict[int, object] = {}  # worker -> key of the CPU item it runs
        self.sleeping: list[tuple[float, int]] = []  # (until, worker)
        self.produced: dict[object, float] = {}
        self.blocked: dict[object, list[int]] = {}
        self.arrived: dict[object, dict[int, float]] = {}
        self.finished: dict[int, float] = {}
        # Collectives ("post"): each member's posts in order, when each ends once known.
        self.posts: dict[object, tuple[tuple[int, ...], float]] = {}  # key -> members, s
        self.previous: dict[tuple[object, int], object] = {}  # (key, member) -> its last key
        self.following: dict[object, list[object]] = {}  # key -> keys posted after it
        self.last_post: dict[int, object] = {}
        self.ends: dict[object, float] = {}
        self.timers: list[tuple[float, int, object]] = []  # (when, seq, key) to produce
        self.everyone = tuple(sorted(items))
        self.now = 0.0

    def run(self) -> float:
        for w in self.everyone:
            self.advance(w)
        hosts = self.hosts.values()
        while True:
            step = self.sleeping[0][0] - self.now if self.sleeping else float("inf")
            if self.timers:
                step = min(step, self.timers[0][0] - self.now)
            for host in hosts:
                if host.finishing:
                    rate = min(1.0, self.cores / len(host.finishing))
                    step = min(step, (host.finishing[0][0] - host.virtual) / rate)
            if step == float("inf"):
                break
            step = max(step, 0.0)
            self.now += step
            done = []
            for host in hosts:
                if host.finishing:
                    host.virtual += min(1.0, self.cores / len(host.finishing)) * step
                    while host.finishing and host.finishing[0][0] <= host.virtual + _EPS:
                        done.append(heapq.heappop(host.finishing)[1])
            woke = []
            while self.sleeping and self.sleeping[0][0] <= self.now + _EPS:
                woke.append(heapq.heappop(self.sleeping)[1])
            while self.timers and self.timers[0][0] <= self.now + _EPS:
                self.produce(heapq.heappop(self.timers)[2])
            for w in done:
                self.cursor[w] += 1
                key = self.produces.pop(w, None)
                if key is not None:
                    self.produce(key)
            for w in done + woke:
                self.advance(w)
        stuck = [w for w in self.everyone if w not in self.finished]
        if stuck:
            from planner.estimator.timing import ScheduleDeadlock

            raise ScheduleDeadlock(f"{len(stuck)} workers wait on each other: {stuck[:4]}")
        return max(self.finished.values(), default=0.0)

    def advance(self, w: int) -> None:
        """Run worker ``w``'s program from its cursor up to its next CPU work or wait."""
        items, now = self.items[w], self.now
        i = self.cursor[w]
        while i < len(items):
            item = items[i]
            tag = item[0]
            if tag == "cpu":
                if item[1] > _EPS:
                    self.cursor[w] = i
                    host = self.hosts[self.host_of[w]]
                    heapq.heappush(host.finishing, (host.virtual + item[1], w))
                    if item[2] is not None:
                        self.produces[w] = item[2]
                    return
                if item[2] is not None:
                    self.produce(item[2])
                i += 1
            elif tag == "post":
                self.post(w, item[1], item[2], item[3], now)
                i += 1
            elif tag == "sleep":
                i += 1
                if item[1] > _EPS:
                    self.cursor[w] = i
                    heapq.heappush(self.sleeping, (now + item[1], w))
                    return
            elif tag == "wait":
                when = self.produced.get(item[1])
                if when is None:
                    self.cursor[w] = i
                    self.blocked.setdefault(item[1], []).append(w)
                    return
                i += 1
                if when + item[2] > now + _EPS:
                    self.cursor[w] = i
                    heapq.heappush(self.sleeping, (when + item[2], w))
                    return
            else:  # a barrier: every member arrives, all leave its duration after the last
                key, group = item[1], item[2] or self.everyone
                here = self.arrived.setdefault(key, {})
                here[w] = now
                self.cursor[w] = i
                if len(here) < len(group):
                    return
                end = max(here.values()) + item[3]
                for h in group:
                    self.cursor[h] += 1
                    if end > now + _EPS:
                        heapq.heappush(self.sleeping, (end, h))
                    elif h != w:
                        self.advance(h)
                if end > now + _EPS:
                    return
                i = self.cursor[w]
        self.cursor[w] = i
        self.finished[w] = now

    def post(self, w: int, key: object, members: tuple[int, ...], seconds: float, now: float):
        """Member ``w`` posts collective ``key`` now (module doc)."""
        self.posts[key] = (members, seconds)
        self.arrived.setdefault(key, {})[w] = now
        before = self.previous[(key, w)] = self.last_post.get(w)
        if before is not None:
            self.following.setdefault(before, []).append(key)
        self.last_post[w] = key
        self.schedule(key)

    def schedule(self, key: object) -> None:
        """Fix ``key``'s end once every member posted it and each one's previous
        collective has an end; then the members' next ones may follow."""
        members, seconds = self.posts[key]
        here = self.arrived[key]
        if key in self.ends or len(here) < len(members):
            return
        start = 0.0
        for m in members:
            before = self.previous.get((key, m))
            if before is not None and before not in self.ends:
                return
            start = max(start, here[m], self.ends.get(before, 0.0) if before else 0.0)
        end = self.ends[key] = start + seconds
        heapq.heappush(self.timers, (end, len(self.ends), key))
        for later in self.following.get(key, ()):
            self.schedule(later)

    def produce(self, key: object) -> None:
        self.produced[key] = self.now
        for w in self.blocked.pop(key, ()):
            self.advance(w)


def simulate_shared(
    program: StepProgram,
    costs: CostModel,
    *,
    cores: float,
    host_of: Mapping[int, int],
    own_cpu_s: Mapping[int, float],
) -> float:
    """The step time of ``program`` with each host's workers sharing ``cores`` cores."""
    items = {w.worker: _items(w, costs, own_cpu_s.get(w.worker, 0.0)) for w in program.workers}
    for w, factor in costs.job.slow:
        if w in items and factor != 1.0:
            items[w] = _slowed(items[w], factor)
    return _Sim(items, host_of, cores).run()


def _slowed(items: list[Item], factor: float) -> list[Item]:
    """A slow worker's program (Job.slow) on a shared host: each CPU item followed by a
    pause of ``factor - 1`` times it before what it produces is out. What slows a worker
    there (a process stopped and continued from outside, launcher/throttle.py; a
    neighbour's load) leaves the cores to the others meanwhile: its CPU is the same, its
    time longer."""
    out: list[Item] = []
    for item in items:
        if item[0] == "cpu" and item[1] > _EPS:
            out += [("cpu", item[1], None), ("sleep", item[1] * (factor - 1.0))]
            out.append(("cpu", 0.0, item[2]))
        else:
            out.append(item)
    return out


def _items(w: WorkerProgram, costs: CostModel, own_cpu_s: float) -> list[Item]:
    """Worker ``w``'s program as CPU work, waits and barriers (module doc)."""
    first, end = w.first_layer, w.end_layer
    fwd, bwd = costs.forward_s(first, end), costs.backward_s(first, end)
    into = costs.boundary_bytes(first)  # an activation received, a gradient sent back
    out = costs.boundary_bytes(end)
    items: list[Item] = []
    last = w.last_backward
    ring = [b for kind, b in w.tail if kind is TailKind.ALLREDUCE and b is not None]
    for i, (kind, mb, prev, nxt) in enumerate(w.ops):
        if kind is OpKind.FORWARD:
            if prev is not None:
                items.append(("wait", (prev, 0, mb), costs.transfer_s(prev, w.worker, into)))
            items.append(("cpu", fwd, (w.worker, 0, mb)))
        else:
            if nxt is not None:
                items.append(("wait", (nxt, 1, mb), costs.transfer_s(nxt, w.worker, out)))
            if i == last and ring:
                items += _last_backward(w, costs, bwd, ring)
            else:
                items.append(("cpu", bwd, (w.worker, 1, mb)))
    if ring and last < 0:  # no pass: every bucket posted at the tail
        items += [_post(b, costs) for b in ring]
    items.append(("cpu", own_cpu_s, None))
    for kind, bucket in w.tail:
        if kind is TailKind.ALLREDUCE:
            assert bucket is not None
            items.append(("wait", ("bucket", bucket.index), 0.0))
        elif kind is TailKind.EXCHANGE:
            assert bucket is not None
            duration = costs.allreduce_s(bucket.holders, bucket.first_layer, bucket.end_layer)
            items.append(("barrier", ("bucket", bucket.index), bucket.holders, duration))
        elif kind is TailKind.COMMIT:
            items.append(("barrier", ("commit",), None, costs.commit_s(len(w.plan.workers))))
        elif kind is TailKind.OPTIMIZE:
            items.append(("cpu", costs.optimizer_s(first, end), None))
        elif kind is TailKind.REPORT_LOSS or kind is TailKind.READ_LOSS:  # exchange only
            items.append(("sleep", costs.store_s()))
    return items


def _post(bucket: Bucket, costs: CostModel) -> Item:
    duration = costs.allreduce_s(bucket.holders, bucket.first_layer, bucket.end_layer)
    return ("post", ("bucket", bucket.index), bucket.holders, duration)


def _last_backward(
    w: WorkerProgram, costs: CostModel, bwd: float, ring: list[Bucket]
) -> list[Item]:
    """The last backward pass, its CPU split where each bucket (from the top layer down,
    ``ring``'s order) is done and posted (module doc)."""
    mb = w.ops[w.last_backward].micro_batch
    model = costs.job.model
    items: list[Item] = []
    done = 0.0
    for bucket in ring:
        upto = bwd - model.total("backward_s", w.first_layer, bucket.first_layer)
        items.append(("cpu", max(0.0, upto - done), None))
        done = max(done, upto)
        items.append(_post(bucket, costs))
    items.append(("cpu", max(0.0, bwd - done), (w.worker, 1, mb)))
    return items
