"""What an NCCL communicator costs a recovery: build, first collective, abort, rebuild.

    python benchmarks/nccl_transition.py [--rounds 5] [--mib 64]

The planner's transition model charges a generation's new groups (planner.estimator.transition:
``pg_init_base_s`` + ``pg_init_per_worker_s`` per member); on NCCL those figures were
estimates. This measures, on one GPU, the runtime's own path
(chameleon_runtime.transport.NativeTransport): a ProcessGroupNCCL made on a TCPStore,
its first all-reduce (NCCL creates the communicator lazily, at the first collective),
a steady all-reduce of ``--mib``, the abort a recovery makes of the old generation's group
(NativeTransport.abort), and a rebuild under a new store prefix, as the next generation
does. One rank per communicator (one GPU holds one rank of an NCCL communicator), so the
figures are the single-member floor of the model's base cost: bootstrap over the network
and the ring's set-up across nodes come on top at scale. Medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from chameleon_runtime.transport import NativeTransport

    if not torch.cuda.is_available():
        print("nccl_transition.py: no CUDA GPU visible", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    transport = NativeTransport("cuda:0")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    tensor = torch.ones(args.mib * 2**20 // 4, device="cuda")
    timeout = timedelta(seconds=30)
    phases: dict[str, list[float]] = {"make": [], "first": [], "steady": [], "abort": []}

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        phases[name].append(time.perf_counter() - t0)
        return out

    for generation in range(args.rounds + 1):  # the first round warms the process up
        prefixed = dist.PrefixStore(f"gen{generation}", store)
        group = timed("make", lambda s=prefixed: transport.make_group(s, 0, 1, timeout))
        timed("first", lambda g=group: transport.post_allreduce(g, tensor).wait())
        timed("steady", lambda g=group: transport.post_allreduce(g, tensor).wait())
        timed("abort", lambda g=group: transport.abort(g))
        if generation == 0:
            for values in phases.values():
                values.clear()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL "
          f"{'.'.join(map(str, torch.cuda.nccl.version()))}; medians of {args.rounds}")  # fmt: skip
    for name, values in phases.items():
        print(f"  {name:7} {statistics.median(values) * 1e3:9.2f} ms")
    rebuild = [m + f for m, f in zip(phases["make"], phases["first"], strict=True)]
    print(f"  rebuild (make + first collective) {statistics.median(rebuild) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
