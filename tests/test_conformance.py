"""One body per collective, run on a torch ProcessGroupGang and a JaxGang in the same processes.

Inputs are chosen so that every reduction is exact whatever order a backend combines values in
(see :func:`conformance_workers.make_input`); results must then be equal bit for bit. Every test
runs twice: on an in-process JaxGang and on an isolated one (JAX in a child process).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import conformance_workers as cw
import pytest
import torch

from gang.testing import World

DTYPES = ["float32", "float64", "int32", "int64", "bfloat16"]
OPS = ["SUM", "MEAN", "PRODUCT", "MIN", "MAX"]
SHAPE = (2, 3)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    with World(request.param, env={"OMP_NUM_THREADS": "1"}) as w:
        yield w


@pytest.fixture(params=[False, True], ids=["in-process", "isolated"])
def isolated(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _assert_same(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        t, j = r["torch"], r["jax"]
        if isinstance(t, list):
            assert len(t) == len(j)
            for a, b in zip(t, j, strict=True):
                assert a.dtype == b.dtype, f"rank {rank}: {a.dtype} != {b.dtype}"
                assert torch.equal(a, b), f"rank {rank}: {a} != {b}"
        else:
            assert t.dtype == j.dtype, f"rank {rank}: {t.dtype} != {j.dtype}"
            assert torch.equal(t, j), f"rank {rank}: torch {t} != jax {j}"


def _reductions() -> list[Any]:
    cases = []
    for op in OPS:
        for dtype in DTYPES:
            if op == "MEAN" and dtype.startswith("int"):
                continue  # MEAN is defined for floating point only (both gangs refuse it alike)
            cases.append(pytest.param(op, dtype, id=f"{op}-{dtype}"))
    return cases


@pytest.mark.parametrize(("op", "dtype"), _reductions())
def test_all_reduce(world: World, isolated: bool, op: str, dtype: str) -> None:
    _assert_same(world.run(cw.run_collective, "all_reduce", op, dtype, SHAPE, isolated))


@pytest.mark.parametrize(("op", "dtype"), _reductions())
def test_reduce_scatter(world: World, isolated: bool, op: str, dtype: str) -> None:
    _assert_same(world.run(cw.run_collective, "reduce_scatter", op, dtype, SHAPE, isolated))


@pytest.mark.parametrize(
    "kind", ["all_gather", "all_gather_to_list", "all_to_all", "broadcast_first", "broadcast_last"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_data_movement(world: World, isolated: bool, kind: str, dtype: str) -> None:
    _assert_same(world.run(cw.run_collective, kind, None, dtype, SHAPE, isolated))


@pytest.mark.parametrize("shape", [(), (0,), (1, 1, 5)], ids=["scalar", "empty", "rank3"])
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "broadcast_last"])
def test_odd_shapes(world: World, isolated: bool, kind: str, shape: tuple[int, ...]) -> None:
    _assert_same(world.run(cw.run_collective, kind, "SUM", "float32", shape, isolated))


@pytest.mark.parametrize(("op", "dtype"), [("SUM", "float32"), ("MAX", "int64"), ("SUM", "int32")])
def test_large_reduce_scatter(world: World, isolated: bool, op: str, dtype: str) -> None:
    # 2**20 elements per chunk: a size at which some JAX CPU builds returned wrong reduce-scatter data.
    results = world.run(cw.run_collective, "reduce_scatter", op, dtype, (1 << 20,), isolated)
    _assert_same(results)


def test_results_are_not_trivial(world: World, isolated: bool) -> None:
    # Guards the suite itself: a SUM must differ from the input, or equality would prove nothing.
    results = world.run(cw.run_collective, "all_reduce", "SUM", "int64", SHAPE, isolated)
    expected = torch.stack([cw.make_input(r, SHAPE, torch.int64, None) for r in range(world.world_size)]).sum(0)
    for r in results:
        assert torch.equal(r["jax"], expected)


@pytest.mark.parametrize("how", ["create_gang", "split", "three"])
def test_subgangs(world: World, isolated: bool, how: str) -> None:
    results = world.run(cw.run_on_subgangs, how, isolated)
    members = 0
    for r in results:
        assert (r["torch"] is None) == (r["jax"] is None)
        if r["torch"] is None:
            continue
        members += 1
        for key in ("rank", "size"):
            assert r["torch"][key] == r["jax"][key]
        for key in ("sum", "mean", "gather", "broadcast"):
            assert torch.equal(r["torch"][key], r["jax"][key]), key
    assert members >= 2


@pytest.mark.parametrize("tp_size", [1, 2])
def test_parallel_gangs(world: World, isolated: bool, tp_size: int) -> None:
    results = world.run(cw.run_parallel_gangs, tp_size, isolated)
    for r in results:
        for layout in ("parallel", "fsdp"):
            for axis, (rank, size, value) in r["torch"][layout].items():
                j_rank, j_size, j_value = r["jax"][layout][axis]
                assert (rank, size) == (j_rank, j_size), (layout, axis)
                assert torch.equal(value, j_value), (layout, axis)


def test_broadcast_objects(world: World, isolated: bool) -> None:
    results = world.run(cw.run_broadcast_objects, isolated)
    for r in results:
        assert r["torch"] == r["jax"] == [{"from": world.world_size - 1}, "x" * 1000]
