"""One body per collective, run on a reference gang and on every gang of a table, in the same processes.

The reference is the torch ProcessGroupGang; the table is :data:`conformance_workers.GANGS` (an
in-process JaxGang, an isolated one with JAX in a child process, and a FakeGang on inputs equal on
every rank, as its semantics assume). A new kind of gang joins by one entry there. Inputs are chosen
so that every reduction is exact whatever order a backend combines values in (see
:func:`conformance_workers.make_input`); results must then be equal bit for bit. Each table of
cases (operation x dtype, collective x dtype) runs in full once per engine, and as a cover at the
other world sizes and on gangs that forward to another entry's engine (see :data:`FULL_SIZE`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import conformance_workers as cw
import pytest
import torch

from gang.extend import SUPPORTED_DTYPES
from gang.testing import World

DTYPES = ["float32", "float64", "int32", "int64", "bfloat16"]
OPS = ["SUM", "MEAN", "PRODUCT", "MIN", "MAX"]
MOVES = ["all_gather", "all_gather_to_list", "all_to_all", "broadcast_first", "broadcast_last"]
SHAPE = (2, 3)
SIZES = (2, 4)
FULL_SIZE = 2
"""The world size at which each table (operation x dtype, collective x dtype) is checked in full.

At the other sizes, and on an entry that forwards to another entry's engine
(:attr:`conformance_workers.GangKind.engine_of`), a cover of the table is checked: every
operation, every collective and every dtype at least once. An engine handles the operation and
the dtype of a call independently of the world size, and forwarding moves them independently.
"""


@pytest.fixture(scope="module")
def world_of() -> Iterator[Callable[[int], World]]:
    """``world_of(n)``: this module's world of ``n`` processes (started on first use)."""
    worlds: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in worlds or not worlds[size].alive:
            worlds[size] = World(size, env={"OMP_NUM_THREADS": "1"})
        return worlds[size]

    yield get
    for w in worlds.values():
        w.close()


def _valid(op: str, dtype: str) -> bool:
    # MEAN is defined for floating point only (every gang refuses it alike)
    return not (op == "MEAN" and dtype.startswith("int"))


def _cover(first: list[str], second: list[str], shift: int) -> list[tuple[str, str]]:
    """Pairs in which every value of ``first`` and of ``second`` appears: ``first[i]`` with ``second[i + shift]``."""
    n = max(len(first), len(second))
    pairs = [(first[i % len(first)], second[(i + shift) % len(second)]) for i in range(n)]
    assert all(_valid(a, b) for a, b in pairs), pairs
    return pairs


def _table(first: list[str], second: list[str], *, shift: int = 0) -> list[Any]:
    """(size, entry, a, b) for the table ``first`` x ``second``: in full or a cover (see :data:`FULL_SIZE`)."""
    cases = []
    for size in SIZES:
        for name, kind in cw.GANGS.items():
            if size == FULL_SIZE and kind.engine_of is None:
                pairs = [(a, b) for a in first for b in second if _valid(a, b)]
            else:
                pairs = _cover(first, second, shift)
            cases += [pytest.param(size, name, a, b, id=f"world{size}-{name}-{a}-{b}") for a, b in pairs]
    return cases


def _each(names: list[str] | None = None) -> list[Any]:
    """(size, entry) for every world size and every entry (or those of ``names``)."""
    names = list(cw.GANGS) if names is None else names
    return [pytest.param(size, name, id=f"world{size}-{name}") for size in SIZES for name in names]


def _assert_same(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        t, j = r["reference"], r["tested"]
        if isinstance(t, list):
            assert len(t) == len(j)
            for a, b in zip(t, j, strict=True):
                assert a.dtype == b.dtype, f"rank {rank}: {a.dtype} != {b.dtype}"
                assert torch.equal(a, b), f"rank {rank}: {a} != {b}"
        else:
            assert t.dtype == j.dtype, f"rank {rank}: {t.dtype} != {j.dtype}"
            assert torch.equal(t, j), f"rank {rank}: reference {t} != tested {j}"


@pytest.mark.parametrize(("size", "name", "op", "dtype"), _table(OPS, DTYPES))
def test_all_reduce(world_of: Callable[[int], World], size: int, name: str, op: str, dtype: str) -> None:
    _assert_same(world_of(size).run(cw.run_collective, name, "all_reduce", op, dtype, SHAPE))


@pytest.mark.parametrize(("size", "name", "op", "dtype"), _table(OPS, DTYPES, shift=4))
def test_reduce_scatter(world_of: Callable[[int], World], size: int, name: str, op: str, dtype: str) -> None:
    _assert_same(world_of(size).run(cw.run_collective, name, "reduce_scatter", op, dtype, SHAPE))


@pytest.mark.parametrize(("size", "name", "kind", "dtype"), _table(MOVES, DTYPES))
def test_data_movement(world_of: Callable[[int], World], size: int, name: str, kind: str, dtype: str) -> None:
    _assert_same(world_of(size).run(cw.run_collective, name, kind, None, dtype, SHAPE))


@pytest.mark.parametrize("shape", [(), (0,), (1, 1, 5)], ids=["scalar", "empty", "rank3"])
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "broadcast_last"])
@pytest.mark.parametrize(("size", "name"), _each())
def test_odd_shapes(world_of: Callable[[int], World], size: int, name: str, kind: str, shape: tuple[int, ...]) -> None:
    _assert_same(world_of(size).run(cw.run_collective, name, kind, "SUM", "float32", shape))


def _large() -> list[Any]:
    # A gang that assumes equal data on every rank has no data path to check; an entry that
    # forwards to another's engine checks its own path (its shared memory) once.
    cases = []
    for size, name in [(size, name) for size in SIZES for name, kind in cw.GANGS.items() if not kind.same_data]:
        table = [("SUM", "float32"), ("MAX", "int64"), ("SUM", "int32")]
        for op, dtype in table[: 1 if cw.GANGS[name].engine_of else None]:
            cases.append(pytest.param(size, name, op, dtype, id=f"world{size}-{op}-{dtype}-{name}"))
    return cases


@pytest.mark.parametrize(("size", "name", "op", "dtype"), _large())
def test_large_reduce_scatter(world_of: Callable[[int], World], size: int, name: str, op: str, dtype: str) -> None:
    # 2**20 elements per chunk: a size at which some JAX CPU builds returned wrong reduce-scatter data.
    _assert_same(world_of(size).run(cw.run_collective, name, "reduce_scatter", op, dtype, (1 << 20,)))


@pytest.mark.parametrize(("size", "name"), _each())
def test_results_are_not_trivial(world_of: Callable[[int], World], size: int, name: str) -> None:
    # Guards the suite itself: a SUM must differ from the input, or equality would prove nothing.
    results = world_of(size).run(cw.run_collective, name, "all_reduce", "SUM", "int64", SHAPE)
    ranks = [0] * size if cw.GANGS[name].same_data else range(size)
    expected = torch.stack([cw.make_input(r, SHAPE, torch.int64, None) for r in ranks]).sum(0)
    for r in results:
        assert torch.equal(r["tested"], expected)


@pytest.mark.parametrize("how", ["create_gang", "split", "three"])
@pytest.mark.parametrize(("size", "name"), _each())
def test_subgangs(world_of: Callable[[int], World], size: int, name: str, how: str) -> None:
    results = world_of(size).run(cw.run_on_subgangs, name, how)
    members = 0
    for r in results:
        assert (r["reference"] is None) == (r["tested"] is None)
        if r["reference"] is None:
            continue
        members += 1
        for key in ("rank", "size"):
            assert r["reference"][key] == r["tested"][key]
        for key in ("sum", "mean", "gather", "broadcast"):
            assert torch.equal(r["reference"][key], r["tested"][key]), key
    assert members >= 2


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize(("size", "name"), _each())
def test_parallel_gangs(world_of: Callable[[int], World], size: int, name: str, tp_size: int) -> None:
    results = world_of(size).run(cw.run_parallel_gangs, name, tp_size)
    for r in results:
        for layout in ("parallel", "fsdp"):
            for axis, (rank, gang_size, value) in r["reference"][layout].items():
                j_rank, j_size, j_value = r["tested"][layout][axis]
                assert (rank, gang_size) == (j_rank, j_size), (layout, axis)
                assert torch.equal(value, j_value), (layout, axis)


@pytest.mark.parametrize(("size", "name"), _each([name for name, kind in cw.GANGS.items() if kind.objects]))
def test_broadcast_objects(world_of: Callable[[int], World], size: int, name: str) -> None:
    results = world_of(size).run(cw.run_broadcast_objects, name)
    for r in results:
        assert r["reference"] == r["tested"] == [{"from": size - 1}, "x" * 1000]


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"world{n}")
def test_supported_dtypes_are_what_every_backend_moves(world_of: Callable[[int], World], size: int) -> None:
    # Adding a dtype that some backend refuses (float8) or dropping one they all move (int8) fails here.
    for moved in world_of(size).run(cw.moved_dtypes):
        assert sorted(str(d) for d in SUPPORTED_DTYPES) == moved
