"""A real etcd cluster for the tests: three ``etcd`` members on 127.0.0.1, each its own
process with its own data folder, started from the ``etcd`` on PATH (installed by
scripts/install.sh from Debian's etcd-server package)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.launcher.helpers import free_port


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def etcd_binary() -> str | None:
    return shutil.which("etcd")


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    proc: subprocess.Popen | None = None
    host: str = "127.0.0.1"

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False


@dataclass
class EtcdCluster:
    members: list[Member] = field(default_factory=list)
    data_root: Path | None = None  # the members' data folders, on tmpfs (removed at stop)

    @property
    def endpoints(self) -> str:
        return ",".join(f"{m.host}:{m.client_port}" for m in self.members)

    def start(self, member: Member, initial: str, log: Path) -> None:
        member.proc = subprocess.Popen(
            [
                etcd_binary() or "etcd",
                "--name",
                member.name,
                "--data-dir",
                str(member.data_dir),
                "--listen-client-urls",
                member.client_url,
                "--advertise-client-urls",
                member.client_url,
                "--listen-peer-urls",
                member.peer_url,
                "--initial-advertise-peer-urls",
                member.peer_url,
                "--initial-cluster",
                initial,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                member.data_dir.parent.name,
                # Bounded history: the control plane's writes do not pile up revisions.
                "--auto-compaction-mode",
                "revision",
                "--auto-compaction-retention",
                "1000",
                # Raft's timing for a loaded 2-core host rather than a datacenter: etcd's
                # defaults (100 ms, 1 s) start an election whenever a member is
                # descheduled for a second, which a suite of real jobs beside it can do.
                # An election still ends within the agents' 5 s of patience
                # (launcher/etcd.py, UNREACHABLE_AFTER_S).
                "--heartbeat-interval",
                "150",
                "--election-timeout",
                "1500",
            ],  # fmt: skip
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # a killed test run leaves no etcd behind
        )

    def start_all(self, logs: Path) -> None:
        """Start every member (again, after a kill: each keeps its data folder)."""
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            self.start(m, initial, logs / f"{m.name}.log")

    def kill(self, index: int) -> None:
        proc = self.members[index].proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for i in range(len(self.members)):
            self.kill(i)
        if self.data_root is not None:
            shutil.rmtree(self.data_root, ignore_errors=True)


# free_port() hands out a port that was free a moment ago; another process can bind it
# before etcd does (CI, November 2026: "bind: address already in use"). Such a start is
# tried again on new ports; any other failure is reported at once.
BIND_RETRIES = 3
DATA_PREFIX = "chameleon-etcd-"  # tests/conftest.py looks for leftovers by it


def start_cluster(
    work: Path, size: int = 3, timeout_s: float = 30.0, host: str = "127.0.0.1"
) -> EtcdCluster:
    for attempt in range(BIND_RETRIES):
        cluster, logs = _try_cluster(work / f"try{attempt}", size, timeout_s, host)
        if cluster is not None:
            return cluster
        if "address already in use" not in logs:
            break
    raise RuntimeError(f"etcd cluster did not become healthy:\n{logs}")


def _try_cluster(
    work: Path, size: int, timeout_s: float, host: str
) -> tuple[EtcdCluster | None, str]:
    # Data on tmpfs where there is one: a member's fsync on a busy disk can take longer
    # than its election timeout. tests/conftest.py removes what a test leaves there.
    shm = Path("/dev/shm")
    prefix = f"{DATA_PREFIX}{os.getpid()}-"  # this pytest's (another may run beside it)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=shm if shm.is_dir() else None))
    cluster = EtcdCluster(data_root=root)
    work.mkdir(parents=True, exist_ok=True)
    for i in range(size):
        data = root / f"member{i}"
        cluster.members.append(Member(f"m{i}", free_port(), free_port(), data, host=host))
    cluster.start_all(work)
    deadline = time.monotonic() + timeout_s
    while not all(m.healthy() for m in cluster.members):
        if time.monotonic() > deadline or any(m.proc.poll() is not None for m in cluster.members):
            cluster.stop()
            logs = "".join((work / f"{m.name}.log").read_text()[-600:] for m in cluster.members)
            return None, logs
        time.sleep(0.2)
    return cluster, ""
