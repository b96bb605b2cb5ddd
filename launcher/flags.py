"""``chameleon run``'s flags: torchrun's, with their spellings (``--foo-bar`` and
``--foo_bar``), defaults and ``PET_*`` variables, then ours; parsed into ``RunArgs`` by
launcher/args.py."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from launcher.scheduler import SchedulerError, pet_name, pet_switch


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
}
# torchrun's default: stop on these (ours: within seconds, launcher/agent.py). Signals the
# user names in --signals-to-handle are preemption notices instead (docs/clusters.md).
STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def _both(name: str) -> list[str]:
    """torchrun accepts --foo-bar and --foo_bar."""
    return [name, "--" + name[2:].replace("-", "_")] if "-" in name[2:] else [name]


class Parser(_Parser):
    """The parser, and which of its defaults came from torchrun's ``PET_*`` variables."""

    from_env: dict[str, str]  # dest -> the variable its default came from


def parser(environ: Mapping[str, str] | None = None) -> Parser:
    """``environ``: where ``PET_*`` defaults are read (os.environ when None)."""
    p = Parser(
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
        help="N or MIN:MAX nodes (elastic needs --rdzv-backend c10d or etcd)",
    )
    add(*_both("--nproc-per-node"), default="1", help="workers per node: N, auto, cpu or gpu")
    add(
        *_both("--rdzv-backend"),
        default="static",
        help="static (--node-rank), c10d (join order) or etcd (join order; survives any node)",
    )
    add(
        *_both("--rdzv-endpoint"),
        default="",
        help="HOST:PORT of the control store (etcd: its members, comma-separated)",
    )
    add(*_both("--rdzv-id"), default="none", help="run id; agents of other run ids are refused")
    add(
        *_both("--rdzv-conf"),
        default="",
        help="key=value,... (join_timeout, last_call_timeout, token)",
    )
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
    add(
        *_both("--signals-to-handle"),
        default=STOP_SIGNALS,
        help="left out, torchrun's " + STOP_SIGNALS + " stop the run; given (or PET_*), every "
        "signal named but SIGINT is a preemption notice instead (unlike torchrun): the "
        "workers save at their next step and the run exits 75, requeue me (docs/clusters.md)",
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
    p.from_env = _env_defaults(t, os.environ if environ is None else environ)
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
        "[,recovery=N][,after_ms=MS][,code=C][,attempt=A|any], or "
        "slow:rank=R,factor=F,at=SECONDS|step=N[,for=SECONDS] (repeatable)",
    )
    add(
        *_both("--require-faults"),
        action="store_true",
        help="exit 4 if no --inject-fault fault fired on this node (a run that finished "
        "without the failure it was to test)",
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
        "--stragglers",
        choices=["auto", "on", "off"],
        default="auto",
        help="plan around a worker slower than its peers (an uneven deal, when it pays over "
        "the time the slowdown has lasted) and back once it has its speed again: on; off: "
        "stragglers are only reported; auto (default): on where each worker has a device "
        "or a core of its own, off where CPU workers outnumber their host's cores (there "
        "the scheduler's shares, not the workers, differ) (chameleon_runtime jobs)",
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
    add(
        "--preload",
        default="auto",
        metavar="MODULES",
        help="what the warm fork server imports besides torch, so that restarted workers "
        "do not: auto (the script's top-level third-party imports, read from its source; "
        "not even torch for a script that imports only the standard library), none, or "
        "comma-separated module names (may include auto)",
    )
    add(
        "--preemption-grace",
        type=float,
        default=25.0,
        metavar="SECONDS",
        help="after a preemption notice (--signals-to-handle), how long the workers have to "
        "save before they are stopped; a little under the scheduler's own grace (Slurm's "
        "--signal=USR1@N, Kubernetes' terminationGracePeriodSeconds)",
    )
    add(
        "--control-outage-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="--rdzv-backend etcd: how long the job trains on while no etcd member answers "
        "before this node gives up (exit 3); a failure meanwhile is recovered once etcd is "
        "back",
    )
    add(
        *_both("--health-check"),
        default=None,
        metavar="CMD",
        help="a shell command run on the node before it joins a rendezvous and before a "
        "replacement starts there; non-zero exit (or no answer in 60 s): not admitted",
    )
    add("--plain", action="store_true", help="plain output even on a terminal")
    add(
        "--json",
        action="store_true",
        help="at the end, how the run ended as one JSON object on stdout (exit code, "
        "failures, faults that never fired) instead of the summary",
    )
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


def _env_defaults(group: argparse._ArgumentGroup, environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's defaults from ``PET_<FLAG>`` (its long name, upper case, underscores),
    for every torchrun flag, the refused ones included (set, they are refused as given)."""
    found = {}
    for action in group._group_actions:
        longest = max(action.option_strings, key=len)
        name = pet_name(longest.lstrip("-").replace("-", "_"))
        if name not in environ:
            continue
        if action.nargs == 0:  # a switch: 0 off, 1 on
            try:
                value = pet_switch(environ, longest.lstrip("-").replace("-", "_"))
            except SchedulerError as exc:
                raise ArgsError(str(exc)) from None
            if value is None:
                continue
            action.default = value
        else:
            action.default = environ[name]
        found[action.dest] = name
    return found


def run_help() -> str:
    return parser().format_help()
