"""Nodes in network namespaces of this machine, for partitions (needs root and iproute2's
``ip``; scripts/install.sh installs the latter).

    hub (this namespace): bridge <br>, 10.R.S.254/24: etcd members listen here
      |-- veth <v0> ---- namespace <n0>: eth0 10.R.S.1/24   (node 0's agent and workers)
      |-- veth <v1> ---- namespace <n1>: eth0 10.R.S.2/24
      ...

``cut(i)`` takes node i's link down on the hub's side: every packet to and from the node is
dropped (connections hang, as in a real partition, rather than being refused); ``heal(i)``
brings it back. Every name carries its process's id and a number, and ``close()`` removes
the namespaces and the bridge (a veth goes with its namespace), so runs side by side do not
meet.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import subprocess


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` on PATH (iproute2; scripts/install.sh installs it)"
    probe = f"chprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


# Whose a name is: this process's, as 4 hex digits after "chX" (pytest-xdist's workers
# run side by side; tests/conftest.py counts only its own process's names as a test's)
OWNER = f"{os.getpid() % 0x10000:04x}"


def mine(name: str) -> bool:
    """Whether a namespace or link name was made by this process (a ``Net`` of it)."""
    return name.startswith("ch") and name[3:7] == OWNER


# This process's nets, numbered: a random tag of one byte met the previous test's net,
# whose veth the kernel was still removing with its namespace ("File exists", seen in a
# run of tests/partitions).
_made_here = itertools.count()


class Net:
    def __init__(self, nodes: int) -> None:
        for attempt in range(4):
            tag = OWNER + f"{next(_made_here) % 256:02x}"
            self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"
            self.bridge = f"chb{tag}"
            self.namespaces = [f"chn{tag}{i}" for i in range(nodes)]
            self.links = [f"chv{tag}{i}" for i in range(nodes)]
            self._made: list[str] = []
            try:
                self._build()
                return
            except Exception as exc:
                self.close()
                # a name another run of this pid's number left (pid reuse): the next one
                if "File exists" not in str(exc) or attempt == 3:
                    raise

    @property
    def hub(self) -> str:
        return f"{self.subnet}.254"

    def ip(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(self.bridge)
        _ip("addr", "add", f"{self.hub}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (ns, link) in enumerate(zip(self.namespaces, self.links, strict=True)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
            self._made.append(link)  # (it goes with its namespace once its peer is there)
            _ip("link", "set", f"{link}p", "netns", ns)
            _ip("link", "set", f"{link}p", "name", "eth0", ns=ns)
            _ip("addr", "add", f"{self.ip(i)}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace (``ip netns exec`` execs it: the
        process's pid is the command's own)."""
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def cut(self, node: int) -> None:
        _ip("link", "set", self.links[node], "down")

    def heal(self, node: int) -> None:
        _ip("link", "set", self.links[node], "up")

    def close(self) -> None:
        for name in reversed(self._made):
            if name == self.bridge or name in self.links:  # (a veth: gone already, or not)
                subprocess.run(["ip", "link", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made = []
