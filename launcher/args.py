"""``chameleon run`` arguments: torchrun's flags, spellings and defaults, plus ours.

Parsing stops at the training script: everything after it is the script's own, passed
through untouched (torchrun's REMAINDER). A torchrun flag we do not support is an error
that says so, never silently ignored. Errors raise ``ArgsError`` with one line.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field

from launcher.faults import ANY, FaultSpec, parse_fault
from launcher.flags import (  # noqa: F401 - ArgsError and run_help re-exported
    UNSUPPORTED,
    ArgsError,
    Parser,
    parser,
    run_help,
)
from launcher.scheduler import SchedulerError, SlurmLaunch, slurm_launch

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|min|h|d)?\s*$")
_SCALE = {"ms": 1e-3, "s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration_s(text: str) -> float:
    """'90', '90s', '15m', '3h', '250ms' -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (try 90s, 15m or 3h)")
    return float(match.group(1)) * _SCALE[match.group(2)]


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
    require_faults: bool
    config: str | None
    policy: str
    migration_schedule: str
    stragglers: str  # --stragglers auto|on|off (launcher/stragglers.py)
    mtbf_s: float | None  # None: learned (planner.job.failures)
    plain: bool
    json: bool
    warm_start: bool
    preload: str  # --preload (launcher/preload.py)
    script: str
    script_args: tuple[str, ...] = field(default_factory=tuple)
    # Signals that are preemption notices (save, then exit 75): the ones the user named
    # in --signals-to-handle, SIGINT aside. The others of torchrun's four stop the run.
    preempt_signals: frozenset[int] = frozenset()
    preemption_grace_s: float = 25.0
    # --rdzv-backend etcd: how long training goes on while no etcd member answers.
    control_outage_timeout_s: float = 300.0
    requeue: int = 0  # SLURM_RESTART_COUNT: times the scheduler requeued this job
    # Settings taken from the environment, as "--flag VALUE (VARIABLE)": said at start.
    from_env: tuple[str, ...] = ()
    health_check: str | None = None  # --health-check CMD (launcher/health.py)


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


def _signals(text: str) -> frozenset[int]:
    found = set()
    for name in filter(None, (n.strip() for n in text.split(","))):
        upper = name.upper()
        try:
            number = (
                signal.Signals(int(name))
                if name.isdigit()
                else signal.Signals[upper if upper.startswith("SIG") else f"SIG{upper}"]
            )
        except (KeyError, ValueError):
            number = None
        if number is None or number in (signal.SIGKILL, signal.SIGSTOP):
            raise ArgsError(f"--signals-to-handle: {name!r} is not a signal that can be handled")
        found.add(int(number))
    return frozenset(found)


def _given(argv: list[str]) -> set[str]:
    """The destinations the command line itself sets (not defaults, not PET_*)."""
    p = parser(environ={})
    for action in p._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    return set(vars(p.parse_args(argv)))


# Rendezvous settings Slurm gives where neither a flag nor PET_* does.
def _from_slurm(slurm: SlurmLaunch) -> dict[str, str]:
    return {
        "nnodes": str(slurm.nodes),
        "node_rank": str(slurm.node_rank),
        "master_addr": slurm.first_host,
        "master_port": str(slurm.port),
        "rdzv_id": slurm.run_id,
    }


def _slurm_sources(slurm: SlurmLaunch) -> dict[str, str]:
    return {
        "nnodes": slurm.nodes_from,
        "node_rank": "SLURM_NODEID",
        "master_addr": slurm.hosts_from,
        "master_port": "SLURM_JOB_ID",
        "rdzv_id": "SLURM_JOB_ID",
    }


def _environment(argv: list[str], environ: Mapping[str, str]) -> tuple[Parser, list[str], int]:
    """The parser with torchrun's PET_* defaults and, under srun, Slurm's; the settings
    so taken ("--flag VALUE (VARIABLE)"); the requeue count."""
    p = parser(environ)
    taken = [f"{_flag(p, d)} {p.get_default(d)} ({v})" for d, v in p.from_env.items()]
    try:
        slurm = slurm_launch(environ)
    except SchedulerError as exc:
        raise ArgsError(str(exc)) from None
    if slurm is None:
        return p, taken, 0
    given = _given(argv)
    if "standalone" in given or p.get_default("standalone") is True:
        return p, taken, slurm.requeue  # one node, as asked
    given |= set(p.from_env)
    fill = {d: v for d, v in _from_slurm(slurm).items() if d not in given}
    if fill.keys() & {"nnodes", "node_rank", "master_addr"}:
        try:
            slurm.check_one_per_node()
        except SchedulerError as exc:
            raise ArgsError(str(exc)) from None
    p.set_defaults(**fill)
    sources = _slurm_sources(slurm)
    taken += [f"{_flag(p, d)} {v} ({sources[d]})" for d, v in fill.items()]
    return p, taken, slurm.requeue


def _flag(p: Parser, dest: str) -> str:
    action = next(a for a in p._actions if a.dest == dest)
    return max(action.option_strings, key=len)


def parse_run_args(argv: list[str], environ: Mapping[str, str] | None = None) -> RunArgs:
    """``environ``: where PET_* and SLURM_* are read (os.environ when None)."""
    p, taken, requeue = _environment(argv, os.environ if environ is None else environ)
    try:
        return _parse(p, argv, taken, requeue)
    except ArgsError as exc:  # a bad value the environment gave: say which variable
        given = _given(argv)
        named = [
            f"{var}={p.get_default(dest)!r}"
            for dest, var in p.from_env.items()
            if dest not in given and _flag(p, dest) in str(exc)
        ]
        if named:
            raise ArgsError(f"{exc} (from the environment: {', '.join(named)})") from None
        raise


def _parse(p: Parser, argv: list[str], taken: list[str], requeue: int) -> RunArgs:
    ns = p.parse_args(argv)
    for flag in UNSUPPORTED:
        if getattr(ns, f"unsupported_{flag[2:].replace('-', '_')}") is not None:
            raise ArgsError(
                f"torchrun flag {flag} is not supported by chameleon run: {UNSUPPORTED[flag]}"
            )
    if ns.start_method != "spawn":
        raise ArgsError(
            f"--start-method {ns.start_method} is not supported: workers always start as fresh processes (spawn)"
        )
    if ns.rdzv_backend not in ("static", "c10d", "etcd"):
        raise ArgsError(
            f"--rdzv-backend {ns.rdzv_backend} is not supported (use static, c10d or etcd)"
        )
    if ns.rdzv_backend == "etcd" and not ns.rdzv_endpoint:
        raise ArgsError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]")
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
        raise ArgsError("--nnodes MIN:MAX needs --rdzv-backend c10d or etcd with --rdzv-endpoint")
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
    for endpoint in filter(None, ns.rdzv_endpoint.split(",")):
        _host, colon, port = endpoint.split("://")[-1].rstrip("/").rpartition(":")
        if colon and not (port.isdigit() and int(port) <= 65535):
            raise ArgsError(
                f"--rdzv-endpoint must be HOST:PORT with a port 0..65535, got {endpoint!r}"
            )
        if "," in ns.rdzv_endpoint and ns.rdzv_backend != "etcd":
            raise ArgsError("several --rdzv-endpoint addresses need --rdzv-backend etcd")
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
    named = _signals(ns.signals_to_handle)
    if "signals_to_handle" in p.from_env or "signals_to_handle" in _given(argv):
        preempt = named - {signal.SIGINT}
    else:
        preempt = frozenset()
    if ns.preemption_grace <= 0:
        raise ArgsError("--preemption-grace must be positive seconds")
    if ns.control_outage_timeout <= 0:
        raise ArgsError("--control-outage-timeout must be positive seconds")
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
        require_faults=ns.require_faults,
        config=ns.config,
        policy=ns.policy,
        migration_schedule=ns.migration_schedule,
        stragglers=ns.stragglers,
        mtbf_s=mtbf_s,
        plain=ns.plain,
        json=ns.json,
        warm_start=ns.warm_start,
        preload=ns.preload,
        script=ns.training_script,
        script_args=tuple(ns.training_script_args),
        preempt_signals=preempt,
        preemption_grace_s=ns.preemption_grace,
        control_outage_timeout_s=ns.control_outage_timeout,
        requeue=requeue,
        from_env=tuple(taken),
        health_check=ns.health_check or None,
    )
