"""What one node's workers are started with for one round: the command torchrun would run
and the round's settings, from ``chameleon run``'s arguments and the round's world."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from chameleon_runtime.protocol.messages import STORE_FILE_ENV, STORE_LINK_ENV, STORE_WAIT_ENV
from chameleon_runtime.protocol.seal import TOKEN_ENV
from launcher.args import RunArgs
from launcher.rendezvous import NodeInfo, World
from launcher.watch import Timeouts as WatchTimeouts

RUN_PATH_SNIPPET = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def worker_command(
    script: str, args: Sequence[str], *, module: bool, no_python: bool, run_path: bool
) -> list[str]:
    """torchrun's: python -u SCRIPT, python -u -m MODULE, SCRIPT (--no-python), or
    runpy.run_path in a fresh interpreter (--run-path)."""
    if run_path:
        return [sys.executable, "-u", "-c", RUN_PATH_SNIPPET, script, *args]
    if no_python:
        return [script, *args]
    if module:
        return [sys.executable, "-u", "-m", script, *args]
    return [sys.executable, "-u", script, *args]


# Per node: where its agent writes the address of a moved worker store (launcher/agent.py, a successor).
STORE_FILE = "worker_store.json"


@dataclass
class RoundSettings:
    attempt: int
    node_rank: int
    num_nodes: int
    rank_offset: int
    world_size: int
    nproc: int
    role: str
    master_addr: str
    master_port: int
    max_restarts: int
    run_id: str
    log_dir: Path
    redirects: dict[int, int]
    tee: dict[int, int]
    local_ranks_filter: frozenset[int] | None
    watch: WatchTimeouts
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        a: RunArgs,
        world: World,
        me: NodeInfo,
        *,
        run_id: str,
        run_dir: Path,
        token: str | None = None,
    ) -> RoundSettings:
        """This node's settings for one round, from ``chameleon run``'s arguments."""
        watch = WatchTimeouts(a.heartbeat_timeout_s, a.step_timeout_s, a.startup_timeout_s)
        return cls(
            attempt=world.attempt, node_rank=me.node_rank, num_nodes=len(world.nodes),
            rank_offset=me.rank_offset, world_size=world.world_size, nproc=me.nproc,
            role=a.role, master_addr=world.worker_addr, master_port=world.worker_port,
            max_restarts=a.max_restarts, run_id=run_id, log_dir=run_dir,
            redirects=a.redirects, tee=a.tee, local_ranks_filter=a.local_ranks_filter,
            watch=watch,
            extra_env={
                # This launch's folder, the same for every attempt: a script can keep its
                # checkpoints there, so a restart resumes and a new launch starts fresh.
                "CHAMELEON_RUN_DIR": str(run_dir),
                "CHAMELEON_HEARTBEAT_S": f"{watch.beat_period_s:g}",
                # The preemption notices (--signals-to-handle) cr.preempted() takes over
                # in a plain script (chameleon_runtime.preemption).
                **(
                    {"CHAMELEON_PREEMPT_SIGNALS": ",".join(map(str, sorted(a.preempt_signals)))}
                    if a.preempt_signals
                    else {}
                ),
                **(store_move_env(a, run_dir) if a.rdzv_backend == "etcd" else {}),
                **({TOKEN_ENV: token} if token else {}),
            },
        )  # fmt: skip

    def moved_to(self, addr: str, port: int) -> RoundSettings:
        """The same round with its worker store moved (a new leader's): replacements
        spawned from now on go there."""
        return replace(self, master_addr=addr, master_port=port)


def store_move_env(a: RunArgs, run_dir: Path) -> dict[str, str]:
    """Where a worker finds its store once a new leader serves it (chameleon_runtime.
    storeaddr), and how long it waits for one: the old leader's lease must run out
    (--heartbeat-timeout), then an election, then the store. A connection to the old
    store that its host leaves unanswered for --heartbeat-timeout counts as lost
    (chameleon_runtime.protocol.link): the old leader's lease is out by then too."""
    return {
        STORE_FILE_ENV: str(run_dir / STORE_FILE),
        STORE_WAIT_ENV: f"{3 * a.heartbeat_timeout_s + 30:g}",
        STORE_LINK_ENV: f"{a.heartbeat_timeout_s:g}",
    }
