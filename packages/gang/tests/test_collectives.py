"""Every collective x every reduction x five dtypes on real gloo processes (1, 2, 4 and 8 ranks).

The test bodies run on every rank through gang's pytest plugin (``@pytest.mark.gang``). Expected
values are computed independently, on each rank, from every rank's input with NumPy in 64 bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from core_workers import DTYPES, run_collective, values

from gang import Gang

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "all_gather_to_list", "all_to_all", "broadcast"]
SHAPE = (3, 2)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


def _reduce(stack: np.ndarray, op: str) -> np.ndarray:
    reductions = {
        "SUM": lambda s: s.sum(axis=0),
        "MEAN": lambda s: s.sum(axis=0) / s.shape[0],
        "PRODUCT": lambda s: s.prod(axis=0),
        "MIN": lambda s: s.min(axis=0),
        "MAX": lambda s: s.max(axis=0),
    }
    return np.asarray(reductions[op](stack))


def expected(collective: str, dtype: torch.dtype, size: int, rank: int) -> dict[str, np.ndarray]:
    ops = ["SUM", "PRODUCT", "MIN", "MAX"] + (["MEAN"] if dtype.is_floating_point else [])
    if collective == "all_reduce":
        stack = np.stack([_np(values(r, SHAPE, dtype)) for r in range(size)])
        return {op: _reduce(stack, op) for op in ops}
    if collective == "reduce_scatter":
        stack = np.stack([_np(values(r, (size, *SHAPE), dtype))[rank] for r in range(size)])
        return {op: _reduce(stack, op) for op in ops}
    if collective in ("all_gather", "all_gather_to_list"):
        return {"-": np.stack([_np(values(r, SHAPE, dtype)) for r in range(size)])}
    if collective == "all_to_all":
        return {"-": np.stack([_np(values(r, (size, *SHAPE), dtype))[rank] for r in range(size)])}
    if collective == "broadcast":
        return {f"source={s}": _np(values(s, SHAPE, dtype)) for s in range(size)}
    raise AssertionError(collective)


@pytest.mark.gang(world_size=[1, 2, 4, 8])
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_collective_matches_independent_computation(gang: Gang, collective: str, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    rank = gang.rank
    got = run_collective(gang, collective, dtype_name, SHAPE)
    want = expected(collective, dtype, gang.size, rank)
    assert sorted(got) == sorted(want), f"rank {rank}: reductions {sorted(got)} != {sorted(want)}"
    for key, value in want.items():
        tensor = got[key]
        assert tensor.dtype == dtype, (rank, key, tensor.dtype)
        # Every value is exactly representable, so the comparison is exact.
        assert torch.equal(tensor, torch.tensor(value).to(dtype)), f"rank {rank} {key}: {tensor} != {value}"


def test_inputs_make_products_and_sums_nontrivial() -> None:
    # Guard against a degenerate input generator that would make the checks above vacuous.
    stack = np.stack([_np(values(r, SHAPE, torch.float32)) for r in range(8)])
    assert len(np.unique(stack)) >= 4
    assert np.any(stack.prod(axis=0) != 0)
    assert np.any(stack.min(axis=0) != stack.max(axis=0))
