"""The environment a worker gets: exactly torchrun's variables (torch 2.x,
LocalElasticAgent._start_workers), so a script written for torchrun runs unchanged, plus
CHAMELEON_* variables that chameleon_runtime reads and plain scripts ignore."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerIdentity:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int  # node rank
    group_world_size: int  # number of nodes
    role: str
    role_rank: int
    role_world_size: int


def worker_env(
    base: Mapping[str, str],
    who: WorkerIdentity,
    *,
    master_addr: str,
    master_port: int,
    restart_count: int,
    max_restarts: int,
    run_id: str,
    error_file: str,
    chameleon: Mapping[str, str],
) -> dict[str, str]:
    env = dict(base)
    env.update(
        {
            "RANK": str(who.rank),
            "LOCAL_RANK": str(who.local_rank),
            "GROUP_RANK": str(who.group_rank),
            "ROLE_RANK": str(who.role_rank),
            "ROLE_NAME": who.role,
            "LOCAL_WORLD_SIZE": str(who.local_world_size),
            "WORLD_SIZE": str(who.world_size),
            "GROUP_WORLD_SIZE": str(who.group_world_size),
            "ROLE_WORLD_SIZE": str(who.role_world_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            # Workers reach the store the agent hosts for this attempt (a fresh one each
            # attempt: see launcher/store.py for why reusing one breaks gloo restarts).
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_file,
        }
    )
    # torchrun sets OMP_NUM_THREADS=1 when unset and more than one worker shares a node.
    if "OMP_NUM_THREADS" not in base and who.local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    env.update(chameleon)
    return env


def current_env() -> dict[str, str]:
    return dict(os.environ)
