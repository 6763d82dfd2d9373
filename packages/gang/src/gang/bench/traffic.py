"""The traffic measurements of :mod:`gang.bench`: point to point, uneven all-to-all, handles that overlap.

Each operation of :data:`~gang.bench.metrics.TRAFFIC_OPS` is timed through the gang and through the raw
``torch.distributed`` calls it replaces, interleaved in one loop as the collectives are (see
:mod:`gang.bench.collectives`), and checked element by element afterwards (``#wrong``):

``send``
    One message from each even rank to the odd rank after it (``send`` and ``recv``; raw
    ``dist.send`` and ``dist.recv``). Small sizes give the latency, large ones the bandwidth. A last
    rank without a partner (an odd world) takes no part.
``send_recv_ring``
    Every rank sends to the next and receives from the previous in one ``send_recv`` call (raw:
    ``batch_isend_irecv`` of the two and a wait on both).
``all_to_all_uneven``
    Skewed splits: every rank sends rank 0 (a "hot expert") ``3 * size`` times as many rows as any
    other rank (raw: ``all_to_all_single`` with the same split sizes). ``bytes`` is each rank's send
    buffer, as for ``all_to_all``.
``exchange_rows``
    The same skewed rows through :func:`gang.exchange_rows`, which exchanges the counts first (raw:
    the two ``all_to_all_single`` calls it replaces, the counts' tensor made from the splits and the
    output allocated on every call, as the gang does).
``overlap``
    A backward pass's gradient all-reduces: :data:`BUCKETS` buckets (``bytes`` in all), each started
    with ``async_op=True`` right after a fixed piece of compute (a matrix product standing for the
    backward of a layer), then waited for together (raw: ``dist.all_reduce(..., async_op=True)``).
    The ``gang-sequential`` and ``torch-sequential`` rows run the same compute and blocking
    all-reduces one after the other; the ratio of those to ``gang`` and ``torch`` is the overlap's gain.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

import gang
from gang import Gang, ReduceOperation
from gang.bench.cases import OVERLAP_BUCKETS, Case, reference
from gang.bench.metrics import OVERLAP_PAIRS, TRAFFIC_OPS

BUCKETS = OVERLAP_BUCKETS
"""The gradient buckets of the ``overlap`` measurement."""

COMPUTE_SIZE = 96
"""The side of the square matrices multiplied before each bucket's all-reduce in ``overlap``."""


def _pattern(seed: int, count: int, dtype: torch.dtype) -> Tensor:
    """``count`` values below 127 that tell ``seed`` apart (the pattern of :func:`gang.bench.cases.reference`)."""
    return ((seed + torch.arange(count, dtype=torch.int64)) % 127).to(dtype)


def skewed_splits(size: int, numel: int) -> list[int]:
    """How many of a rank's ``numel`` rows go to each rank: rank 0 gets ``3 * size`` shares, the others one each.

    The remainder of the division goes to rank 0 too, so the splits sum to ``numel``. Every rank
    sends the same splits, so rank ``r`` receives ``skewed_splits(...)[r]`` rows from every rank.
    """
    shares = [3 * size] + [1] * (size - 1)
    splits = [numel * share // sum(shares) for share in shares]
    splits[0] += numel - sum(splits)
    return splits


def _uneven_data(rank: int, size: int, numel: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, list[int], list[int]]:
    """``(input, expected output, input_splits, output_splits)`` of the skewed exchange on ``rank``."""
    splits = skewed_splits(size, numel)
    inp = torch.cat([_pattern(7 * rank + 3 * j, splits[j], dtype) for j in range(size)])
    expected = torch.cat([_pattern(7 * i + 3 * rank, splits[rank], dtype) for i in range(size)])
    return inp, expected, splits, [splits[rank]] * size


def traffic_cases(gang_: Gang, op: str, numel: int, dtype: torch.dtype = torch.float32) -> dict[str, Case]:
    """Return the ``torch`` and ``gang`` cases of the traffic operation ``op`` (and the sequential ones of ``overlap``).

    ``numel`` is the element count of the measured buffer: the message of ``send`` and
    ``send_recv_ring``, each rank's send buffer of ``all_to_all_uneven`` and ``exchange_rows``, all
    the buckets of ``overlap``.

    :raises ValueError: If ``op`` is not one of :data:`~gang.bench.metrics.TRAFFIC_OPS`.
    """
    makers: dict[str, Callable[[Gang, int, torch.dtype], dict[str, Case]]] = {
        "send": _send,
        "send_recv_ring": _ring,
        "all_to_all_uneven": _uneven,
        "exchange_rows": _exchange_rows,
        "overlap": _overlap,
    }
    if op not in makers:
        raise ValueError(f"`op` must be one of {TRAFFIC_OPS}, but is {op!r} instead.")
    return makers[op](gang_, numel, dtype)


def _global(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def _case(g: Gang, source: Tensor, expected: Tensor, call: Callable[[Tensor, Tensor], object]) -> Case:
    """The :class:`Case` of ``call(output, input)`` on buffers of ``g``'s device: ``input`` refilled from
    ``source``, ``output`` shaped as ``expected`` (``call`` may return a new output instead of filling it)."""
    inp, out = source.to(g.device, copy=True), torch.empty(expected.shape, dtype=expected.dtype, device=g.device)
    last = [out]

    def run() -> None:
        result = call(out, inp)
        last[0] = result if isinstance(result, Tensor) else out

    def reset() -> None:
        inp.copy_(source)

    return Case(run, reset, lambda: last[0].cpu(), expected)


def _send(g: Gang, numel: int, dtype: torch.dtype) -> dict[str, Case]:
    group, rank = g.as_process_group(), g.rank
    peer = rank ^ 1
    if peer >= g.size:  # the last rank of an odd world: no partner
        nothing = torch.empty(0, dtype=dtype)
        return {impl: _case(g, nothing, nothing, lambda out, inp: None) for impl in ("torch", "gang")}
    source = _pattern(7 * rank, numel, dtype)
    if rank % 2 == 0:  # the sender's result is its input, unchanged
        other = _global(group, peer)
        return {
            "torch": _case(g, source, source, lambda out, inp: dist.send(inp, other, group=group) or inp),
            "gang": _case(g, source, source, lambda out, inp: g.send(inp, peer) or inp),
        }
    expected = _pattern(7 * peer, numel, dtype)
    other = _global(group, peer)
    return {
        "torch": _case(g, source, expected, lambda out, inp: dist.recv(out, other, group=group)),
        "gang": _case(g, source, expected, lambda out, inp: g.recv(out, peer)),
    }


def _ring(g: Gang, numel: int, dtype: torch.dtype) -> dict[str, Case]:
    group, rank, size = g.as_process_group(), g.rank, g.size
    right, left = (rank + 1) % size, (rank - 1) % size
    source = _pattern(7 * rank + 3 * right, numel, dtype)
    expected = _pattern(7 * left + 3 * rank, numel, dtype)

    def raw(out: Tensor, inp: Tensor) -> None:
        ops = [
            dist.P2POp(dist.isend, inp, _global(group, right), group),
            dist.P2POp(dist.irecv, out, _global(group, left), group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {
        "torch": _case(g, source, expected, raw),
        "gang": _case(g, source, expected, lambda out, inp: g.send_recv([(inp, right)], [(out, left)])),
    }


def _uneven(g: Gang, numel: int, dtype: torch.dtype) -> dict[str, Case]:
    group = g.as_process_group()
    source, expected, in_splits, out_splits = _uneven_data(g.rank, g.size, numel, dtype)
    return {
        "torch": _case(
            g, source, expected, lambda out, inp: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        ),
        "gang": _case(g, source, expected, lambda out, inp: g.all_to_all_uneven(out, inp, out_splits, in_splits)),
    }


def _exchange_rows(g: Gang, numel: int, dtype: torch.dtype) -> dict[str, Case]:
    group = g.as_process_group()
    source, expected, in_splits, _ = _uneven_data(g.rank, g.size, numel, dtype)

    def raw(_: Tensor, inp: Tensor) -> Tensor:
        """The two calls ``exchange_rows`` replaces: the counts (a tensor made from the splits, as the gang
        makes it on every call), then the rows into a new output."""
        counts = torch.tensor(in_splits, dtype=torch.int64, device=g.device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        out_splits = received.tolist()
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        return out

    return {
        "torch": _case(g, source, expected, raw),
        "gang": _case(g, source, expected, lambda _, inp: gang.exchange_rows(g, inp, in_splits)[0]),
    }


def _overlap(g: Gang, numel: int, dtype: torch.dtype) -> dict[str, Case]:
    group, chunk = g.as_process_group(), numel // BUCKETS
    bucket_source, bucket_expected = reference("all_reduce", g.rank, g.size, chunk, dtype)
    source, expected = bucket_source.repeat(BUCKETS), bucket_expected.repeat(BUCKETS)
    a = torch.rand(COMPUTE_SIZE, COMPUTE_SIZE, generator=torch.Generator().manual_seed(0)).to(g.device)
    starts: dict[str, Callable[[Tensor], gang.Work | dist.Work | None]] = {
        "gang": lambda bucket: g.all_reduce(bucket, ReduceOperation.SUM, async_op=True),
        "torch": lambda bucket: dist.all_reduce(bucket, group=group, async_op=True),
    }

    def overlapped(start: Callable[[Tensor], gang.Work | dist.Work | None]) -> Callable[[Tensor, Tensor], object]:
        """Each bucket's all-reduce started after its compute; all waited for at the end (in place)."""

        def call(_: Tensor, buckets: Tensor) -> Tensor:
            handles = []
            for bucket in torch.split(buckets, chunk):
                torch.mm(a, a)
                handles.append(start(bucket))
            for handle in handles:
                assert handle is not None
                handle.wait()
            return buckets

        return call

    blocking: dict[str, Callable[[Tensor], object]] = {
        "gang": lambda bucket: g.all_reduce(bucket, ReduceOperation.SUM),
        "torch": lambda bucket: dist.all_reduce(bucket, group=group),
    }

    def sequential(reduce: Callable[[Tensor], object]) -> Callable[[Tensor, Tensor], object]:
        """Each bucket's compute, then its blocking all-reduce (in place)."""

        def call(_: Tensor, buckets: Tensor) -> Tensor:
            for bucket in torch.split(buckets, chunk):
                torch.mm(a, a)
                reduce(bucket)
            return buckets

        return call

    cases = {impl: _case(g, source, expected, overlapped(start)) for impl, start in starts.items()}
    for seq, fast in OVERLAP_PAIRS:
        cases[seq] = _case(g, source, expected, sequential(blocking[fast]))
    return cases
