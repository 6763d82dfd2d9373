"""Functions the conformance suite runs on every rank: the same inputs through a reference gang
and through each gang of :data:`GANGS`.

The reference is the torch :class:`~gang.ProcessGroupGang` that :class:`gang.testing.World`
created. :data:`GANGS` is the table of the other kinds of gang, one entry each; a new kind of gang
joins the suite by one entry there. Each entry's gang is created on a rank's first use and kept in
a module global, so a whole test module shares one gang (one JAX runtime, one replica) of each kind
per process; :func:`close_gangs` closes them. Every worker takes the entry's name and runs each
case's body once on the reference gang and once, through the entry's ``call``, on the tested gang.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from core_workers import try_call
from torch import Tensor

from gang import (
    FakeGang,
    Gang,
    GangError,
    Gangs,
    NotSupportedError,
    ReduceOperation,
    Work,
    create_fsdp_gangs,
    create_parallel_gangs,
    exchange_rows,
)
from gang._torch_groups import TCPStore
from gang.extend import SUPPORTED_DTYPES, check_op
from gang.ft import ReplicaGang
from gang_jax import JaxGang, from_jax_mesh, functional, to_jax_mesh

DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in sorted(SUPPORTED_DTYPES, key=str)}
"""Every dtype every gang accepts (:data:`gang.extend.SUPPORTED_DTYPES`), by name."""


TRAFFIC_DTYPES = list(DTYPES.values())
"""The dtypes every traffic case moves, in one run: every dtype every gang accepts."""

Body = Callable[[], Any]
_GANG_REPR = re.compile(r"\b\w*Gang\(rank=")  # the start of a gang's repr, in an error message


def _directly(_: Gang, body: Body) -> Any:
    """Run a case's body as it is: the ``call`` of a gang whose collectives need no context."""
    return body()


@dataclass(frozen=True)
class GangKind:
    """One kind of gang in the conformance suite.

    :param create: Makes this rank's gang from the reference gang (called once per process, on
        every rank at once, so it may communicate on the reference gang).
    :param same_data: The gang assumes every rank holds the same data (as :class:`~gang.FakeGang`
        does), so both gangs get rank 0's inputs on every rank.
    :param objects: Whether ``broadcast_objects`` really moves objects between ranks.
    :param large: Whether to run the reduce-scatter of 2**20 elements a rank, a check of a data path
        at a size where some JAX CPU builds went wrong (a gang that assumes equal data has no data
        path; a ReplicaGang's reduce-scatter is a gloo all_reduce of every row, as at any size).
    :param subgangs: Whether the gang makes sub-gangs (``create_gang``, ``split`` and the parallel
        layouts built on them); the cases that need them are skipped for a gang that refuses them.
    :param traffic: Whether the gang runs point-to-point transfers and uneven rows (``send``,
        ``recv``, ``send_recv``, ``all_to_all_uneven``, :func:`gang.exchange_rows`); where not,
        each must raise :class:`~gang.NotSupportedError` naming the method (its argument checks
        still run first, as the bad-call catalogue shows).
    :param sizes: The world sizes whose tests run on this entry (``None``: every one).
    :param hung: ``hung(reference, timeout)`` makes the gangs of the hung-peer case (the tested gang
        last; each is closed after the case) with ``timeout``; ``None`` where the case does not
        apply (a FakeGang never waits for a peer; a ReplicaGang records a collective's failure in
        its step instead of raising it, and refuses point-to-point).
    :param call: ``call(gang, body)`` runs one case's body (every use of the gang in that case,
        its ``rank`` and ``size`` included) and returns what ``body()`` returned; it checks
        whatever the gang promises around a call (a :class:`~gang.ft.ReplicaGang`: a committed step).
    """

    create: Callable[[Gang], Gang]
    same_data: bool = False
    objects: bool = True
    large: bool = True
    subgangs: bool = True
    traffic: bool = True
    sizes: frozenset[int] | None = None
    hung: Callable[[Gang, timedelta], list[Gang]] | None = None
    call: Callable[[Gang, Body], Any] = _directly


_SERVERS: list[TCPStore] = []  # the coordination store of the ReplicaGang entry, kept alive on rank 0


def _join_replicas(pg: Gang) -> Gang:
    """Join a :class:`~gang.ft.ReplicaGang` in which each rank is a replica of one process.

    Rank 0 serves the world's coordination store (a TCPStore master) and sends its address to the others.
    """
    address: list[object] = [None]
    if pg.rank == 0:
        _SERVERS.append(TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
        address = [f"127.0.0.1:{_SERVERS[-1].port}"]
    pg.broadcast_objects(address, 0)

    def load(state: Mapping[str, Any]) -> None:
        assert not state, state  # the suite keeps no state: an initial sync or a heal moves nothing

    return ReplicaGang.join(
        replica_id=pg.rank,
        replica_rank=0,
        replica_size=1,
        store=str(address[0]),
        state_dict=dict,
        load_state_dict=load,
        min_replicas=pg.size,
        timeout=timedelta(seconds=20),
    )


def _in_a_committed_step(g: Gang, body: Body) -> Any:
    """Run ``body`` inside one step of the ReplicaGang ``g``; check that the step was committed."""
    assert isinstance(g, ReplicaGang)
    before = g.step_number
    with g.step():
        result = body()
        committed = g.should_commit()
    assert committed, f"the step was not committed: {g.errored()!r}"
    assert g.step_number == before + 1, f"the step number went from {before} to {g.step_number}"
    return result


def _jax_mesh_root(pg: Gang) -> Gang:
    """The root of the JaxGang gangs that ``gang_jax.from_jax_mesh`` makes of the JAX mesh of the
    reference's own layout: ``to_jax_mesh`` of torch gangs from the factories (``dp`` x ``tp`` 2), so
    both bridges stand between the torch gang and the gang under test (on the in-process entry's
    JAX runtime)."""
    gang_of("jax", pg)  # starts the JAX runtime, shared with the "jax" entry
    return _mesh_root(pg)


def _mesh_root(pg: Gang) -> Gang:
    """``from_jax_mesh(to_jax_mesh(...)).root`` of the reference's ``dp`` x ``tp`` layout (``tp`` 2 if it divides)."""
    tp_size = 2 if pg.size % 2 == 0 else 1
    return from_jax_mesh(to_jax_mesh(create_parallel_gangs(pg, tp_size=tp_size), ("dp", "tp"))).root


def _hung_jax(isolated: bool, *, mesh: bool = False) -> Callable[[Gang, timedelta], list[Gang]]:
    """The gangs of the hung-peer case on a JAX runtime started with the case's timeout."""

    def make(pg: Gang, timeout: timedelta) -> list[Gang]:
        root = JaxGang.create_default(isolated=isolated, timeout=timeout)
        return [root, _mesh_root(pg)] if mesh else [root]

    return make


GANGS: dict[str, GangKind] = {
    "jax": GangKind(lambda _: JaxGang.create_default(isolated=False), hung=_hung_jax(False)),
    "jax-isolated": GangKind(lambda _: JaxGang.create_default(isolated=True), hung=_hung_jax(True)),
    "fake": GangKind(
        lambda pg: FakeGang(pg.device, rank=pg.rank, size=pg.size), same_data=True, objects=False, large=False
    ),
    "replica": GangKind(_join_replicas, large=False, subgangs=False, traffic=False, call=_in_a_committed_step),
    # On 2 processes only: its collectives are the "jax" entry's code, compiled anew (the cost).
    "jax-mesh": GangKind(_jax_mesh_root, large=False, sizes=frozenset({2}), hung=_hung_jax(False, mesh=True)),
}
"""The gangs compared with the reference, by name (the suite's test ids)."""

NEEDS_SUBGANGS = frozenset({"collective on closed gang"})
"""The rows of the bad-call catalogue that need a working sub-gang (skipped where ``subgangs`` is false)."""

_MADE: dict[str, Gang] = {}


def gang_of(name: str, pg: Gang) -> Gang:
    """Return this process's gang of kind ``name``, creating it on first use."""
    g = _MADE.get(name)
    if g is None or g.closed:
        g = _MADE[name] = GANGS[name].create(pg)
    return g


def close_gangs(_: Gang) -> None:
    """Close every gang this process made (a ReplicaGang must be closed before the process exits)."""
    while _MADE:
        _MADE.popitem()[1].close()


def _run_both(pg: Gang, name: str, body: Callable[[Gang], Any]) -> dict[str, Any]:
    """Run ``body`` on the reference gang and, through the entry's ``call``, on the gang ``name``.

    Both gangs must have the same rank and size (checked after the call: a ReplicaGang has its
    quorum's only inside a step).
    """
    tested = gang_of(name, pg)
    results = {"reference": body(pg), "tested": GANGS[name].call(tested, lambda: body(tested))}
    assert (tested.rank, tested.size) == (pg.rank, pg.size), (name, tested.rank, tested.size)
    return results


def _data_rank(name: str, rank: int) -> int:
    """The rank whose inputs this rank uses: its own, or rank 0's for a gang that assumes equal data."""
    return 0 if GANGS[name].same_data else rank


def make_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, op: ReduceOperation | None) -> Tensor:
    """Values whose reduction is exact in every dtype, whatever order a backend adds them in.

    Small integers (and, for 64-bit types, an offset of 2**40 that 32-bit arithmetic would lose);
    factors in {1, 2, -1} for ``PRODUCT``.
    """
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(n, dtype=torch.int64)
    if op is ReduceOperation.PRODUCT:
        values = torch.tensor([1, 2, -1])[(idx + rank) % 3]
        return values.to(dtype).reshape(shape)
    values = (idx * 7 + rank * 3) % 11 - 5
    if dtype in (torch.int64, torch.float64):
        values = values + 2**40
    return values.to(dtype).reshape(shape)


def _close_all(gangs: Gangs) -> None:
    seen: set[int] = set()
    for axis in ("rdp", "sdp", "dp", "tp", "pp"):
        g: Gang = getattr(gangs, axis)
        if id(g) not in seen and g is not gangs.root:
            seen.add(id(g))
            g.close()


def run_collective(
    pg: Gang, name: str, kind: str, op_name: str | None, dtype_name: str, shape: tuple[int, ...]
) -> dict[str, Any]:
    """Run ``kind`` on the reference gang and on the gang ``name`` with the same inputs; return both outputs."""
    dtype = DTYPES[dtype_name]
    op = ReduceOperation[op_name] if op_name else None
    data_rank = _data_rank(name, pg.rank)
    return _run_both(pg, name, lambda g: _run_one(g, kind, op, dtype, shape, data_rank=data_rank))


def reducible(op: ReduceOperation | None) -> list[str]:
    """The names of the dtypes of :data:`DTYPES` that every gang can reduce with ``op`` (all of them for ``None``)."""
    names = []
    for dtype_name, dtype in DTYPES.items():
        try:
            if op is not None:
                check_op("op", op, dtype)
        except ValueError:
            continue
        names.append(dtype_name)
    return names


def run_every_dtype(
    pg: Gang, name: str, kind: str, op_name: str | None, shape: tuple[int, ...], only: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """:func:`run_collective` for every dtype of :func:`reducible` (those of ``only`` among them), in one run
    (and, for a ReplicaGang, one step).

    Returns ``{"reference": {dtype name: output}, "tested": {dtype name: output}}``.
    """
    op = ReduceOperation[op_name] if op_name else None
    data_rank = _data_rank(name, pg.rank)
    names = [n for n in reducible(op) if only is None or n in only]

    def body(g: Gang) -> dict[str, Any]:
        return {n: _run_one(g, kind, op, DTYPES[n], shape, data_rank=data_rank) for n in names}

    return _run_both(pg, name, body)


def _varied(t: Tensor, rank: int, *, scale: bool) -> Tensor:
    """``t + rank`` (``t * (rank + 1)`` with ``scale``) in ``t``'s dtype; for ``bool``, ``t`` xor the rank's parity."""
    if t.dtype == torch.bool:
        return t ^ bool(rank % 2)
    return t * (rank + 1) if scale else t + rank


def _run_one(
    g: Gang,
    kind: str,
    op: ReduceOperation | None,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    *,
    data_rank: int | None = None,
) -> Any:
    """Run ``kind`` on ``g`` with the inputs of rank ``data_rank`` (default: this rank); return the output."""
    rank, size = g.rank if data_rank is None else data_rank, g.size
    if kind == "all_reduce":
        assert op is not None
        t = make_input(rank, shape, dtype, op)
        g.all_reduce(t, op)
        return t
    if kind == "reduce_scatter":
        assert op is not None
        inp = make_input(rank, (size, *shape), dtype, op)
        out = torch.empty(shape, dtype=dtype)
        g.reduce_scatter(out, inp, op)
        return out
    if kind == "all_gather":
        inp = make_input(rank, shape, dtype, None)
        out = torch.empty((size, *shape), dtype=dtype)
        g.all_gather(out, inp)
        return out
    if kind == "all_gather_to_list":
        inp = make_input(rank, shape, dtype, None)
        outs = [torch.empty(shape, dtype=dtype) for _ in range(size)]
        g.all_gather_to_list(outs, inp)
        return outs
    if kind == "all_to_all":
        inp = _varied(make_input(rank, (size, *shape), dtype, None), rank, scale=False)
        out = torch.empty_like(inp)
        g.all_to_all(out, inp)
        return out
    if kind.startswith("broadcast"):
        source = 0 if kind == "broadcast_first" else size - 1
        t = _varied(make_input(rank, shape, dtype, None), rank, scale=True)
        g.broadcast(t, source)
        return t
    raise ValueError(f"`kind` must name a collective, but is {kind!r} instead.")


# -- traffic: point-to-point, uneven rows, handles ------------------------------------------------


ASYNC_P2P_KINDS = ("async_ring_forward", "async_ring_backward", "async_sends_first", "async_recvs_first")
"""Separate ``send`` and ``recv`` handles posted in orders that complete on gloo (see :func:`_async_p2p`)."""
TRAFFIC_KINDS = ("ring", "pairs", "uneven", "uneven_empty", "exchange_rows", *ASYNC_P2P_KINDS)
"""The traffic cases that need point-to-point transfers or uneven rows (an entry's ``traffic``)."""


def run_traffic(pg: Gang, name: str, kind: str) -> dict[str, Any]:
    """Run the traffic case ``kind`` in every dtype of :data:`TRAFFIC_DTYPES` on both gangs; return both.

    For an entry without ``traffic``, the tested gang's outcome of a case of
    :data:`TRAFFIC_KINDS` is the text of the :class:`~gang.NotSupportedError` it raised.
    """

    def body(g: Gang) -> Any:
        try:
            return [_traffic_case(g, kind, dtype, lambda r: _data_rank(name, r)) for dtype in TRAFFIC_DTYPES]
        except NotSupportedError as ex:
            if g is pg or GANGS[name].traffic or kind not in TRAFFIC_KINDS:
                raise
            return f"NotSupportedError: {ex}"

    return _run_both(pg, name, body)


def _sent(data_rank: int, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> Tensor:
    """What rank ``data_rank`` sends in a traffic case (``tag`` tells its transfers apart)."""
    values = make_input(data_rank, shape, dtype, None)
    return values if dtype == torch.bool else values + tag


def _rows_to(rank: int, dest: int, empty: bool) -> int:
    """How many rows ``rank`` sends ``dest`` in the uneven cases: 0, 1 or 2 (none to or from rank 0 if ``empty``)."""
    return 0 if empty and 0 in (rank, dest) else (rank + 2 * dest) % 3


def _traffic_case(g: Gang, kind: str, dtype: torch.dtype, data_rank: Callable[[int], int]) -> Any:
    """One traffic case on ``g`` in ``dtype``; ``data_rank(r)`` is the rank whose inputs rank ``r`` uses.

    A receive buffer starts as what this rank itself would send: a gang that assumes equal data
    (``FakeGang``) leaves it so, which a real gang on equal data then also gives.
    """
    rank, size, shape = g.rank, g.size, (2, 3)
    mine = data_rank(rank)
    if kind == "ring":  # shift forward (and, with more than two ranks, backward too), listed in any order
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        sends = [(_sent(mine, shape, dtype, 1), nxt)]
        recvs = [(_sent(mine, shape, dtype, 1), prv)]
        if size > 2:
            sends.append((_sent(mine, shape, dtype, 2), prv))
            recvs.append((_sent(mine, shape, dtype, 2), nxt))
        g.send_recv(sends[::-1] if rank % 2 else sends, recvs[::-1] if rank % 3 == 1 else recvs)
        return [t for t, _ in recvs]  # from the previous rank first
    if kind == "pairs":  # blocking send and recv between ranks 2k and 2k + 1, in both directions
        peer = rank ^ 1
        out = _sent(mine, (4,), dtype, 3)
        if rank % 2 == 0:
            g.send(_sent(mine, (4,), dtype, 3), peer)
            g.recv(out, peer)
        else:
            g.recv(out, peer)
            g.send(_sent(mine, (4,), dtype, 3), peer)
        return out
    if kind in ("uneven", "uneven_empty", "exchange_rows"):
        empty = kind == "uneven_empty"
        input_splits = [_rows_to(mine, j, empty) for j in range(size)]
        output_splits = [_rows_to(data_rank(i), rank, empty) for i in range(size)]
        inp = _sent(mine, (sum(input_splits), *shape), dtype, 4)
        if kind == "exchange_rows":
            output, splits = exchange_rows(g, inp, input_splits)
            assert splits == output_splits, (splits, output_splits)
            return output
        output = torch.full((sum(output_splits), *shape), 7).to(dtype)
        g.all_to_all_uneven(output, inp, output_splits, input_splits)
        return output
    if kind == "async":
        return _async_case(g, dtype, mine, data_rank)
    if kind in ASYNC_P2P_KINDS:
        return _async_p2p(g, kind, dtype, mine)
    raise ValueError(f"`kind` must name a traffic case, but is {kind!r} instead.")


def _async_p2p(g: Gang, kind: str, dtype: torch.dtype, mine: int) -> list[Tensor]:
    """Separate ``send`` and ``recv`` calls with ``async_op=True``, posted in an order that completes on gloo.

    A ring shifted forward (a send, then a receive, waited for in the other order) or backward (a
    receive first); every send first, then every receive (to and from both neighbours, waited
    for last to first); every receive first. Returns what was received, in posting order.
    """
    rank, size, shape = g.rank, g.size, (2, 3)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    if kind in ("async_ring_forward", "async_ring_backward"):
        to, source = (nxt, prv) if kind == "async_ring_forward" else (prv, nxt)
        received = _sent(mine, shape, dtype, 11)
        if kind == "async_ring_forward":
            works = [g.send(_sent(mine, shape, dtype, 11), to, async_op=True), g.recv(received, source, async_op=True)]
        else:
            works = [g.recv(received, source, async_op=True), g.send(_sent(mine, shape, dtype, 11), to, async_op=True)]
        for work in reversed(works):
            work.wait()
        return [received]
    # Two transfers each way: the first to the next rank, the second to the previous one (with two
    # ranks both go to the same peer, and match in the order they were posted).
    got = [_sent(mine, shape, dtype, 12), _sent(mine, shape, dtype, 13)]
    sends: list[Callable[[], Work]] = [lambda: g.send(_sent(mine, shape, dtype, 12), nxt, async_op=True)]
    sends.append(lambda: g.send(_sent(mine, shape, dtype, 13), prv, async_op=True))
    recvs: list[Callable[[], Work]] = [lambda: g.recv(got[0], prv, async_op=True)]
    recvs.append(lambda: g.recv(got[1], nxt, async_op=True))
    if kind == "async_sends_first":
        works = [post() for post in (*sends, *recvs)]
        works.reverse()
    else:
        works = [post() for post in (*recvs, *sends)]
    for work in works:
        work.wait()
    return got


def _async_case(g: Gang, dtype: torch.dtype, mine: int, data_rank: Callable[[int], int]) -> list[Tensor]:
    """Start every operation that takes ``async_op`` at once, then wait for them in reverse order.

    The reductions run only where ``dtype`` allows them; point-to-point and uneven rows only where the
    gang has them (the other collectives run on every gang).
    """
    rank, size = g.rank, g.size
    outputs: list[Tensor] = []
    works = []
    if dtype != torch.bool:  # what the reductions' cases run (bool has cases of its own)
        t = make_input(mine, (5,), dtype, None)
        works.append(g.all_reduce(t, ReduceOperation.SUM, async_op=True))
        op = ReduceOperation.SUM if dtype.is_complex else ReduceOperation.MAX  # complex: SUM and MEAN only
        rs = torch.empty(3, dtype=dtype)
        works.append(g.reduce_scatter(rs, make_input(mine, (size, 3), dtype, None), op, async_op=True))
        outputs += [t, rs]
    gathered = torch.empty(size, 4, dtype=dtype)
    works.append(g.all_gather(gathered, _sent(mine, (4,), dtype, 5), async_op=True))
    exchanged = torch.empty(size, 2, dtype=dtype)
    works.append(g.all_to_all(exchanged, _sent(mine, (size, 2), dtype, 6), async_op=True))
    b = _sent(mine, (3,), dtype, 7)
    works.append(g.broadcast(b, size - 1, async_op=True))
    outputs += [gathered, exchanged, b]
    if _has_traffic(g):
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        ring = _sent(mine, (2,), dtype, 8)
        works.append(g.send_recv([(_sent(mine, (2,), dtype, 8), nxt)], [(ring, prv)], async_op=True))
        splits_in = [_rows_to(mine, j, False) for j in range(size)]
        splits_out = [_rows_to(data_rank(i), rank, False) for i in range(size)]
        rows = torch.full((sum(splits_out), 2), 7).to(dtype)
        works.append(
            g.all_to_all_uneven(rows, _sent(mine, (sum(splits_in), 2), dtype, 9), splits_out, splits_in, async_op=True)
        )
        peer = rank ^ 1
        if peer < size:
            single = _sent(mine, (3,), dtype, 10)
            if rank % 2 == 0:
                works.append(g.send(_sent(mine, (3,), dtype, 10), peer, async_op=True))
                works.append(g.recv(single, peer, async_op=True))
            else:
                works.append(g.recv(single, peer, async_op=True))
                works.append(g.send(_sent(mine, (3,), dtype, 10), peer, async_op=True))
            outputs.append(single)
        outputs += [ring, rows]
    for i, work in enumerate(reversed(works)):
        work.wait(timeout=60.0 if i % 2 else None)  # a bounded wait that is long enough, and an unbounded one
        assert work.is_completed(), work
    return outputs


def run_async_p2p_in_subgang(pg: Gang, name: str) -> dict[str, Any]:
    """The cases of :data:`ASYNC_P2P_KINDS` in float32 inside a sub-gang (ranks 1.. of 3 or more, else both)."""
    data_rank = _data_rank(name, pg.rank)

    def body(root: Gang) -> list[list[Tensor]] | None:
        sub = root.create_gang(list(range(1, root.size)) if root.size > 2 else [0, 1])
        if sub is None:
            return None
        out = [_async_p2p(sub, kind, torch.float32, data_rank) for kind in ASYNC_P2P_KINDS]
        sub.close()
        return out

    return _run_both(pg, name, body)


def run_functional_after_async(pg: Gang, name: str) -> dict[str, Any]:
    """An async all-reduce, then a blocking one (through :mod:`gang_jax.functional` where the gang runs JAX
    here), then the handle's ``wait()``: the second call must run after the first, with both results right."""
    data_rank = _data_rank(name, pg.rank)

    def body(g: Gang) -> list[Tensor]:
        t = torch.full((4,), data_rank + 1.0)
        work = g.all_reduce(t, ReduceOperation.SUM, async_op=True)
        if isinstance(g, JaxGang) and not g.isolated:
            x = jnp.full((3,), 2.0 * (data_rank + 1), dtype=jnp.float32)
            y = torch.from_numpy(np.array(functional.all_reduce(g, x, ReduceOperation.SUM)))
        else:
            y = torch.full((3,), 2.0 * (data_rank + 1))
            g.all_reduce(y, ReduceOperation.SUM)
        work.wait()
        return [t, y]

    return _run_both(pg, name, body)


# -- a hung peer: alive, but late past the timeout ------------------------------------------------


HUNG_LATE_S = 5.0
"""How long past the timeout the last rank of the hung-peer case joins the collective the others wait in."""


def _outcome(fn: Callable[[], object]) -> str:
    """``"ok"``, or ``"GangError: <message>"`` if ``fn`` raised one."""
    try:
        fn()
    except GangError as ex:
        return f"GangError: {ex}"
    return "ok"


def run_hung_peer(pg: Gang, name: str, timeout_s: float) -> dict[str, Any]:
    """Every rank but the last waits in an all-reduce that the last joins ``HUNG_LATE_S`` past ``timeout_s``.

    Rank 0 polls its handle with ``is_completed()`` until it ends, then waits for it; the other
    waiting ranks wait for it, then poll it. Both then wait again. Returns what each saw (the
    messages, the seconds from the post to the end of the first wait), and for a gang other than
    the reference the outcome of a next call on the broken gang; then closes the gangs.
    """
    gangs = [pg] if name == "reference" else _hung_gangs(pg, name, timedelta(seconds=timeout_s))
    g = gangs[-1]
    g.all_reduce(torch.ones(2), ReduceOperation.SUM)  # everyone is up, and the program compiled
    out: dict[str, Any] = {}
    if g.rank == g.size - 1:
        time.sleep(timeout_s + HUNG_LATE_S)
        out["late"] = _outcome(lambda: g.all_reduce(torch.ones(2), ReduceOperation.SUM))
    else:
        start = time.monotonic()
        work = g.all_reduce(torch.ones(2), ReduceOperation.SUM, async_op=True)
        if g.rank == 0:
            while not work.is_completed() and time.monotonic() - start < timeout_s + 120:
                time.sleep(0.05)
            out["completed"] = work.is_completed()
            out["first"] = _outcome(work.wait)
        else:
            out["first"] = _outcome(work.wait)
            out["completed"] = work.is_completed()
        out["elapsed"] = time.monotonic() - start
        out["again"] = _outcome(work.wait)
        if g is not pg:
            out["next"] = _outcome(lambda: g.all_reduce(torch.ones(2), ReduceOperation.SUM))
    for gang in reversed(gangs):
        if gang is not pg:
            gang.close()
    return out


def run_unmatched_recv(pg: Gang, name: str, timeout_s: float) -> dict[str, Any]:
    """Rank 0 waits on a receive from rank 1 that rank 1 makes no send for until ``HUNG_LATE_S`` past the timeout.

    Returns rank 0's outcome and the seconds it took; rank 1 then sends (so that nothing stays
    stuck) and reports what that gave. The gangs are closed.
    """
    gangs = [pg] if name == "reference" else _hung_gangs(pg, name, timedelta(seconds=timeout_s))
    g = gangs[-1]
    g.all_reduce(torch.ones(2), ReduceOperation.SUM)  # everyone is up
    out: dict[str, Any] = {}
    if g.rank == 0:
        start = time.monotonic()
        work = g.recv(torch.empty(3), 1, async_op=True)
        out["recv"] = _outcome(work.wait)
        out["elapsed"] = time.monotonic() - start
    elif g.rank == 1:
        time.sleep(timeout_s + HUNG_LATE_S)
        out["late send"] = _outcome(lambda: g.send(torch.ones(3), 0))
    for gang in reversed(gangs):
        if gang is not pg:
            gang.close()
    return out


def _hung_gangs(pg: Gang, name: str, timeout: timedelta) -> list[Gang]:
    make = GANGS[name].hung
    assert make is not None, name
    return make(pg, timeout)


def _child_processes() -> list[int]:
    """The process ids whose parent is this process (Linux ``/proc``)."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == me:
                children.append(int(entry))
    return children


def leftovers(_: Gang, within_s: float = 60.0) -> list[str]:
    """What of the gangs still runs in this process (a JAX lane's thread, a child process), waiting ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        left = [f"thread {t.name}" for t in threading.enumerate() if t.name.startswith("gang-jax") and t.is_alive()]
        left += [f"process {pid}" for pid in _child_processes()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def sent_by(rank: int, kind: str) -> Tensor:
    """What ``rank`` sends forward in the float32 ``ring`` case (on the reference, inputs are per rank)."""
    assert kind == "ring"
    return _sent(rank, (2, 3), torch.float32, 1)


def expected_uneven(rank: int, size: int) -> Tensor:
    """What ``rank`` receives in the float32 ``uneven`` case: each rank's block for it, in rank order."""
    blocks = []
    for i in range(size):
        splits = [_rows_to(i, j, False) for j in range(size)]
        start = sum(splits[:rank])
        blocks.append(_sent(i, (sum(splits), 2, 3), torch.float32, 4)[start : start + splits[rank]])
    return torch.cat(blocks)


def run_reference_traffic(pg: Gang) -> dict[str, Tensor]:
    """The float32 ``ring`` and ``uneven`` cases on the reference gang alone, each rank with its own inputs."""
    return {
        kind: _traffic_case(pg, kind, torch.float32, lambda r: r)[0]
        if kind == "ring"
        else _traffic_case(pg, kind, torch.float32, lambda r: r)
        for kind in ("ring", "uneven")
    }


def _has_traffic(g: Gang) -> bool:
    """Whether ``g`` runs point-to-point transfers and uneven rows (its entry's ``traffic``, or the reference)."""
    return next((kind.traffic for n, kind in GANGS.items() if _MADE.get(n) is g), True)


def run_on_subgangs(pg: Gang, name: str, how: str) -> dict[str, Any]:
    """Build sub-gangs of both roots the same way and run a few collectives on them."""
    data_rank = _data_rank(name, pg.rank)

    def body(root: Gang) -> dict[str, Any] | None:
        if how == "create_gang":
            sub = root.create_gang([0, root.size - 1])
        elif how == "split":
            sub = root.split([[r for r in range(root.size) if r % 2 == 0], [r for r in range(root.size) if r % 2]])
        else:  # a group of three ranks (MEAN then divides by 3)
            sub = root.create_gang(list(range(min(3, root.size))))
        if sub is None:
            return None
        out: dict[str, Any] = {"rank": sub.rank, "size": sub.size}
        t = make_input(data_rank, (5,), torch.float64, None)
        sub.all_reduce(t, ReduceOperation.SUM)
        out["sum"] = t
        t = make_input(data_rank, (5,), torch.float32, None)
        sub.all_reduce(t, ReduceOperation.MEAN)
        out["mean"] = t
        g = torch.empty((sub.size, 3), dtype=torch.int64)
        sub.all_gather(g, make_input(data_rank, (3,), torch.int64, None))
        out["gather"] = g
        b = torch.full((2,), float(data_rank))
        sub.broadcast(b, sub.size - 1)
        out["broadcast"] = b
        sub.close()
        return out

    return _run_both(pg, name, body)


def _summarise(gangs: Gangs, data_rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for axis in ("dp", "tp", "pp", "rdp", "sdp"):
        g: Gang = getattr(gangs, axis)
        t = torch.tensor([data_rank + 1, 10 * (data_rank + 1)], dtype=torch.int64)
        g.all_reduce(t, ReduceOperation.SUM)
        out[axis] = (g.rank, g.size, t)
    return out


def run_parallel_gangs(pg: Gang, name: str, tp_size: int) -> dict[str, Any]:
    """Build parallel and FSDP gangs on both roots and all-reduce along every axis."""
    data_rank = _data_rank(name, pg.rank)

    def body(root: Gang) -> dict[str, Any]:
        gangs = create_parallel_gangs(root, tp_size=tp_size)
        fsdp = create_fsdp_gangs(gangs, intra_node_size=2 if gangs.dp.size % 2 == 0 else None)
        summary = {"parallel": _summarise(gangs, data_rank), "fsdp": _summarise(fsdp, data_rank)}
        _close_all(fsdp)
        _close_all(gangs)
        return summary

    return _run_both(pg, name, body)


def run_broadcast_objects(pg: Gang, name: str) -> dict[str, Any]:
    """Broadcast a list of objects from the last rank on both gangs, then pass a barrier."""

    def body(g: Gang) -> list[object]:
        objects: list[object] = [{"from": g.rank}, "x" * 1000] if g.rank == g.size - 1 else []
        g.broadcast_objects(objects, g.size - 1)
        g.barrier()
        return objects

    return _run_both(pg, name, body)


def run_bad_calls(pg: Gang, name: str, names: list[str]) -> dict[str, Any]:
    """Make the bad calls ``names`` of the core's catalogue on both gangs; return each outcome's text.

    Each call is followed by an all_reduce on the same gang, which proves every rank went on. A
    message that names its gang (``JaxGang(rank=0, size=2, device=cpu)``) is returned with the
    class name left out (``Gang(rank=0, ...)``): the rest of the text must be the same.
    """
    return _run_both(pg, name, lambda g: {call: _GANG_REPR.sub("Gang(rank=", try_call(g, call)) for call in names})


def moved_dtypes(_: Gang) -> list[str]:
    """The dtypes that every backend under the gangs can move: torch's gloo and JAX (through NumPy).

    Asks the backends themselves, bypassing every gang's checks: a plain gloo all-reduce and
    broadcast on the world's process group, and a NumPy view of a tensor (what a JaxGang hands JAX).
    """
    from gang_jax._convert import to_numpy  # the view a JaxGang makes: bfloat16 included

    moved = []
    for dtype in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        if str(dtype).startswith("torch.q"):  # quantized: no plain tensor of numbers (and a deprecation warning)
            continue
        try:
            t = torch.zeros(2, dtype=dtype)
            dist.all_reduce(t)
            dist.broadcast(t, 0)
            to_numpy(t)
        except (RuntimeError, TypeError, ValueError, NotImplementedError, NotSupportedError):
            continue
        moved.append(str(dtype))
    return moved
