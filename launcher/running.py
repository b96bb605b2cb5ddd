"""What the in-place coordinator (launcher/coordinator.py) does while the job trains.

Once a second it reads every worker's status (one ``multi_get``) and from it: emits step
events (with the store's key count, the chief's threads and descriptors, the largest
worker's peak memory), settles the model's calibration (launcher/calibration.py), admits
replacements and takes them in when that pays (launcher/rejoin.py), and runs the
progress watch that blames a stalled worker (launcher/watch.py).
"""

from __future__ import annotations

from dataclasses import replace

from chameleon_runtime.protocol.messages import WorkerStatus
from launcher import recovery as rc


class RunningMixin:
    """Mixed into ``Coordinator``, whose state it reads and whose events it emits."""

    def _snapshot(self, now: float) -> dict[int, WorkerStatus]:
        """Every live worker's status, in one round trip (those that posted one)."""
        assert self.state is not None
        self._statuses = self.view.statuses(sorted(self.state.live))
        return self._statuses

    def _note_progress(self, statuses: dict[int, WorkerStatus]) -> None:
        # (a survivor whose collective failed with its peer reports "ready" at once, its
        # step still the last it did: the leader's look at a failure must count it)
        steps = [
            s.step - 1 for s in statuses.values() if s.phase in ("train", "checkpoint", "ready")
        ]
        if steps:
            self._top_step = max(self._top_step, max(steps))

    def _while_running(self, statuses: dict[int, WorkerStatus], now: float) -> None:
        state = self.state
        assert state is not None
        self._note_progress(statuses)
        top = self._top_step
        self._described()
        last, at = self._last_step_event
        if top > last and (now - at >= 1.0 or last < self._gen_start):
            chief = statuses.get(min(state.live)) if state.live else None
            peaks = [
                (s.peak_bytes, r)
                for r, s in statuses.items()
                if s.peak_bytes is not None and s.generation == state.generation
            ]
            peak = max(peaks, default=(None, None))
            self.emit(
                "step",
                step=top,
                generation=state.generation,
                store_keys=self.store.num_keys(),
                rank=min(state.live) if chief else None,
                fds=chief.fds if chief else None,
                threads=chief.threads if chief else None,
                # the largest worker's tensors at their peak, this generation
                peak_bytes=peak[0],
                peak_rank=peak[1],
            )
            self._last_step_event = (top, now)
            self._first_step_pending = False
        if self.started_at is not None and self.model.restart_s is None and top >= 0:
            self.model.restart_s = now - self.started_at  # a restart costs this start-up
        collect_s = self.progress.step_timeout_s()  # a survivor may be mid-step at an abort
        if collect_s != state.timeouts.collect_s:
            self.state = replace(state, timeouts=replace(state.timeouts, collect_s=collect_s))
        if self.model.description is not None and not self.rejoins.waiting:
            # (a replacement starting up competes for the host: no fit meanwhile)
            current = self.plans[state.generation].plan.to_plan()
            fitted = self.model.fitted_generation
            self.model.settle(current, statuses, state.generation, top - self._gen_start)
            if self.model.fitted_generation != fitted and self.on_settled is not None:
                self._mirror_due = True  # a successor should plan on the new fit
        self._admit(statuses, top)
        self.progress.observe(statuses, now)
        stalls = self.progress.stalled(statuses, now)
        if stalls:
            from launcher.watch import blame

            for rank, why in blame(statuses, stalls).items():
                if rank not in self._blamed:
                    self._blamed.add(rank)
                    self.emit("stalled", attempt=self.attempt, rank=rank, reason=why)
                    self.kill([rank], why, stalls[rank].stalled_s)

    def _admit(self, statuses: dict[int, WorkerStatus], top: int) -> None:
        """Replacements up as spares of this generation join the live set; once their
        start-up stops competing for the host, they are taken into the plan if it pays."""
        up = self.view.statuses(sorted(self.rejoins.announced))  # one round trip for all
        generation = self.state.generation
        spares = {r for r, s in up.items() if s.phase == "spare" and s.generation == generation}
        if spares:
            self.rejoins.admit(spares, top)
            self._apply(rc.Admit(frozenset(spares)))
        joined = self.rejoins.settled(top)
        if joined:
            self._grow(joined, statuses)

    def _grow(self, joined: list[int], statuses: dict[int, WorkerStatus]) -> None:
        """Take ``joined`` into the plan when the planner finds that it pays; never under a
        forced reroute (the user asked to keep the layout) or restart."""
        state = self.state
        growth = None
        if self.policy in ("auto", "reparallelize") and self.model.description is not None:
            current = self.plans[state.generation].plan.to_plan()
            self.model.refit()  # on steps run since the replacements' start-up
            job = self.model.job(current, statuses, state.generation)
            growth = self.model.growth(job, current, sorted(state.live))
        if growth is None:
            self.emit("rejoined", attempt=self.attempt, ranks=joined, taken_in=False)
            return
        current_s, grown_s, transition_s, label = growth
        self.emit(
            "rejoin",
            attempt=self.attempt,
            generation=state.generation,
            ranks=joined,
            step_s=current_s,
            estimated_step_s=grown_s,
            transition_s=transition_s,
            label=label,
        )
        self._apply(rc.Grow(frozenset(joined)))
