"""``chameleon run`` arguments: torchrun's flags, spellings and defaults, plus ours.

Parsing stops at the training script: everything after it is the script's own, passed
through untouched (torchrun's REMAINDER). A torchrun flag we do not support is an error
that says so, never silently ignored. Errors raise ``ArgsError`` with one line.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field

from launcher.faults import ANY, FaultSpec, parse_fault

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h|d)?\s*$")
_SCALE = {"ms": 1e-3, "s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration_s(text: str) -> float:
    """'90', '90s', '15m', '3h', '250ms' -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (try 90s, 15m or 3h)")
    return float(match.group(1)) * _SCALE[match.group(2)]


class ArgsError(ValueError):
    """Bad command line; ``str()`` is one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit 2
        if "SCRIPT" in message and "required" in message:
            message = "no training script given (chameleon run [OPTIONS] SCRIPT [SCRIPT_ARGS...])"
        raise ArgsError(message)


# torchrun flags we refuse, with why, instead of accepting and ignoring them.
UNSUPPORTED = {
    "--event-log-handler": "chameleon writes its own JSON-lines event log (--events)",
    "--duplicate-stdout-filters": "not supported yet",
    "--duplicate-stderr-filters": "not supported yet",
    "--logs-specs": "not supported yet (logs go under --log-dir, per attempt and rank)",
    "--numa-binding": "not supported yet",
    "--virtual-local-rank": "not supported yet",
    "--signals-to-handle": "not supported yet (SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded)",
}


def _both(name: str) -> list[str]:
    """torchrun accepts --foo-bar and --foo_bar."""
    return [name, "--" + name[2:].replace("-", "_")] if "-" in name[2:] else [name]


def _parser() -> _Parser:
    p = _Parser(
        prog="chameleon run",
        add_help=False,
        allow_abbrev=False,
        usage="chameleon run [OPTIONS] SCRIPT [SCRIPT_ARGS...]",
        description="Launch and supervise a training job. Accepts torchrun's flags (both "
        "--foo-bar and --foo_bar) and gives workers torchrun's environment.",
    )
    t = p.add_argument_group("torchrun flags")
    add = t.add_argument
    add(
        *_both("--nnodes"),
        default="1:1",
        help="N or MIN:MAX nodes (elastic needs --rdzv-backend c10d)",
    )
    add(*_both("--nproc-per-node"), default="1", help="workers per node: N, auto, cpu or gpu")
    add(
        *_both("--rdzv-backend"), default="static", help="static (--node-rank) or c10d (join order)"
    )
    add(*_both("--rdzv-endpoint"), default="", help="HOST:PORT of the control store")
    add(*_both("--rdzv-id"), default="none", help="run id; agents of other run ids are refused")
    add(*_both("--rdzv-conf"), default="", help="key=value,... (join_timeout, last_call_timeout)")
    add("--standalone", action="store_true", help="one node, control store on a free local port")
    add(
        *_both("--max-restarts"),
        type=int,
        default=0,
        help="restarts of the workers before giving up",
    )
    add(
        *_both("--monitor-interval"),
        type=float,
        default=0.1,
        help="seconds between checks of the workers",
    )
    add(*_both("--start-method"), default="spawn", help="only spawn: workers are fresh processes")
    add("--role", default="default", help="ROLE_NAME for the workers")
    add("-m", "--module", action="store_true", help="SCRIPT is a module, as with python -m")
    add(*_both("--no-python"), action="store_true", help="run SCRIPT directly, not with python")
    add(
        *_both("--run-path"),
        action="store_true",
        help="run SCRIPT (an absolute path) with runpy.run_path",
    )
    add(
        *_both("--log-dir"),
        default=None,
        help="base folder for per-attempt, per-rank logs and events",
    )
    add(
        "-r",
        "--redirects",
        default="0",
        help="streams to files only: 0-3 or LOCAL_RANK:0-3,... (1 out, 2 err)",
    )
    add("-t", "--tee", default="0", help="streams to files and console, same format")
    add(
        *_both("--local-ranks-filter"),
        default="",
        help="local ranks whose output reaches the console",
    )
    add(*_both("--node-rank"), type=int, default=0, help="this node's rank (static rendezvous)")
    add(*_both("--master-addr"), default="127.0.0.1", help="address of node 0 (static rendezvous)")
    add(*_both("--master-port"), type=int, default=29500, help="control store port on node 0")
    add(*_both("--local-addr"), default=None, help="this node's address as others should see it")
    add(
        *_both("--shutdown-timeout"),
        type=float,
        default=None,
        help="seconds from SIGTERM to SIGKILL (30)",
    )
    for flag in UNSUPPORTED:
        add(
            *_both(flag),
            dest=f"unsupported_{flag[2:].replace('-', '_')}",
            default=None,
            nargs="?",
            const="",
            help=argparse.SUPPRESS,
        )
    c = p.add_argument_group("chameleon flags")
    add = c.add_argument
    add(*_both("--heartbeat-timeout"), type=float, default=30.0,
        help="liveness: seconds without a heartbeat before a worker or node counts as hung or "
        "lost (chameleon_runtime workers beat through steps of any length)")  # fmt: skip
    add(*_both("--step-timeout"), default="auto",
        help="progress: seconds a chameleon_runtime worker may go without completing a step; "
        "auto = 10x the slowest completed step, never under 60")  # fmt: skip
    add(*_both("--startup-timeout"), type=float, default=600.0,
        help="progress before the first step (imports, model build, checkpoint load) and "
        "while checkpointing")  # fmt: skip
    add(
        "--events",
        default=None,
        help="JSON-lines event log (default: events.jsonl in the run folder)",
    )
    add(
        *_both("--inject-fault"),
        action="append",
        default=[],
        help="kill|hang|exit:rank=R,at=SECONDS|step=N|phase=collect|plan|groups|migrate|confirm"
        "[,recovery=N][,after_ms=MS][,code=C][,attempt=A] (repeatable)",
    )
    add(
        *_both("--max-rejoins"),
        type=int,
        default=3,
        help="times each failed rank of a chameleon_runtime job is started again to rejoin it "
        "in place while it trains (0: go on without it)",
    )
    add(
        "--config",
        default=None,
        help="job config (TOML) whose [cluster] figures (device memory, links, restart and "
        "group-creation costs) and mtbf_hours the planner uses (chameleon_runtime jobs)",
    )
    add(
        "--policy",
        choices=["auto", "reroute", "reparallelize", "restart"],
        default="auto",
        help="force a recovery policy (chameleon_runtime jobs)",
    )
    add(
        "--migration-schedule",
        choices=["matched", "naive"],
        default="matched",
        help="how a re-partition moves layer state: matched (sources balanced, transfers in "
        "parallel rounds) or naive (Oobleck's restorer: each piece from its first holder, one "
        "transfer at a time; for comparison)",
    )
    add(
        "--mtbf",
        default=None,
        help="expected time to the next failure, D in the policy score (90s, 30m, 3h); "
        "default: learned from the failures seen, on a prior of the config's "
        "device_mtbf_hours (else Llama 3's rate) over the devices in use",
    )
    add(
        "--no-warm-start",
        dest="warm_start",
        action="store_false",
        help="restart workers as fresh interpreters, not from the warm fork server that has "
        "torch imported (one per node)",
    )
    add("--plain", action="store_true", help="plain output even on a terminal")
    p.add_argument(
        "training_script", metavar="SCRIPT", help="the training script (or module with -m)"
    )
    p.add_argument(
        "training_script_args",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT_ARGS",
        help="passed through untouched",
    )
    return p


def run_help() -> str:
    return _parser().format_help()


@dataclass(frozen=True)
class RunArgs:
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_id: str
    rdzv_conf: dict[str, str]
    standalone: bool
    max_restarts: int
    monitor_interval_s: float
    role: str
    module: bool
    no_python: bool
    run_path: bool
    log_dir: str | None
    redirects: dict[int, int]  # local rank -> 0 none, 1 stdout, 2 stderr, 3 both
    tee: dict[int, int]
    local_ranks_filter: frozenset[int] | None
    node_rank: int
    master_addr: str
    master_port: int
    local_addr: str | None
    shutdown_timeout_s: float
    heartbeat_timeout_s: float
    step_timeout_s: float | None  # None: automatic
    startup_timeout_s: float
    max_rejoins: int
    events: str | None
    faults: tuple[FaultSpec, ...]
    config: str | None
    policy: str
    migration_schedule: str
    mtbf_s: float | None  # None: learned (planner.failures)
    plain: bool
    warm_start: bool
    script: str
    script_args: tuple[str, ...] = field(default_factory=tuple)


def _nnodes(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)(?::(\d+))?", text.strip())
    if not match:
        raise ArgsError(f"--nnodes must be N or MIN:MAX, got {text!r}")
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if low < 1 or high < low:
        raise ArgsError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low, high


def _nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    if text == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise ArgsError("--nproc-per-node gpu, but no CUDA device is visible")
        return torch.cuda.device_count()
    if not text.isdigit() or int(text) < 1:
        raise ArgsError(
            f"--nproc-per-node must be a positive integer, auto, cpu or gpu, got {text!r}"
        )
    return int(text)


def _std_streams(text: str, flag: str, nproc: int) -> dict[int, int]:
    """torchrun's -r/-t format: '3' for every rank, or '0:1,1:2' per local rank."""
    text = text.strip()
    if re.fullmatch(r"[0-3]", text):
        return dict.fromkeys(range(nproc), int(text))
    out: dict[int, int] = {}
    for part in text.split(","):
        match = re.fullmatch(r"(\d+):([0-3])", part.strip())
        if not match:
            raise ArgsError(f"{flag} must be 0-3 or LOCAL_RANK:0-3,..., got {text!r}")
        out[int(match.group(1))] = int(match.group(2))
    return {r: out.get(r, 0) for r in range(nproc)}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ArgsError(f"--step-timeout must be auto or positive seconds, got {text!r}")
    return value


def _rdzv_conf(text: str) -> dict[str, str]:
    conf = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ArgsError(f"--rdzv-conf entries must be key=value, got {part!r}")
        key, value = part.split("=", 1)
        conf[key.strip()] = value.strip()
    return conf


def parse_run_args(argv: list[str]) -> RunArgs:
    ns = _parser().parse_args(argv)
    for flag in UNSUPPORTED:
        if getattr(ns, f"unsupported_{flag[2:].replace('-', '_')}") is not None:
            raise ArgsError(
                f"torchrun flag {flag} is not supported by chameleon run: {UNSUPPORTED[flag]}"
            )
    if ns.start_method != "spawn":
        raise ArgsError(
            f"--start-method {ns.start_method} is not supported: workers always start as fresh processes (spawn)"
        )
    if ns.rdzv_backend not in ("static", "c10d"):
        raise ArgsError(f"--rdzv-backend {ns.rdzv_backend} is not supported (use static or c10d)")
    if ns.max_restarts < 0:
        raise ArgsError("--max-restarts must be >= 0")
    if ns.max_rejoins < 0:
        raise ArgsError("--max-rejoins must be 0 or more")
    if ns.monitor_interval <= 0 or ns.heartbeat_timeout <= 0 or ns.startup_timeout <= 0:
        raise ArgsError(
            "--monitor-interval, --heartbeat-timeout and --startup-timeout must be positive"
        )
    step_timeout = None if ns.step_timeout == "auto" else _seconds(ns.step_timeout)
    if ns.run_path and not os.path.isabs(ns.training_script):
        raise ArgsError("--run-path needs the training script as an absolute path")
    min_nodes, max_nodes = _nnodes(ns.nnodes)
    nproc = _nproc(ns.nproc_per_node)
    if ns.standalone and max_nodes != 1:
        raise ArgsError("--standalone runs one node: drop --nnodes or set it to 1")
    if ns.rdzv_backend == "static" and min_nodes != max_nodes:
        raise ArgsError("--nnodes MIN:MAX needs --rdzv-backend c10d with --rdzv-endpoint")
    if not 0 <= ns.node_rank < max_nodes:
        raise ArgsError(f"--node-rank {ns.node_rank} is outside 0..{max_nodes - 1}")
    try:
        faults = tuple(parse_fault(spec) for spec in ns.inject_fault)
    except ValueError as exc:
        raise ArgsError(f"--inject-fault: {exc}") from None
    most = nproc * max_nodes  # ranks a round can have (every node runs --nproc-per-node)
    for spec, fault in zip(ns.inject_fault, faults, strict=True):
        if fault.rank != ANY and fault.rank >= most:
            raise ArgsError(
                f"--inject-fault {spec}: rank {fault.rank} is not in this job (ranks 0..{most - 1})"
            )
    if not 0 <= ns.master_port <= 65535:
        raise ArgsError(f"--master-port {ns.master_port} is not a port (0..65535)")
    if ns.rdzv_endpoint:
        _host, colon, port = ns.rdzv_endpoint.rpartition(":")
        if colon and not (port.isdigit() and int(port) <= 65535):
            raise ArgsError(
                f"--rdzv-endpoint must be HOST:PORT with a port 0..65535, got {ns.rdzv_endpoint!r}"
            )
    filter_ranks = None
    if ns.local_ranks_filter:
        try:
            filter_ranks = frozenset(int(x) for x in ns.local_ranks_filter.split(",") if x.strip())
        except ValueError:
            raise ArgsError(
                f"--local-ranks-filter must be comma-separated ranks, got {ns.local_ranks_filter!r}"
            ) from None
    mtbf_s = None
    if ns.mtbf is not None:
        try:
            mtbf_s = parse_duration_s(ns.mtbf)
        except ValueError as exc:
            raise ArgsError(f"--mtbf: {exc}") from None
        if mtbf_s <= 0:
            raise ArgsError("--mtbf must be positive")
    shutdown = ns.shutdown_timeout
    if shutdown is None:
        shutdown = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    return RunArgs(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        rdzv_backend=ns.rdzv_backend,
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        rdzv_conf=_rdzv_conf(ns.rdzv_conf),
        standalone=ns.standalone,
        max_restarts=ns.max_restarts,
        monitor_interval_s=ns.monitor_interval,
        role=ns.role,
        module=ns.module,
        no_python=ns.no_python,
        run_path=ns.run_path,
        log_dir=ns.log_dir,
        redirects=_std_streams(ns.redirects, "--redirects", nproc),
        tee=_std_streams(ns.tee, "--tee", nproc),
        local_ranks_filter=filter_ranks,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        local_addr=ns.local_addr,
        shutdown_timeout_s=shutdown,
        heartbeat_timeout_s=ns.heartbeat_timeout,
        step_timeout_s=step_timeout,
        startup_timeout_s=ns.startup_timeout,
        max_rejoins=ns.max_rejoins,
        events=ns.events,
        faults=faults,
        config=ns.config,
        policy=ns.policy,
        migration_schedule=ns.migration_schedule,
        mtbf_s=mtbf_s,
        plain=ns.plain,
        warm_start=ns.warm_start,
        script=ns.training_script,
        script_args=tuple(ns.training_script_args),
    )
