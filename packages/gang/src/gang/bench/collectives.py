"""The collective measurements of :mod:`gang.bench`: raw torch.distributed and ProcessGroupGang, and
the implementations that other packages provide (``gang_jax`` adds raw JAX and JaxGang).

Every (collective, size) is timed for the implementations interleaved in one loop (the order
rotates every iteration and runs backwards every other round, :func:`call_order`), after a
warm-up that also compiles the JAX programs. Each iteration starts after a barrier; each rank
times its own call, and the per-rank times are reduced with MAX after the loop (outside the timed
region), so an iteration counts the slowest rank. The reported
time is the median over iterations, with the mean and the 95th percentile beside it.

After the timing, each implementation runs once more on inputs refilled with a known pattern
(:func:`gang.bench.cases.reference`), and every element of its result is compared with the expected value: the
count of elements that differ, summed over the ranks, is the ``#wrong`` column (as in
nccl-tests). The pattern keeps every expected value a small integer, exact in every dtype of
:data:`DTYPES`: below 128 up to 67 ranks (``int8`` then counts overflows as wrong), below 256
(where ``bfloat16`` stops being exact) up to 195 ranks.

Implementations from other packages are found through the entry point group ``gang.bench``
(see :func:`providers`), so this package imports none of them.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from gang import Gang, ReduceOperation
from gang._torch_groups import all_gather_tensor, reduce_scatter_tensor
from gang.bench.cases import OVERLAP_BUCKETS, Call, Case, reference
from gang.bench.metrics import (
    OPS,
    OVERLAP_PAIRS,
    PAIRS,
    TRAFFIC_OPS,
    Row,
    make_row,
    mean,
    median,
    paired_ratio,
    percentile,
)
from gang.bench.traffic import traffic_cases
from gang.trace._recorder import STATE as TRACING

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


DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
"""The dtypes ``--dtype`` offers, by name."""

TYPE_NAMES = {"float32": "float", "float16": "half", "float64": "double"}
"""The names nccl-tests prints in its ``type`` column, where they differ from torch's."""

CORRUPT_VARIABLE = "GANG_BENCH_CORRUPT"
"""A test-only seam: ``impl:op`` (``gang:all_gather``, say) adds one to one element of that
implementation's checked result on rank 0, so that a test sees ``#wrong`` count it."""


def numel_for(nbytes: int, world_size: int, op: str, itemsize: int = 4) -> int:
    """Return the element count of the full buffer: ``nbytes / itemsize``, rounded up so that ranks split it evenly.

    The buffers that are not split are not rounded (``all_reduce``, ``broadcast``, and the traffic
    operations' messages and send buffers); ``overlap``'s is rounded up to whole buckets.
    """
    numel = max(1, nbytes // itemsize)
    if op == "overlap":
        return -(-numel // OVERLAP_BUCKETS) * OVERLAP_BUCKETS
    if op in ("all_reduce", "broadcast") or op in TRAFFIC_OPS:
        return numel
    return -(-numel // world_size) * world_size


def tensor_case(gang: Gang, op: str, numel: int, dtype: torch.dtype, call: Callable[[Tensor, Tensor], object]) -> Case:
    """Return the :class:`Case` of ``call(output, input)`` on tensors of ``gang``'s device in the gang's layout.

    For ``all_reduce`` and ``broadcast`` the output is the input (in place).
    """
    source, expected = reference(op, gang.rank, gang.size, numel, dtype)
    inp = source.to(gang.device, copy=True)
    out = inp if op in ("all_reduce", "broadcast") else torch.empty(expected.shape, dtype=dtype, device=gang.device)

    def reset() -> None:
        inp.copy_(source)

    return Case(lambda: call(out, inp), reset, lambda: out.cpu(), expected)


def gang_call(gang: Gang, op: str, numel: int, dtype: torch.dtype = torch.float32) -> Case:
    """Return the public call of ``op`` on ``gang`` for a full buffer of ``numel`` elements of ``dtype``.

    Tensors in the gang's layout (``[size, chunk]`` rows where the collective has rows), made
    once: the call runs only the collective.
    """
    calls: dict[str, Callable[[Tensor, Tensor], object]] = {
        "all_reduce": lambda out, inp: gang.all_reduce(inp, ReduceOperation.SUM),
        "all_gather": gang.all_gather,
        "reduce_scatter": lambda out, inp: gang.reduce_scatter(out, inp, ReduceOperation.SUM),
        "all_to_all": gang.all_to_all,
        "broadcast": lambda out, inp: gang.broadcast(inp, source_rank=0),
    }
    if op not in calls:
        raise ValueError(f"`op` must be one of {OPS}, but is {op!r} instead.")
    return tensor_case(gang, op, numel, dtype, calls[op])


def untraced(case: Case) -> Case:
    """``case`` with the flight recorder and hooks off for its calls (the ``-untraced`` implementations).

    Each call pays two attribute stores more than the traced case (well under 0.1 us), against
    the recorder's side of the comparison.
    """
    run = case.run

    def off() -> object:
        was = TRACING.on
        TRACING.on = False
        try:
            return run()
        finally:
            TRACING.on = was

    return Case(off, case.reset, case.result, case.expected)


class TorchImpls:
    """Raw ``torch.distributed`` and :class:`gang.ProcessGroupGang` on the process group of one gang
    (``gang-untraced``: the gang with the flight recorder off)."""

    names = ("torch", "gang", "gang-untraced")

    def __init__(self, gang: Gang) -> None:
        self.gang = gang
        self.group = gang.as_process_group()

    def cases(self, op: str, numel: int, dtype: torch.dtype = torch.float32) -> dict[str, Case]:
        """Return the ``torch`` and ``gang`` cases of ``op`` on a full buffer of ``numel`` elements of ``dtype``.

        For an operation of :data:`~gang.bench.metrics.TRAFFIC_OPS`, those of
        :func:`gang.bench.traffic.traffic_cases` (``overlap`` adds its sequential cases).
        """
        if op in TRAFFIC_OPS:
            return traffic_cases(self.gang, op, numel, dtype)
        group, sum_ = self.group, dist.ReduceOp.SUM
        raw: dict[str, Callable[[Tensor, Tensor], object]] = {
            "all_reduce": lambda out, inp: dist.all_reduce(inp, sum_, group=group),
            "all_gather": lambda out, inp: all_gather_tensor(out.view(-1), inp, group=group),
            "reduce_scatter": lambda out, inp: reduce_scatter_tensor(out, inp.view(-1), sum_, group=group),
            "all_to_all": lambda out, inp: dist.all_to_all_single(out, inp, group=group),
            "broadcast": lambda out, inp: dist.broadcast(inp, group=group, group_src=0),
        }
        if op not in raw:
            raise ValueError(f"`op` must be one of {OPS}, but is {op!r} instead.")
        return {
            "torch": tensor_case(self.gang, op, numel, dtype, raw[op]),
            "gang": gang_call(self.gang, op, numel, dtype),
            "gang-untraced": untraced(gang_call(self.gang, op, numel, dtype)),
        }

    def close(self) -> None:
        """Nothing to release: the gang belongs to the caller."""


class Impls(Protocol):
    """Implementations that a package adds to the benchmark (see :func:`providers`)."""

    names: tuple[str, ...]
    """The implementation names, as ``--impls`` takes them."""
    device_types: tuple[str, ...]
    """The device types (``cpu``, ``cuda``) the implementations run on."""

    def cases(self, op: str, numel: int, dtype: torch.dtype) -> Mapping[str, Case]:
        """Return the case of each implementation of ``op`` on a full buffer of ``numel`` elements of ``dtype``.

        An implementation that cannot run ``dtype`` is left out.
        """

    def close(self) -> None:
        """Release what the implementations hold."""


class Provider(Protocol):
    """What the entry point of a package names: a maker of :class:`Impls` that tells their names first."""

    names: tuple[str, ...]
    """The implementation names, as ``--impls`` takes them."""
    device_types: tuple[str, ...]
    """The device types (``cpu``, ``cuda``) the implementations run on."""

    def __call__(self) -> Impls:
        """Make the implementations (on every rank)."""


def providers() -> dict[str, Provider]:
    """Return the implementations that installed packages add, by entry point name (``jax`` from ``gang_jax``).

    A package adds some with an entry point in the group ``gang.bench`` that names a callable
    (a class, say) returning an :class:`Impls` when every rank calls it, such as
    ``jax = "gang_jax.bench:JaxImpls"``; loading it imports that package. The callable is called
    (on every rank) only when one of its implementations is timed.
    """
    return {ep.name: ep.load() for ep in entry_points(group="gang.bench")}


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


def call_order(iteration: int, count: int) -> list[int]:
    """The order of ``count`` calls in iteration ``iteration``: rotated by one each iteration, and backwards
    in every other round of ``count`` iterations.

    A rotation alone keeps each call's predecessor (the call before it in the list, or none): a call
    that always follows a cold one (another library's) always pays for the cold caches, and one that
    always follows its twin (``gang`` then ``gang-untraced``) never does, which skews their paired
    ratio by more than the difference it measures. Backwards, each call follows the one after it in
    the list instead, so of two neighbours in the list each follows the other equally often.
    """
    shift = iteration % count
    order = [(k + shift) % count for k in range(count)]
    return order[::-1] if (iteration // count) % 2 else order


def time_interleaved(
    calls: dict[str, Call], warmup: int, iters: int, device: torch.device | None = None
) -> dict[str, list[float]]:
    """Time every callable ``iters`` times, interleaved (in :func:`call_order`), after ``warmup`` untimed rounds.

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
        for index in call_order(it, len(names)):
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
    gang: Gang,
    *,
    ops: Sequence[str],
    impls: Sequence[str],
    sizes: Sequence[int],
    dtype: torch.dtype = torch.float32,
    extra: Sequence[Provider] = (),
    quick: bool = False,
    iters: int | None = None,
    on_row: Callable[[str, int, dict[str, Row]], None] | None = None,
    on_progress: Callable[[str, int, int, int], None] | None = None,
) -> list[Row]:
    """Time every collective of ``ops`` at every size of ``sizes`` for each of ``impls``; return the rows.

    Called on every rank of the default process group; ``gang`` is this rank's gang of
    ``ProcessGroupGang`` to time (the root, or one gang of a layout: every gang of that role is
    timed at once). ``ops`` may name the traffic operations of
    :data:`~gang.bench.metrics.TRAFFIC_OPS` too (timed through torch and the gang only; ``overlap``
    also times its sequential calls, and its overlapped rows get ``overlap_gain``, the paired ratio
    of the sequential time to theirs). ``extra`` makes the implementations of other packages (see
    :func:`providers`); they are closed at the end. Each row holds the median (``time_us``), mean
    and 95th percentile times and ``wrong``, the number of wrong result elements summed over every
    rank. ``on_progress(op, nbytes, index, total)`` is called before and ``on_row(op, nbytes,
    rows_by_impl)`` after each measurement, on every rank.
    """
    n, itemsize = gang.size, dtype.itemsize
    type_name = next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))
    corrupt = os.environ.get(CORRUPT_VARIABLE, "")
    sources: list[TorchImpls | Impls] = [TorchImpls(gang)]
    try:
        sources += [make() for make in extra]
        plan = []
        for op in ops:
            done: set[int] = set()
            for nbytes in sizes:
                numel = numel_for(nbytes, n, op, itemsize)
                if numel not in done:  # a tiny size rounded up to one already measured
                    done.add(numel)
                    plan.append((op, numel))
        rows: list[Row] = []
        for index, (op, numel) in enumerate(plan):
            nbytes = numel * itemsize
            if on_progress is not None:
                on_progress(op, nbytes, index, len(plan))
            cases: dict[str, Case] = {}
            for source in sources if op in OPS else sources[:1]:  # other packages time the collectives only
                cases.update(source.cases(op, numel, dtype))
            sequential = [seq for seq, fast in OVERLAP_PAIRS if fast in impls and seq in cases]
            cases = {name: cases[name] for name in [*impls, *sequential] if name in cases}
            warmup, timed = iterations(nbytes, quick, iters)
            times = time_interleaved(dict(cases), warmup, timed, gang.device)
            wrong = torch.tensor(
                [case.check(corrupt == f"{name}:{op}" and gang.rank == 0) for name, case in cases.items()],
                dtype=torch.int64,
            )
            dist.all_reduce(wrong)
            by_impl = {}
            for (name, ts), bad in zip(times.items(), wrong.tolist(), strict=True):
                by_impl[name] = make_row(
                    name, op, nbytes, n, median(ts), iters=timed, count=numel, dtype=type_name, wrong=int(bad)
                )
                by_impl[name].update(mean_us=mean(ts) * 1e6, p95_us=percentile(ts, 95) * 1e6)
            for ours, base in PAIRS:
                if ours in times and base in times:
                    ratio = paired_ratio(times[ours], times[base])
                    by_impl[ours].setdefault("paired_ratio", ratio)  # the first pair: over the raw baseline
                    by_impl[ours].setdefault("paired_ratios", {})[base] = ratio
            for seq, fast in OVERLAP_PAIRS:
                if seq in times and fast in times:
                    by_impl[fast]["overlap_gain"] = paired_ratio(times[seq], times[fast])
            rows.extend(by_impl.values())
            if on_row is not None:
                on_row(op, nbytes, by_impl)
    finally:
        for source in sources:
            source.close()
    return rows
