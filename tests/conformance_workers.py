"""Functions the conformance suite runs on every rank: the same inputs through two gangs.

Each worker holds the torch :class:`~gang.ProcessGroupGang` that :class:`gang.testing.World`
created and up to two root JaxGangs, one in-process and one isolated (JAX in
a child process), each created on first use and kept in a module global, so a whole test module
shares one JAX runtime of each kind per process. Every worker takes ``isolated`` to pick one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gang import Gang, Gangs, ReduceOperation, create_fsdp_gangs, create_parallel_gangs
from gang_jax import JaxGang

_JAX: dict[bool, JaxGang] = {}

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "bfloat16": torch.bfloat16,
}


def jax_gang(isolated: bool) -> JaxGang:
    """Return this process's root :class:`JaxGang` of the given kind, creating it on first use."""
    g = _JAX.get(isolated)
    if g is None or g.closed:
        g = _JAX[isolated] = JaxGang.create_default(isolated=isolated)
    return g


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


def _both(pg: Gang, isolated: bool) -> tuple[Gang, Gang]:
    return pg, jax_gang(isolated)


def run_collective(
    pg: Gang, kind: str, op_name: str | None, dtype_name: str, shape: tuple[int, ...], isolated: bool
) -> dict[str, Any]:
    """Run ``kind`` on the torch gang and on the JAX gang with the same inputs; return both outputs."""
    dtype = DTYPES[dtype_name]
    op = ReduceOperation[op_name] if op_name else None
    results: dict[str, Any] = {}
    for name, g in zip(("torch", "jax"), _both(pg, isolated), strict=True):
        results[name] = _run_one(g, kind, op, dtype, shape)
    return results


def _run_one(g: Gang, kind: str, op: ReduceOperation | None, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
    rank, size = g.rank, g.size
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
        inp = make_input(rank, (size, *shape), dtype, None) + rank
        out = torch.empty_like(inp)
        g.all_to_all(out, inp)
        return out
    if kind.startswith("broadcast"):
        source = 0 if kind == "broadcast_first" else size - 1
        t = make_input(rank, shape, dtype, None) * (rank + 1)
        g.broadcast(t, source)
        return t
    raise ValueError(f"`kind` must name a collective, but is {kind!r} instead.")


def run_on_subgangs(pg: Gang, how: str, isolated: bool) -> dict[str, Any]:
    """Build sub-gangs of both roots the same way and run a few collectives on them."""
    results: dict[str, Any] = {}
    for name, root in zip(("torch", "jax"), _both(pg, isolated), strict=True):
        if how == "create_gang":
            sub = root.create_gang([0, root.size - 1])
        elif how == "split":
            sub = root.split([[r for r in range(root.size) if r % 2 == 0], [r for r in range(root.size) if r % 2]])
        else:  # a group of three ranks (MEAN then divides by 3)
            sub = root.create_gang(list(range(min(3, root.size))))
        if sub is None:
            results[name] = None
            continue
        out: dict[str, Any] = {"rank": sub.rank, "size": sub.size}
        t = make_input(root.rank, (5,), torch.float64, None)
        sub.all_reduce(t, ReduceOperation.SUM)
        out["sum"] = t
        t = make_input(root.rank, (5,), torch.float32, None)
        sub.all_reduce(t, ReduceOperation.MEAN)
        out["mean"] = t
        g = torch.empty((sub.size, 3), dtype=torch.int64)
        sub.all_gather(g, make_input(root.rank, (3,), torch.int64, None))
        out["gather"] = g
        b = torch.full((2,), float(root.rank))
        sub.broadcast(b, sub.size - 1)
        out["broadcast"] = b
        sub.close()
        results[name] = out
    return results


def _summarise(gangs: Gangs, root_rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for axis in ("dp", "tp", "pp", "rdp", "sdp"):
        g: Gang = getattr(gangs, axis)
        t = torch.tensor([root_rank + 1, 10 * (root_rank + 1)], dtype=torch.int64)
        g.all_reduce(t, ReduceOperation.SUM)
        out[axis] = (g.rank, g.size, t)
    return out


def run_parallel_gangs(pg: Gang, tp_size: int, isolated: bool) -> dict[str, Any]:
    """Build parallel and FSDP gangs on both roots and all-reduce along every axis."""
    results: dict[str, Any] = {}
    for name, root in zip(("torch", "jax"), _both(pg, isolated), strict=True):
        gangs = create_parallel_gangs(root, tp_size=tp_size)
        fsdp = create_fsdp_gangs(gangs, intra_node_size=2 if gangs.dp.size % 2 == 0 else None)
        results[name] = {"parallel": _summarise(gangs, root.rank), "fsdp": _summarise(fsdp, root.rank)}
        _close_all(fsdp)
        _close_all(gangs)
    return results


def run_broadcast_objects(pg: Gang, isolated: bool) -> dict[str, Any]:
    """Broadcast a list of objects from the last rank on both gangs."""
    results: dict[str, Any] = {}
    for name, g in zip(("torch", "jax"), _both(pg, isolated), strict=True):
        objects: list[object] = [{"from": g.rank}, "x" * 1000] if g.rank == g.size - 1 else []
        g.broadcast_objects(objects, g.size - 1)
        results[name] = objects
    return results
