"""What the cluster's scheduler tells a launch: torchrun's ``PET_*`` variables (Kubeflow's
PyTorchJob sets them) and Slurm's ``SLURM_*`` ones (``srun`` sets them on every node).

A flag given on the command line always wins. Without it, ``PET_<FLAG>`` is its default,
as in torchrun (torch.distributed.argparse_util: ``PET_NPROC_PER_NODE=4`` is
``--nproc-per-node 4``, ``PET_STANDALONE=1`` is ``--standalone``). Under ``srun``, a
rendezvous setting that neither gives comes from Slurm: the node count, this node's rank,
node 0's host (the first of the step's node list), its port and the run id (both from
the job id). Pure
functions of the environment: launcher/flags.py and launcher/args.py apply them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass


class SchedulerError(ValueError):
    """The scheduler's environment cannot describe this launch; ``str()`` is one line."""


def pet_name(dest: str) -> str:
    """torchrun's variable for a flag's destination: ``nproc_per_node`` ->
    ``PET_NPROC_PER_NODE``."""
    return f"PET_{dest.upper()}"


def pet_switch(environ: Mapping[str, str], dest: str) -> bool | None:
    """A switch's ``PET_*`` value (``0`` off, any other integer on, as torchrun's
    ``check_env``); None when unset."""
    name = pet_name(dest)
    text = environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return bool(int(text))
    except ValueError:
        raise SchedulerError(f"{name} must be 0 or 1, got {text!r}") from None


# -- Slurm's compressed host lists ------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(text: str) -> list[str]:
    """``gpu[01-04,07],login1`` -> ``gpu01 .. gpu04, gpu07, login1``, as ``scontrol show
    hostnames`` prints them (``scontrol`` is not on every compute node). Brackets may
    repeat within a name (``rack[1-2]-n[1-2]``: every combination, leftmost slowest);
    a range keeps its zero padding."""
    names: list[str] = []
    for part in _split_top(text.strip(), text):
        names.extend(_expand_one(part, text))
    if not names:
        raise SchedulerError(f"empty Slurm node list {text!r}")
    return names


def _split_top(text: str, whole: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SchedulerError(f"nested brackets in Slurm node list {whole!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SchedulerError(f"unbalanced ']' in Slurm node list {whole!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SchedulerError(f"unclosed '[' in Slurm node list {whole!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(name: str, whole: str) -> list[str]:
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    prefix, body, rest = name[:open_at], name[open_at + 1 : close_at], name[close_at + 1 :]
    values: list[str] = []
    for piece in body.split(","):
        match = _RANGE.match(piece.strip())
        if not match:
            raise SchedulerError(f"bad range {piece!r} in Slurm node list {whole!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise SchedulerError(f"descending range {piece!r} in Slurm node list {whole!r}")
        width = len(low) if low.startswith("0") else 0
        values.extend(str(i).zfill(width) for i in range(int(low), int(high) + 1))
    tails = _expand_one(rest, whole)
    return [f"{prefix}{v}{t}" for v in values for t in tails]


# -- a launch under srun ----------------------------------------------------------------


@dataclass(frozen=True)
class SlurmLaunch:
    """One ``chameleon run`` per node of a Slurm job step."""

    job_id: str
    nodes: int
    node_rank: int
    first_host: str
    requeue: int  # SLURM_RESTART_COUNT: times the job was requeued
    tasks: int | None = None  # the step's tasks (srun --ntasks)
    hosts_from: str = "SLURM_STEP_NODELIST"  # the variables read, for the start's message
    nodes_from: str = "SLURM_STEP_NUM_NODES"

    def check_one_per_node(self) -> None:
        """Taking the rendezvous from Slurm supposes one launcher per node."""
        if self.tasks is not None and self.tasks > self.nodes:
            raise SchedulerError(
                f"this Slurm step runs {self.tasks} tasks on {self.nodes} node(s): chameleon "
                "run starts the workers itself, run one per node (srun --ntasks-per-node=1)"
            )

    @property
    def port(self) -> int:
        """Node 0's control store port, from the job id: two jobs sharing a node (an
        allocation that is not exclusive) do not both take torchrun's 29500."""
        digits = "".join(ch for ch in self.job_id if ch.isdigit()) or "0"
        return 20000 + int(digits) % 10000

    @property
    def run_id(self) -> str:
        """The job id; a requeued allocation gets its own (a persistent control store,
        etcd, still holds the last allocation's rounds under the plain id)."""
        return self.job_id if not self.requeue else f"{self.job_id}-requeue{self.requeue}"


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    found = _named(environ, *names)
    return None if found is None else found[1]


def _named(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` set, and its value."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def _integer(environ: Mapping[str, str], name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SchedulerError(f"{name} is not an integer: {text!r}") from None


def slurm_launch(environ: Mapping[str, str]) -> SlurmLaunch | None:
    """The launch ``srun`` describes, or None outside a Slurm job step: the batch
    script's own shell has the job's variables and ``SLURM_NODEID=0`` too, but no step's
    (``SLURM_STEP_ID``, ``SLURM_STEP_NODELIST``, set by ``srun``), and a launcher there is
    alone. The step's variables come before the job's: a step may run on part of the
    allocation."""
    job_id = _first(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    node_id = _first(environ, "SLURM_NODEID")
    step = _first(environ, "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NODELIST")
    listed = _named(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if job_id is None or node_id is None or step is None or listed is None:
        return None
    hosts = expand_nodelist(listed[1])
    counted = _named(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    nodes = _integer(environ, counted[0], counted[1]) if counted else len(hosts)
    rank = _integer(environ, "SLURM_NODEID", node_id)
    if not 0 <= rank < nodes:
        raise SchedulerError(f"SLURM_NODEID {rank} is outside the step's {nodes} node(s)")
    tasks = _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    restarts = _first(environ, "SLURM_RESTART_COUNT")
    return SlurmLaunch(
        job_id=job_id,
        nodes=nodes,
        node_rank=rank,
        first_host=hosts[0],
        requeue=_integer(environ, "SLURM_RESTART_COUNT", restarts) if restarts else 0,
        tasks=_integer(environ, "SLURM_NTASKS", tasks) if tasks else None,
        hosts_from=listed[0],
        nodes_from=counted[0] if counted else listed[0],
    )
