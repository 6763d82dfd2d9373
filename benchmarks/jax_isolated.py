"""What ``JaxGang(isolated=True)`` costs against the in-process ``JaxGang``: paired per-iteration ratios.

Run under torchrun, on the CPU::

    torchrun --standalone --nproc-per-node 2 -m benchmarks.jax_isolated [--iters 200] [--sizes 64 64K 4M]

Every rank holds both kinds of gang over the same processes: an in-process one and an isolated
one (its JAX runtime in a child process, tensors through shared memory). For each collective and
size the two public calls are timed interleaved (the order alternates every iteration; each call
starts after a barrier of the torch group); an iteration counts the slowest rank. The table shows
the median over iterations of the per-iteration ratio isolated / in-process, and both medians.
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from gang.bench.collectives import gang_call, numel_for, time_interleaved, without_gloo_notice
from gang.bench.metrics import OPS, median, paired_ratio, parse_size
from gang_jax import JaxGang


def main() -> None:
    """Time both kinds of JaxGang on every collective and size; rank 0 prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200, help="timed iterations per size (a fifth of it from 1 MiB)")
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[64, 64 << 10, 4 << 20])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with without_gloo_notice():
        gangs = {"in-process": JaxGang.create_default(), "isolated": JaxGang.create_default(isolated=True)}
    try:
        if rank == 0:
            print(f"# JaxGang isolated / in-process on {dist.get_world_size()} ranks; load {os.getloadavg()}")
            print(f"{'op':>15} {'size':>9} {'in-process us':>14} {'isolated us':>12} {'ratio':>7}")
        for op in OPS:
            for nbytes in args.sizes:
                numel = numel_for(nbytes, dist.get_world_size(), op)
                iters = args.iters if nbytes < (1 << 20) else max(10, args.iters // 5)
                with without_gloo_notice():
                    times = time_interleaved({k: gang_call(g, op, numel) for k, g in gangs.items()}, 3, iters)
                if rank == 0:
                    base, iso = median(times["in-process"]), median(times["isolated"])
                    ratio = paired_ratio(times["isolated"], times["in-process"])
                    print(f"{op:>15} {numel * 4:>9} {base * 1e6:>14.1f} {iso * 1e6:>12.1f} {ratio:>7.2f}", flush=True)
    finally:
        for g in gangs.values():
            g.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
