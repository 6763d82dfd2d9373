"""broadcast_flag, all_sum, all_gather_objects, all_reduce_dict on real processes and on FakeGang."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from core_workers import dict_kinds

import gang
from gang import FakeGang, Gang, ReduceOperation, all_gather_objects, all_reduce_dict, all_sum, broadcast_flag
from gang.extend import check_op
from gang.testing import World


@pytest.mark.gang(world_size=4)
def test_helpers_on_four_real_ranks(gang: Gang) -> None:  # `gang` is this rank's gang, not the module
    rank = gang.rank
    assert broadcast_flag(gang, rank == 1, source_rank=1) is True
    assert all_sum(gang, rank + 1).item() == 1 + 2 + 3 + 4
    assert all_gather_objects(gang, {"rank": rank, "name": f"r{rank}"}) == [
        {"rank": r, "name": f"r{r}"} for r in range(4)
    ]
    reduced = all_reduce_dict(gang, {"loss": float(rank), "count": rank + 1, "vec": torch.full((2,), float(rank))})
    assert reduced["loss"] == 6.0
    assert reduced["count"] == 10 and isinstance(reduced["count"], int)
    assert torch.equal(reduced["vec"], torch.full((2,), 6.0))
    assert all_reduce_dict(gang, {"loss": float(rank)}, ReduceOperation.MEAN)["loss"] == 1.5
    with pytest.raises(ValueError, match=r"pickling failed on rank\(s\) \[1\]"):
        all_gather_objects(gang, (lambda: 0) if rank == 1 else 1)
    objects: list[object] = [rank, "x"] if rank == 2 else []
    gang.broadcast_objects(objects, source_rank=2)
    assert objects == [2, "x"]


def test_helpers_on_fake_gang() -> None:
    g = FakeGang(torch.device("cpu"), rank=1, size=4)
    assert gang.broadcast_flag(g, True) is True
    assert gang.all_sum(g, 2.5).item() == 10.0
    assert gang.all_gather_objects(g, "a") == ["a"] * 4
    assert gang.all_reduce_dict(g, {"x": 1.0, "n": 3}) == {"x": 4.0, "n": 12}
    assert gang.all_reduce_dict(g, {"x": 2.0}, ReduceOperation.MEAN) == {"x": 2.0}
    z = torch.tensor([1 + 2j])  # the gang takes a complex MEAN, so does the helper
    assert torch.equal(gang.all_reduce_dict(g, {"z": z}, ReduceOperation.MEAN)["z"], z)


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
    with pytest.raises(ValueError, match=re.escape("`op` is `ReduceOperation.MEAN`, which needs floating-point")):
        gang.all_reduce_dict(g, {"a": 1}, ReduceOperation.MEAN)
    # The helper refuses what the gang refuses, in the same words (naming the value it holds).
    for op in (ReduceOperation.MAX, ReduceOperation.MEAN):
        t = torch.ones(2, dtype=torch.complex64 if op is ReduceOperation.MAX else torch.int32)
        with pytest.raises(ValueError, match=r"`op`") as of_gang:
            g.all_reduce(t, op)
        expected = str(of_gang.value).replace("the tensor", "`data['t']`")
        with pytest.raises(ValueError, match=re.escape(expected)):
            gang.all_reduce_dict(g, {"t": t}, op)
    with pytest.raises(ValueError, match="picklable"):
        gang.all_gather_objects(g, lambda: 0)


def test_python_numbers_reduce_in_64_bits() -> None:
    g = FakeGang(torch.device("cpu"), rank=0, size=2)
    tiny = gang.all_sum(g, 1 + 1e-9)
    assert tiny.dtype == torch.float64 and tiny.item() == (1 + 1e-9) * 2
    assert gang.all_sum(g, 1e39).item() == 2e39
    assert gang.all_sum(g, 2**40).dtype == torch.int64
    reduced = gang.all_reduce_dict(g, {"x": 1 + 1e-9, "big": 1e39, "n": 2**40})
    assert reduced == {"x": (1 + 1e-9) * 2, "big": 2e39, "n": 2**41}
    assert isinstance(reduced["n"], int)


def test_all_reduce_dict_agrees_on_kinds_across_ranks(worlds: Callable[[int], World]) -> None:
    results = worlds(2).run(dict_kinds)
    for got in results:
        assert got["mixed"] == {"a": 3.5, "b": 4, "c": 2.5}
        assert isinstance(got["mixed"]["a"], float) and isinstance(got["mixed"]["b"], int)
        # Keys or kinds that cannot agree: the same ValueError on every rank, no hang.
        assert got["keys"] == results[0]["keys"] and got["keys"].startswith(
            "ValueError: `data` must have the same keys"
        )
        assert got["kinds"] == results[0]["kinds"] and got["kinds"].startswith("ValueError: `data['t']` must be")
        assert got["after"] == 2.0


def test_one_reduction_check_for_torch_and_jax_dtypes() -> None:
    # `gang_jax.functional` checks a JAX array's dtype by name with the same function as every gang.
    mean = ReduceOperation.MEAN
    assert check_op("op", mean, "bfloat16") is check_op("op", mean, torch.bfloat16) is mean
    with pytest.raises(ValueError, match=re.escape("but `x` has dtype int32 instead.")):
        check_op("op", mean, "int32", of="`x`")
    with pytest.raises(TypeError, match=re.escape("`dtype` must be a `torch.dtype` or the name of one")):
        check_op("op", mean, "float128")
