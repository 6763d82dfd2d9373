"""broadcast_flag, all_sum, all_gather_objects, all_reduce_dict on real processes and on FakeGang."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from core_workers import helpers_tour

import gang
from gang import FakeGang, ReduceOperation
from gang.testing import World


def test_helpers_on_four_real_ranks(worlds: Callable[[int], World]) -> None:
    results = worlds(4).run(helpers_tour)
    for rank, got in enumerate(results):
        assert got["flag"] is True
        assert got["total"] == 1 + 2 + 3 + 4
        assert got["objs"] == [{"rank": r, "name": f"r{r}"} for r in range(4)]
        assert got["reduced"]["loss"] == 6.0
        assert got["reduced"]["count"] == 10 and isinstance(got["reduced"]["count"], int)
        assert torch.equal(got["reduced"]["vec"], torch.full((2,), 6.0))
        assert got["mean"]["loss"] == 1.5
        assert "pickling failed on rank(s) [1]" in got["bad"], (rank, got["bad"])
        assert got["broadcast_objects"] == [2, "x"]


def test_helpers_on_fake_gang() -> None:
    g = FakeGang(torch.device("cpu"), rank=1, size=4)
    assert gang.broadcast_flag(g, True) is True
    assert gang.all_sum(g, 2.5).item() == 10.0
    assert gang.all_gather_objects(g, "a") == ["a"] * 4
    assert gang.all_reduce_dict(g, {"x": 1.0, "n": 3}) == {"x": 4.0, "n": 12}
    assert gang.all_reduce_dict(g, {"x": 2.0}, ReduceOperation.MEAN) == {"x": 2.0}


def test_helper_argument_errors() -> None:
    g = FakeGang(torch.device("cpu"), size=2)
    with pytest.raises(TypeError, match="`flag`"):
        gang.broadcast_flag(g, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`value`"):
        gang.all_sum(g, "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`data`"):
        gang.all_reduce_dict(g, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`data\['a'\]`"):
        gang.all_reduce_dict(g, {"a": "x"})
    with pytest.raises(ValueError, match="MEAN"):
        gang.all_reduce_dict(g, {"a": 1}, ReduceOperation.MEAN)
    with pytest.raises(ValueError, match="picklable"):
        gang.all_gather_objects(g, lambda: 0)
