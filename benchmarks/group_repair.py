"""A generation change's group, two ways: built fresh on the store, or repaired in place.

    python benchmarks/group_repair.py [--workers 2 4 8] [--rounds 5]

When a worker dies and the survivors stay members, the next generation needs a group over
the survivors. chameleon_runtime.comm builds a fresh one on the store under the new
generation's prefix (every backend, every torch). torch offers repair instead: gloo on
torch 2.14 reconfigures a group made with ``enable_reconfigure=True`` to a new set of
peers (``Backend.reconfigure``, what TorchFT 0.3 uses), and NCCL 2.29+ shrinks a
communicator (``ncclCommShrink``, ``torch.distributed.shrink_group``), skipping the
bootstrap that makes a new communicator cost seconds at thousands of ranks.

Each round forks N workers (torch imported once, here), builds their group, all-reduces
once, kills the last worker with SIGKILL, and times on every survivor, in alternating
order: the repair (where the backend supports it) and a fresh group, each up to the end
of its first all-reduce (a group is ready when it has carried one). A path's time is
the slowest survivor's, the generation change being done when every member is; medians
of ``--rounds``. Prints what this torch and backend support, so a run on a torch without
repair says so instead of timing nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from datetime import timedelta

TIMEOUT = timedelta(seconds=60)


def supports_reconfigure() -> bool:
    import torch.distributed as dist

    # (torch 2.14: a class property; each group made with enable_reconfigure=True says
    # so again, which worker() checks)
    return hasattr(dist.ProcessGroupGloo, "supports_reconfigure")


def reconfigure(group, store, uuid: int, members: list[int], me: int) -> None:  # noqa: ANN001
    """Re-form ``group`` over ``members`` (every one of them calls it): each publishes its
    handle under ``uuid``, then all reconfigure with the handles in member order."""
    from torch._C._distributed_c10d import ReconfigureOptions

    store.set(f"handle/{uuid}/{me}", group.get_reconfigure_handle())
    opts = ReconfigureOptions()
    opts.uuid = uuid
    opts.handles = [store.get(f"handle/{uuid}/{m}").decode() for m in members]
    opts.timeout = TIMEOUT
    group.reconfigure(opts).wait()


def paths(round_: int, repair: bool) -> list[str]:
    """The order a round times its paths in (alternating, so neither always goes first)."""
    if not repair:
        return ["fresh"]
    return ["repair", "fresh"] if round_ % 2 == 0 else ["fresh", "repair"]


def worker(rank: int, n: int, ports: tuple[int, int], round_: int, repair: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Rank 0 (a survivor) hosts the store: the parent forks with no thread of its own
    # running (a TCPStore server's thread, forked mid-lock, hung a child now and then).
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
        os.write(ports[1], store.port.to_bytes(4, "little") * n)  # (the parent and n-1 peers)
    else:
        port = int.from_bytes(os.read(ports[0], 4), "little")
        store = dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT)
    members = list(range(n))
    if repair:
        group = dist.ProcessGroupGloo(
            dist.PrefixStore("g", store), rank, n, TIMEOUT, enable_reconfigure=True
        )
        assert group.supports_reconfigure
        reconfigure(group, store, 1, members, rank)
    else:
        group = dist.ProcessGroupGloo(dist.PrefixStore("g", store), rank, n, TIMEOUT)
    tensor = torch.ones(1024)
    group.allreduce([tensor]).wait()
    store.add("ready", 1)
    if rank == n - 1:
        # killed once every member's all-reduce is done (killed mid-ring, its unread
        # bytes would reset a peer's connection with that peer's share still in flight)
        while store.add("ready", 0) < n:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["dead"])  # (the parent saw the kill: survivors start together)
    survivors = members[:-1]
    for path in paths(round_, repair):
        store.add(f"{path}/start", 1)
        store.wait([f"{path}/go"])
        t0 = time.perf_counter()
        if path == "repair":
            reconfigure(group, store, 2, survivors, rank)
            used = group
        else:
            used = dist.ProcessGroupGloo(dist.PrefixStore("fresh", store), rank, n - 1, TIMEOUT)
        tensor = torch.ones(1024)
        used.allreduce([tensor]).wait()
        elapsed = time.perf_counter() - t0
        assert tensor[0].item() == n - 1, tensor[0].item()
        store.set(f"{path}/{rank}", f"{elapsed!r}")
    if rank == 0:  # (the store outlives the parent's last read)
        store.wait(["done"])


def one_round(n: int, round_: int, repair: bool) -> dict[str, float]:
    import torch.distributed as dist

    from launcher.forkserver import die_with_parent

    ports = os.pipe()
    parent = os.getpid()
    children = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:  # (the child never returns: os._exit whatever happens)
            code = 1
            try:
                die_with_parent(parent)  # (never orphaned: SIGKILL with the benchmark)
                worker(rank, n, ports, round_, repair)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    try:
        port = int.from_bytes(os.read(ports[0], 4), "little")
        store = dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT)
        os.waitpid(children[-1], 0)  # the killed one
        store.set("dead", "1")
        times: dict[str, float] = {}
        for path in paths(round_, repair):
            deadline = time.monotonic() + TIMEOUT.total_seconds()
            while store.add(f"{path}/start", 0) < n - 1:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"round {round_}: the survivors never reached {path}")
                time.sleep(0.001)
            store.set(f"{path}/go", "1")
            keys = [f"{path}/{r}" for r in range(n - 1)]
            store.wait(keys)
            times[path] = max(float(store.get(k)) for k in keys)
        store.set("done", "1")
        for pid in children[:-1]:
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError(f"a survivor of round {round_} failed")
        return times
    finally:
        os.close(ports[0])
        os.close(ports[1])
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if min(args.workers) < 2:
        print("group_repair.py: --workers: at least 2 (one is killed)", file=sys.stderr)
        return 2

    import torch

    repair = supports_reconfigure()
    print(
        f"torch {torch.__version__}, gloo: "
        + ("reconfigure (enable_reconfigure=True)" if repair else "no repair (fresh groups only)")
        + f"; slowest survivor, medians of {args.rounds} rounds"
    )
    print(f"  {'workers':>7}  {'fresh':>9}  {'repair':>9}  repair/fresh")
    for n in args.workers:
        rounds = [one_round(n, r, repair) for r in range(args.rounds + 1)][1:]  # (1st: warm-up)
        fresh = statistics.median(t["fresh"] for t in rounds)
        if repair:
            mended = statistics.median(t["repair"] for t in rounds)
            print(f"  {n:>7}  {fresh * 1e3:7.2f}ms  {mended * 1e3:7.2f}ms  {mended / fresh:11.2f}x")
        else:
            print(f"  {n:>7}  {fresh * 1e3:7.2f}ms  {'-':>9}")
    if torch.cuda.is_available():
        print(
            "NCCL: a communicator holds one rank per GPU, so its shrink needs a GPU per "
            f"worker; {torch.cuda.device_count()} visible (benchmarks/nccl_transition.py "
            "times one rank's rebuild)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
