"""The collective measurements of :mod:`gang.bench`: raw torch.distributed, ProcessGroupGang, raw JAX and JaxGang.

Every (collective, size) is timed for the four implementations interleaved in one loop (the
order rotates every iteration), after a warm-up that also compiles the JAX programs. Each
iteration starts after a barrier; each rank times its own call, and the per-rank times are
reduced with MAX after the loop (outside the timed region), so an iteration counts the slowest
rank. The reported time is the median over iterations.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from gang import Gang, ProcessGroupGang, ReduceOperation
from gang.bench.metrics import PAIRS, Row, make_row, median, paired_ratio

Call = Callable[[], object]

FULL_MAX_BYTES = 64 << 20
QUICK_MAX_BYTES = 4 << 20


def sizes(max_bytes: int) -> list[int]:
    """Return the buffer sizes: 4 B, then every power of 4 up to ``max_bytes``."""
    out = [4]
    while out[-1] * 4 <= max_bytes:
        out.append(out[-1] * 4)
    return out


def iterations(nbytes: int, quick: bool, iters: int | None = None) -> tuple[int, int]:
    """Return (warm-up, timed) iteration counts for a buffer of ``nbytes``: fewer for large buffers.

    With ``iters``, that many timed iterations (and a tenth of it, at least one, to warm up).
    """
    if iters is not None:
        return max(1, iters // 10), iters
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


GLOO_NOTICE = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+"
)


@contextlib.contextmanager
def without_gloo_notice() -> Iterator[None]:
    """Drop the line ``[Gloo] Rank r is connected to n peer ranks. ...`` from this process's stdout meanwhile.

    The gloo library bundled with jaxlib prints it on stdout (file descriptor 1) when JAX's CPU
    collectives first connect, with no setting to turn it off (``GLOO_LOG_LEVEL`` only governs
    torch's own copy of gloo). Stdout is held in a temporary file meanwhile, and everything else
    written to it is passed on; stderr, where errors go, is left alone.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not GLOO_NOTICE.fullmatch(line.strip()):
                    sys.stdout.write(line)
            sys.stdout.flush()


def gang_call(gang: Gang, op: str, numel: int) -> Call:
    """Return the public call of ``op`` on ``gang`` for a full float32 buffer of ``numel`` elements.

    Fresh tensors in the gang's layout (``[size, chunk]`` rows where the collective has rows),
    made once: the callable runs only the collective.
    """
    n = gang.size
    chunk = numel // n if op not in ("all_reduce", "broadcast") else numel
    zeros = functools.partial(torch.zeros, device=gang.device)
    if op == "all_reduce":
        t = zeros(numel)
        return lambda: gang.all_reduce(t, ReduceOperation.SUM)
    if op == "all_gather":
        inp, out = zeros(chunk), zeros(n, chunk)
        return lambda: gang.all_gather(out, inp)
    if op == "reduce_scatter":
        rows, one = zeros(n, chunk), zeros(chunk)
        return lambda: gang.reduce_scatter(one, rows, ReduceOperation.SUM)
    if op == "all_to_all":
        inp, out = zeros(n, chunk), zeros(n, chunk)
        return lambda: gang.all_to_all(out, inp)
    if op == "broadcast":
        t = zeros(numel)
        return lambda: gang.broadcast(t, source_rank=0)
    raise ValueError(op)


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
        with without_gloo_notice():  # JAX's collectives connect on their first call
            for call in self.cases("all_reduce", 1).values():
                call()

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
        elif op == "all_gather":
            fn = self._compile(lambda b: lax.all_gather(b, "x", tiled=True))
        elif op == "reduce_scatter":
            fn = self._compile(lambda b: lax.psum_scatter(b, "x", scatter_dimension=0, tiled=True))
        elif op == "all_to_all":
            fn = self._compile(lambda b: lax.all_to_all(b, "x", 0, 0, tiled=True))
        elif op == "broadcast":
            fn = self._compile(lambda b: lax.psum(jax.numpy.where(lax.axis_index("x") == 0, b, 0), "x"))
        else:
            raise ValueError(op)
        return {"jax": lambda: fn(x).block_until_ready(), "gang-jax": gang_call(gang, op, numel)}


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


def measure(
    root: ProcessGroupGang,
    *,
    ops: Sequence[str],
    impls: Sequence[str],
    sizes: Sequence[int],
    quick: bool = False,
    iters: int | None = None,
    on_row: Callable[[str, int, dict[str, Row]], None] | None = None,
    on_progress: Callable[[str, int, int, int], None] | None = None,
) -> list[Row]:
    """Time every collective of ``ops`` at every size of ``sizes`` for each of ``impls``; return the rows.

    Called on every rank of ``root`` (a gang on torch's default process group). The JAX
    implementations create a :class:`gang_jax.JaxGang` over the same processes and close it at the
    end. ``on_progress(op, nbytes, index, total)`` is called before and ``on_row(op, nbytes,
    rows_by_impl)`` after each measurement, on every rank.
    """
    n = root.size
    jax_impls = JaxImpls() if {"jax", "gang-jax"} & set(impls) else None
    torch_impls = TorchImpls(root)
    rows: list[Row] = []
    plan = []
    for op in ops:
        done: set[int] = set()
        for nbytes in sizes:
            numel = numel_for(nbytes, n, op)
            if numel not in done:  # a tiny size rounded up to one already measured
                done.add(numel)
                plan.append((op, numel))
    try:
        for index, (op, numel) in enumerate(plan):
            if on_progress is not None:
                on_progress(op, numel * 4, index, len(plan))
            calls = torch_impls.cases(op, numel)
            if jax_impls is not None:
                calls.update(jax_impls.cases(op, numel))
            calls = {name: calls[name] for name in impls}
            warmup, timed = iterations(numel * 4, quick, iters)
            times = time_interleaved(calls, warmup, timed, root.device)
            by_impl = {
                name: make_row(name, op, numel * 4, n, median(ts), iters=timed, count=numel, dtype="float32")
                for name, ts in times.items()
            }
            for ours, base in PAIRS:
                if ours in times and base in times:
                    by_impl[ours]["paired_ratio"] = paired_ratio(times[ours], times[base])
            rows.extend(by_impl.values())
            if on_row is not None:
                on_row(op, numel * 4, by_impl)
    finally:
        if jax_impls is not None:
            jax_impls.gang.close()
    return rows
