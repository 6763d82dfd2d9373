"""Collective benchmark worker: raw torch.distributed, ProcessGroupGang, raw JAX and JaxGang.

Run under torchrun (``python -m benchmarks.run`` does it for you)::

    torchrun --standalone --nproc-per-node 4 -m benchmarks.collectives --quick --out part.json

Every (collective, size) is timed for the four implementations interleaved in one loop (the
order rotates every iteration), after a warm-up that also compiles the JAX programs. Each
iteration starts after a barrier; each rank times its own call, and the per-rank times are
reduced with MAX after the loop (outside the timed region), so an iteration counts the slowest
rank. The reported time is the median over iterations.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.benchmath import IMPLS, OPS, PAIRS, Row, make_row, median, paired_ratio, table_header, table_line
from gang import ProcessGroupGang, ReduceOperation, get_default_device

Call = Callable[[], object]

FULL_MAX_BYTES = 64 << 20
QUICK_MAX_BYTES = 4 << 20


def sizes(max_bytes: int) -> list[int]:
    """Return the buffer sizes: 4 B, then every power of 4 up to ``max_bytes``."""
    out = [4]
    while out[-1] * 4 <= max_bytes:
        out.append(out[-1] * 4)
    return out


def iterations(nbytes: int, quick: bool) -> tuple[int, int]:
    """Return (warm-up, timed) iteration counts for a buffer of ``nbytes``: fewer for large buffers."""
    # Medians of fewer calls than this swing by tens of percent on a loaded 2-core machine.
    if quick:
        return (3, 40) if nbytes <= (256 << 10) else (2, 12)
    if nbytes <= (1 << 20):
        return 5, 100
    return (2, 30) if nbytes <= (16 << 20) else (1, 10)


def numel_for(nbytes: int, world_size: int, op: str) -> int:
    """Return the float32 element count of the full buffer: ``nbytes / 4``, rounded up so that ranks split it evenly."""
    numel = max(1, nbytes // 4)
    if op == "all_reduce" or op == "broadcast":
        return numel
    return -(-numel // world_size) * world_size


@dataclass
class Cases:
    """One zero-argument callable per implementation, each running the collective once to completion."""

    calls: dict[str, Call]


class TorchImpls:
    """Raw ``torch.distributed`` and :class:`ProcessGroupGang` on the default (gloo) group."""

    def __init__(self, gang: ProcessGroupGang) -> None:
        self.gang = gang
        self.n = gang.size
        self.device = gang.device

    def cases(self, op: str, numel: int) -> dict[str, Call]:
        """Return the ``torch`` and ``gang`` callables of ``op`` on a full buffer of ``numel`` floats."""
        n, gang = self.n, self.gang
        zeros = functools.partial(torch.zeros, device=self.device)
        chunk = numel // n if op not in ("all_reduce", "broadcast") else numel
        raw_in, gang_in = zeros(numel), zeros(numel)
        raw_out, gang_out = zeros(numel), zeros(numel)
        sum_ = dist.ReduceOp.SUM
        if op == "all_reduce":
            return {
                "torch": lambda: dist.all_reduce(raw_in, sum_),
                "gang": lambda: gang.all_reduce(gang_in, ReduceOperation.SUM),
            }
        if op == "all_gather":
            small_raw, small_gang = zeros(chunk), zeros(chunk)
            gang_rows = gang_out.view(n, chunk)
            return {
                "torch": lambda: dist.all_gather_single(raw_out, small_raw),
                "gang": lambda: gang.all_gather(gang_rows, small_gang),
            }
        if op == "reduce_scatter":
            out_raw, out_gang = zeros(chunk), zeros(chunk)
            gang_rows = gang_in.view(n, chunk)
            return {
                "torch": lambda: dist.reduce_scatter_single(out_raw, raw_in, sum_),
                "gang": lambda: gang.reduce_scatter(out_gang, gang_rows, ReduceOperation.SUM),
            }
        if op == "all_to_all":
            gin, gout = gang_in.view(n, chunk), gang_out.view(n, chunk)
            return {
                "torch": lambda: dist.all_to_all_single(raw_out, raw_in),
                "gang": lambda: gang.all_to_all(gout, gin),
            }
        if op == "broadcast":
            return {
                "torch": lambda: dist.broadcast(raw_in, src=0),
                "gang": lambda: gang.broadcast(gang_in, source_rank=0),
            }
        raise ValueError(op)


class JaxImpls:
    """Raw JAX (``jit(shard_map(...))`` over a mesh of the processes' devices) and :class:`gang_jax.JaxGang`."""

    def __init__(self) -> None:
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from gang_jax import JaxGang

        self.jax = jax
        self.gang = JaxGang.create_default()
        self.n = self.gang.size
        devices: dict[int, Any] = {}
        for device in sorted(jax.devices(), key=lambda d: d.id):
            devices.setdefault(device.process_index, device)
        self.me = devices[jax.process_index()]
        self.mesh = Mesh(np.array([devices[p] for p in range(jax.process_count())], dtype=object), ("x",))
        self.spec = cast(Callable[..., Any], PartitionSpec)("x")
        self.sharding = NamedSharding(self.mesh, self.spec)

    def _global(self, block: np.ndarray[Any, Any]) -> Any:
        """The global array ``[n * len(block)]`` whose shard on this process is ``block`` (already on device)."""
        local = self.jax.device_put(block, self.me)
        shape = (self.n * block.shape[0],)
        return self.jax.make_array_from_single_device_arrays(shape, self.sharding, [local])

    def _compile(self, body: Callable[[Any], Any]) -> Callable[[Any], Any]:
        mapped = self.jax.shard_map(body, mesh=self.mesh, in_specs=self.spec, out_specs=self.spec)
        return cast(Callable[[Any], Any], self.jax.jit(mapped))

    def cases(self, op: str, numel: int) -> dict[str, Call]:
        """Return the ``jax`` and ``gang-jax`` callables of ``op`` on a full buffer of ``numel`` floats."""
        jax, lax, n, gang = self.jax, self.jax.lax, self.n, self.gang
        chunk = numel // n if op not in ("all_reduce", "broadcast") else numel
        block = np.zeros(numel if op != "all_gather" else chunk, dtype=np.float32)
        x = self._global(block)
        if op == "all_reduce":
            fn = self._compile(lambda b: lax.psum(b, "x"))
            t = torch.zeros(numel)
            gang_call: Call = lambda: gang.all_reduce(t, ReduceOperation.SUM)  # noqa: E731
        elif op == "all_gather":
            fn = self._compile(lambda b: lax.all_gather(b, "x", tiled=True))
            inp, out = torch.zeros(chunk), torch.zeros(n, chunk)
            gang_call = lambda: gang.all_gather(out, inp)  # noqa: E731
        elif op == "reduce_scatter":
            fn = self._compile(lambda b: lax.psum_scatter(b, "x", scatter_dimension=0, tiled=True))
            inp, out = torch.zeros(n, chunk), torch.zeros(chunk)
            gang_call = lambda: gang.reduce_scatter(out, inp, ReduceOperation.SUM)  # noqa: E731
        elif op == "all_to_all":
            fn = self._compile(lambda b: lax.all_to_all(b, "x", 0, 0, tiled=True))
            inp, out = torch.zeros(n, chunk), torch.zeros(n, chunk)
            gang_call = lambda: gang.all_to_all(out, inp)  # noqa: E731
        elif op == "broadcast":
            fn = self._compile(lambda b: lax.psum(jax.numpy.where(lax.axis_index("x") == 0, b, 0), "x"))
            t = torch.zeros(numel)
            gang_call = lambda: gang.broadcast(t, source_rank=0)  # noqa: E731
        else:
            raise ValueError(op)
        return {"jax": lambda: fn(x).block_until_ready(), "gang-jax": gang_call}


def time_interleaved(
    calls: dict[str, Call], warmup: int, iters: int, device: torch.device | None = None
) -> dict[str, list[float]]:
    """Time every callable ``iters`` times, interleaved (rotating order), after ``warmup`` untimed rounds.

    Each call starts after a barrier. Returns, per implementation, the slowest rank's time of each
    iteration in seconds (a MAX all-reduce of the per-rank times, done after the loop). On a CUDA
    ``device`` each call is followed by a synchronisation, so the time covers the collective.
    """
    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    dist.barrier()
    local = torch.zeros(len(names), iters, dtype=torch.float64)
    clock = time.perf_counter
    for it in range(iters):
        shift = it % len(names)
        for k in range(len(names)):
            index = (k + shift) % len(names)
            call = calls[names[index]]
            dist.barrier()
            start = clock()
            call()
            if sync is not None:
                sync()  # CUDA collectives return before they finish
            local[index, it] = clock() - start
    slowest = local.to(device)
    dist.all_reduce(slowest, dist.ReduceOp.MAX)
    return {name: slowest[i].tolist() for i, name in enumerate(names)}


def main(argv: list[str] | None = None) -> None:
    """Run the collective benchmark on this torchrun rank; rank 0 prints the table and writes ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="sizes up to 4 MiB and fewer iterations")
    parser.add_argument("--out", required=True, help="JSON file of rows (written by rank 0)")
    parser.add_argument("--ops", nargs="*", default=list(OPS), choices=OPS)
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--max-bytes", type=int, default=None)
    args = parser.parse_args(argv)

    # gloo on CPU here; NCCL on `cuda:LOCAL_RANK` when the machine has GPUs (the same command).
    device = get_default_device()
    root = ProcessGroupGang.create_default_process_group(device)
    rank, n = root.rank, root.size
    if device.type != "cpu":  # JaxGang works on CPU tensors; compare JAX on GPUs with its own tools
        args.impls = [impl for impl in args.impls if impl not in ("jax", "gang-jax")]
    jax_impls = JaxImpls() if {"jax", "gang-jax"} & set(args.impls) else None
    torch_impls = TorchImpls(root)
    max_bytes = args.max_bytes or (QUICK_MAX_BYTES if args.quick else FULL_MAX_BYTES)
    rows: list[Row] = []
    if rank == 0:
        print(f"# collectives on {n} ranks (gloo / XLA CPU), float32, median of the slowest rank", flush=True)
        print(table_header(args.impls), flush=True)
    for op in args.ops:
        done: set[int] = set()
        for nbytes in sizes(max_bytes):
            numel = numel_for(nbytes, n, op)
            if numel in done:  # a tiny size rounded up to one already measured
                continue
            done.add(numel)
            calls = torch_impls.cases(op, numel)
            if jax_impls is not None:
                calls.update(jax_impls.cases(op, numel))
            calls = {name: calls[name] for name in args.impls}
            warmup, iters = iterations(numel * 4, args.quick)
            times = time_interleaved(calls, warmup, iters, device)
            by_impl = {name: make_row(name, op, numel * 4, n, median(ts), iters=iters) for name, ts in times.items()}
            rows.extend(by_impl.values())
            for ours, base in PAIRS:
                if ours in times and base in times:
                    by_impl[ours]["paired_ratio"] = paired_ratio(times[ours], times[base])
            if rank == 0:
                print(table_line(op, numel * 4, by_impl, args.impls), flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    if jax_impls is not None:
        jax_impls.gang.close()
    root.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
