"""The one protocol between the launcher and chameleon_runtime workers: every store key
either side reads or writes is built here, and every message is a typed model.

Both sides import this module: the workers, and the launcher, which imports nothing else
of chameleon_runtime (this package is torch-free). Everything travels as JSON through the
worker store that the leader agent hosts for one attempt; nothing is unpickled.

Channels, all under ``chameleon/<attempt>/``:

- ``status/<rank>``: the worker's ``WorkerStatus``, written by its heartbeat thread every
  second and at once on every phase change: liveness (the beat moves), progress (the step
  moves) and what it is waiting on. One key per rank, overwritten.
- ``inbox``: a queue to the leader: ``Ready`` (a worker left a generation and waits for a
  plan), ``Applied`` (a worker applied a plan), ``Joined`` (a replacement is up).
- ``mailbox/<rank>``: a queue to one worker, popped by its watcher thread: ``Abort``,
  ``Exit``, ``Finish``, ``Stop``.
- ``g<g>/...``: everything of generation ``g``: its plan, the pointer to the plan that
  followed it, its abort, its all-or-none agreements (commit of every step, checkpoints,
  groups, migration), per-step losses, migration headers and its gloo groups'
  rendezvous. The leader deletes a generation's keys once a later one is applied, and the
  last member to reach a step's commit deletes the previous step's keys, so the store does
  not grow with steps or recoveries.
- Not in the store: a plain script's ``ScriptBeat`` (chameleon_runtime.heartbeat), one
  fixed-size record in the file ``CHAMELEON_BEAT_FILE`` names, read by its own agent.
- Control messages (plans, aborts, the mailbox, statuses, the inbox, the job, replacement
  requests, the end) are signed with the job token: chameleon_runtime.protocol.seal.
- ``aware/<rank>``, ``job``, ``layer/<i>``, ``latest``, ``phase``, ``finished``,
  ``respawn/<rank>``: registration, the job's description, the latest generation, the
  leader's recovery phase, the final step, and replacement requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

# What a worker is doing; the launcher's timeouts depend on it (launcher/watch.py).
WorkerPhase = Literal[
    "startup",  # importing, building its layers, loading a checkpoint, its first step
    "train",  # running steps
    "checkpoint",  # saving its layers
    "ready",  # left a generation, waiting for the next plan
    "groups",  # building a new generation's process groups
    "migrate",  # moving layers for a new plan
    "spare",  # alive, in no plan: waits to be used
    "done",  # finished training
]


class _Message(BaseModel):
    # Floats as JSON's Infinity and NaN where they are not finite (an fp16 step's
    # overflowed norm in a commit's sums), not as null.
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


class WaitingOn(_Message):
    """What a worker is blocked on: a peer's message (``recv``/``send`` with the peers),
    a collective (``allreduce`` with the other holders of its bucket), an all-or-none
    agreement of the generation's members (``agree`` with its name), the
    launcher (``plan``), or nobody but itself (``compute``, ``checkpoint``, ``groups``)."""

    what: Literal["compute", "recv", "send", "allreduce", "agree", "plan", "groups", "checkpoint"]
    peers: list[int] = []
    name: str = ""


# A status's means (``mean_*``, ``busy_s_per_mb``) are over a worker's last PACE_WINDOW
# steps of its generation, its first PACE_WARMUP_STEPS left out (chameleon_runtime.pace).
PACE_WINDOW = 8
PACE_WARMUP_STEPS = 2


class WorkerStatus(_Message):
    pid: int
    beat: int  # moves every heartbeat: the process is alive and answering
    phase: WorkerPhase
    generation: int
    step: int  # the next step this worker will run (= steps applied)
    progress: int  # steps this process has completed: moves while it gets somewhere
    recoveries: int = 0
    step_s: float | None = None  # the last step's duration
    slowest_step_s: float | None = None
    cpu_s: float | None = None
    compute_cpu_s: float | None = None
    pass_cpu_s: float | None = None  # the pass loop's CPU beyond the layers
    mean_step_s: float | None = None  # chameleon_runtime.pace, for the launcher's fit
    mean_cpu_s: float | None = None
    mean_compute_cpu_s: float | None = None
    mean_pass_cpu_s: float | None = None
    # Wall seconds the last step's passes took (its forwards and backwards, no wait in a
    # collective), over how many micro-batches; and per micro-batch, the median over the
    # pace window: the worker's speed (launcher/stragglers.py).
    busy_s: float | None = None
    micro_batches: int | None = None
    busy_s_per_mb: float | None = None
    pace_steps: int | None = None  # steps the means are over, this generation
    waiting_on: WaitingOn | None = None
    peak_bytes: int | None = None  # tensor bytes at this generation's peak (runtime.memory)
    fds: int | None = None  # open file descriptors and threads: bounded-state evidence
    threads: int | None = None


class Ready(_Message):
    """A worker left generation ``after`` (an abort, or a broken transfer) and waits for
    the next plan. ``applied`` is the last generation it applied (its layers are that
    plan's stage); ``step`` the next step it would run (None: a spare, its step is not
    current); ``held`` the layers it holds now.

    A ring's commit is a collective (chameleon_runtime.step): ``pending`` says the worker
    posted step ``step``'s commit and did not see it end, so it may have been applied
    elsewhere; it keeps that step's final gradients until the next plan says whether to
    apply them (``PlanMessage.roll_forward``). ``committed`` is what the commit of step
    ``step - 1`` summed (the step's loss, its squared gradient norm, the members), which
    a pending peer needs to apply that step as everyone else did."""

    kind: Literal["ready"] = "ready"
    rank: int
    pid: int
    after: int
    applied: int
    step: int | None
    held: list[int]
    reason: str = ""
    pending: bool = False
    committed: list[float] | None = None


class Applied(_Message):
    kind: Literal["applied"] = "applied"
    rank: int
    generation: int
    # What applying it cost this worker, measured: the group (0 when carried over), and
    # the migration with its agreement. The launcher reports them beside the prediction.
    groups_s: float = 0.0
    migrate_s: float = 0.0
    carried: bool = False  # the group of an earlier generation was kept
    # A ring's collective groups (``holders_key``): built for this generation, carried
    # over from an earlier one
    collectives_built: list[str] = []
    collectives_carried: list[str] = []
    sent_at: float = 0.0  # the worker's wall clock as it went back to training (0: unknown)


class GroupOffer(_Message):
    """The groups a member of a new generation could carry over (chameleon_runtime.
    recovery): the generation its point-to-point group was built for (-1: none), and per
    set of holders (``holders_key``) the generation of a settled collective group."""

    p2p: int = -1
    collectives: dict[str, int] = {}


def holders_key(holders: tuple[int, ...]) -> str:
    return "-".join(map(str, holders))


class Joined(_Message):
    """A replacement started by the launcher is up, as a spare of ``generation``."""

    kind: Literal["joined"] = "joined"
    rank: int
    count: int  # which replacement of this rank (launcher/rejoin.py)
    generation: int


class Abort(_Message):
    kind: Literal["abort"] = "abort"
    generation: int
    reason: str = ""


class Exit(_Message):
    """Fault injection: the process ``pid`` exits with ``code`` (a replacement with the
    same rank ignores a request meant for its predecessor)."""

    kind: Literal["exit"] = "exit"
    code: int
    pid: int


class Finish(_Message):
    """Training ended at ``step``: a spare leaves."""

    kind: Literal["finish"] = "finish"
    step: int


class Save(_Message):
    """A preemption notice (``--signals-to-handle``): save at the next step the members
    agree on, then stop (chameleon_runtime.preemption)."""

    kind: Literal["save"] = "save"
    signal: int


class Settled(_Message):
    """Every member applied ``generation``: a worker that plan left out drops the layers it
    kept in reserve for a failure during it (chameleon_runtime.membership)."""

    kind: Literal["settled"] = "settled"
    generation: int


class Stop(_Message):
    """From a worker to its own watcher: stop listening (the worker is closing)."""

    kind: Literal["stop"] = "stop"
    pid: int


class Aware(_Message):
    pid: int
    device: str


class RecoveryPhase(_Message):
    """The leader's recovery phase, for fault injection on other nodes."""

    recovery: int  # 1 for the first recovery of the attempt
    phase: Literal["running", "collect", "plan", "confirm"]
    generation: int


InboxMessage = Annotated[Ready | Applied | Joined, Field(discriminator="kind")]
MailboxMessage = Annotated[
    Abort | Exit | Finish | Save | Settled | Stop, Field(discriminator="kind")
]
INBOX = TypeAdapter(InboxMessage)
MAILBOX = TypeAdapter(MailboxMessage)


def encode(message: BaseModel) -> str:
    return message.model_dump_json()


class Keys:
    """Every key of one attempt's worker store. Under torchrun the store outlives a
    restart, so keys carry the attempt: stale keys of a dead attempt are never read."""

    def __init__(self, attempt: int) -> None:
        self.prefix = f"chameleon/{attempt}/"

    # -- per worker ------------------------------------------------------------------
    def aware(self, rank: int) -> str:
        return f"{self.prefix}aware/{rank}"

    def status(self, rank: int) -> str:
        return f"{self.prefix}status/{rank}"

    def mailbox(self, rank: int) -> str:
        return f"{self.prefix}mailbox/{rank}"

    def respawn(self, rank: int) -> str:
        return f"{self.prefix}respawn/{rank}"

    @staticmethod
    def step_failpoint(rank: int, step: int) -> str:
        """The failpoint a ``step=N`` fault of ``rank`` arms in it: the worker waits there
        once it has done step N (chameleon_runtime.control, launcher/faults.py)."""
        return f"step-{rank}-{step}"

    def failpoint(self, node: int, phase: str) -> str:
        """Set by a node's agent once its fault for ``phase`` has fired (fault injection)."""
        return f"{self.prefix}failpoint/{node}/{phase}"

    # -- job-wide --------------------------------------------------------------------
    @property
    def inbox(self) -> str:
        return f"{self.prefix}inbox"

    @property
    def job(self) -> str:
        return f"{self.prefix}job"

    def layer(self, index: int) -> str:
        return f"{self.prefix}layer/{index}"

    @property
    def latest(self) -> str:
        return f"{self.prefix}latest"

    @property
    def phase(self) -> str:
        return f"{self.prefix}phase"

    @property
    def finished(self) -> str:
        return f"{self.prefix}finished"

    def profile(self, name: str) -> str:
        return f"{self.prefix}profile/{name}"

    # -- per generation --------------------------------------------------------------
    def generation(self, g: int) -> str:
        """The prefix of every key of generation ``g`` (deleted together)."""
        return f"{self.prefix}g{g}/"

    def plan(self, g: int) -> str:
        return f"{self.generation(g)}plan"

    def next(self, g: int) -> str:
        """The generation published for the workers that leave ``g``."""
        return f"{self.generation(g)}next"

    def abort(self, g: int) -> str:
        return f"{self.generation(g)}abort"

    def groups(self, g: int) -> str:
        return f"{self.generation(g)}groups"

    def kept(self, g: int, rank: int) -> str:
        """The groups a member of generation ``g`` could carry over (``GroupOffer``)."""
        return f"{self.generation(g)}kept/{rank}"

    def agreement(self, g: int, name: str) -> str:
        return f"{self.generation(g)}agree/{name}"

    def agreement_done(self, g: int, name: str) -> str:
        return f"{self.agreement(g, name)}/done"

    def loss(self, g: int, step: int, worker: int) -> str:
        return f"{self.generation(g)}loss/{step}/{worker}"

    def migration(self, g: int, transfer: int, layer: int) -> str:
        return f"{self.generation(g)}mig/{transfer}/{layer}"

    def norm(self, g: int, step: int, worker: int) -> str:
        return f"{self.generation(g)}norm/{step}/{worker}"

    def step_keys(
        self,
        g: int,
        step: int,
        last_stage: list[int],
        *,
        checkpointed: bool,
        norm_owners: Sequence[int] = (),
        commit: bool = True,
    ) -> list[str]:
        """The keys of one step: deleted once every member has moved past it. ``commit``:
        the step's commit was an agreement in the store (an exchange program's; a ring's
        commits through its messages and leaves no key)."""
        names = [commit_name(step)] if commit else []
        names += [checkpoint_name(step)] if checkpointed else []
        keys = [k for n in names for k in (self.agreement(g, n), self.agreement_done(g, n))]
        keys += [self.norm(g, step, w) for w in norm_owners]
        return keys + [self.loss(g, step, w) for w in last_stage]


def commit_name(step: int) -> str:
    return f"commit/{step}"


def checkpoint_name(step: int) -> str:
    return f"ckpt/{step}"


# -- plain scripts' heartbeats ---------------------------------------------------------

BEAT_RECORD_BYTES = 256  # fixed: a reader never sees the tail of a longer, older record


class ScriptBeat(BaseModel):
    """A plain script's heartbeat record: who wrote it, how many beats, the open section."""

    model_config = ConfigDict(frozen=True)

    pid: int
    beats: int
    section: str | None = None
    timeout_s: float | None = None  # the section's; None: the startup timeout
    # the longest time between two heartbeats so far (sections left out); None before two
    slowest_gap_s: float | None = None

    def encode(self) -> bytes:
        data = self.model_dump_json().encode()
        if len(data) > BEAT_RECORD_BYTES:
            raise ValueError("section name too long for a heartbeat record")
        return data.ljust(BEAT_RECORD_BYTES)

    @classmethod
    def decode(cls, data: bytes) -> ScriptBeat | None:
        """None for an empty or torn record (read while being rewritten): read again later."""
        try:
            return cls.model_validate_json(data.strip() or b"{}")
        except ValueError:
            return None


# -- where the worker store is (chameleon_runtime.storeaddr, launcher/agent.py, a successor) ----

# The file an agent writes when its round's worker store moves to a new leader, how long
# a worker's connection waits for one after losing its store, and how long a connection
# to a store may go unanswered before it counts as lost (chameleon_runtime.protocol.link).
STORE_FILE_ENV = "CHAMELEON_STORE_FILE"
STORE_WAIT_ENV = "CHAMELEON_STORE_WAIT_S"
STORE_LINK_ENV = "CHAMELEON_STORE_LINK_S"


class StoreAddress(BaseModel):
    """A worker store, with the epoch of the move that made it (0: the round's first)."""

    model_config = ConfigDict(frozen=True)

    addr: str
    port: int
    epoch: int = 0
