"""FakeGang simulates every collective as if every rank held the same data."""

from __future__ import annotations

import pytest
import torch

from gang import FakeGang, NotSupportedError, ReduceOperation, exchange_rows

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (ReduceOperation.SUM, [4.0, -8.0, 12.0]),
        (ReduceOperation.PRODUCT, [1.0, 16.0, 81.0]),
        (ReduceOperation.MEAN, [1.0, -2.0, 3.0]),
        (ReduceOperation.MIN, [1.0, -2.0, 3.0]),
        (ReduceOperation.MAX, [1.0, -2.0, 3.0]),
    ],
)
def test_all_reduce_simulates_identical_ranks(op: ReduceOperation, expected: list[float]) -> None:
    g = FakeGang(CPU, rank=2, size=4)
    t = torch.tensor([1.0, -2.0, 3.0])
    g.all_reduce(t, op)
    assert t.tolist() == expected


def test_integer_product_and_sum() -> None:
    g = FakeGang(CPU, size=3)
    t = torch.tensor([2, -1], dtype=torch.int64)
    g.all_reduce(t, ReduceOperation.PRODUCT)
    assert t.tolist() == [8, -1] and t.dtype == torch.int64
    g.all_reduce(t, ReduceOperation.SUM)
    assert t.tolist() == [24, -3]


def test_gathers_replicate_the_input() -> None:
    g = FakeGang(CPU, rank=1, size=3)
    out = torch.empty(3, 2)
    g.all_gather(out, torch.tensor([1.0, 2.0]))
    assert out.tolist() == [[1.0, 2.0]] * 3
    outs = [torch.empty(2) for _ in range(3)]
    g.all_gather_to_list(outs, torch.tensor([5.0, 6.0]))
    assert [o.tolist() for o in outs] == [[5.0, 6.0]] * 3


def test_reduce_scatter_and_all_to_all_take_this_ranks_row() -> None:
    g = FakeGang(CPU, rank=1, size=3)
    inp = torch.tensor([[1.0], [2.0], [3.0]])
    out = torch.empty(1)
    g.reduce_scatter(out, inp, ReduceOperation.SUM)
    assert out.tolist() == [6.0]  # three copies of row 1
    g.reduce_scatter(out, inp, ReduceOperation.MAX)
    assert out.tolist() == [2.0]
    a2a = torch.empty(3, 1)
    g.all_to_all(a2a, inp)
    assert a2a.tolist() == [[2.0]] * 3  # every rank sends its row 1 to rank 1


def test_broadcasts_are_no_ops_and_numpy_works_in_place() -> None:
    import numpy as np

    g = FakeGang(CPU, rank=0, size=2)
    t = torch.tensor([3.0])
    g.broadcast(t, source_rank=1)
    assert t.tolist() == [3.0]
    objs: list[object] = ["a"]
    g.broadcast_objects(objs, source_rank=1)
    assert objs == ["a"]
    arr = np.array([1.0, 2.0])
    g.all_reduce(arr, ReduceOperation.SUM)
    assert arr.tolist() == [2.0, 4.0]


def test_create_gang_gives_fake_gangs_with_the_right_rank() -> None:
    g = FakeGang(CPU, rank=5, size=8)
    # Members are ordered by their rank in the parent, whatever order the caller lists them in.
    sub = g.create_gang([7, 1, 5])
    assert isinstance(sub, FakeGang) and (sub.rank, sub.size) == (1, 3)
    assert g.create_gang([0, 1]) is None
    sub = g.split([[1, 0], [6, 2, 5], [4]])
    assert sub is not None and (sub.rank, sub.size) == (1, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"size": 0}, ValueError, "`size`"),
        ({"size": -2}, ValueError, "`size`"),
        ({"rank": 2, "size": 2}, ValueError, "`rank`"),
        ({"rank": -1, "size": 2}, ValueError, "`rank`"),
        ({"rank": 1.0, "size": 2}, TypeError, "`rank`"),
    ],
)
def test_construction_errors(kwargs: dict[str, object], error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        FakeGang(CPU, **kwargs)  # type: ignore[arg-type]


def test_meta_device_and_process_group() -> None:
    with pytest.raises(ValueError, match="meta"):
        FakeGang(torch.device("meta"))
    g = FakeGang(CPU)
    assert not g.supports_process_group
    with pytest.raises(NotSupportedError, match="`FakeGang` has no process group"):
        g.as_process_group()


def test_close_is_idempotent_and_final() -> None:
    from gang import InvalidOperationError

    with FakeGang(CPU, size=2) as g:
        sub = g.create_gang([0, 1])
    assert g.closed and sub is not None and sub.closed
    g.close()
    with pytest.raises(InvalidOperationError, match="closed"):
        g.barrier()


@pytest.mark.parametrize("op", list(ReduceOperation))
def test_bool_reductions_are_logical_as_on_gloo(op: ReduceOperation) -> None:
    # gloo (and NCCL) reduce bools as OR (SUM, MAX) and AND (PRODUCT, MIN); identical copies stay.
    g = FakeGang(CPU, size=3)
    t = torch.tensor([True, False])
    if op is ReduceOperation.MEAN:
        with pytest.raises(ValueError, match="MEAN"):
            g.all_reduce(t, op)
        return
    g.all_reduce(t, op)
    assert t.tolist() == [True, False]
    out = torch.empty(2, dtype=torch.bool)
    g.reduce_scatter(out, torch.tensor([[True, False], [False, True], [True, True]]), op)
    assert out.tolist() == [True, False]


def test_numpy_integers_are_ranks_and_sizes() -> None:
    np = pytest.importorskip("numpy")
    g = FakeGang(CPU, rank=np.int64(1), size=np.int64(2))
    assert (g.rank, g.size) == (1, 2) and type(g.rank) is int and type(g.size) is int
    sub = g.create_gang([np.int64(0), np.int32(1)])
    assert sub is not None and (sub.rank, sub.size) == (1, 2)
    g.broadcast(torch.ones(2), source_rank=np.int32(1))
    with pytest.raises(TypeError, match="`rank`"):
        FakeGang(CPU, rank=np.bool_(True), size=2)


def test_cpu_with_an_index_is_the_cpu_device() -> None:
    g = FakeGang(torch.device("cpu", 0), size=2)
    assert g.device == CPU
    t = torch.ones(2)  # lives on `cpu`, not `cpu:0`
    g.all_reduce(t, ReduceOperation.SUM)
    assert t.tolist() == [2.0, 2.0]


def test_traffic_under_the_same_data_assumption() -> None:
    # A send goes nowhere, a receive leaves its tensor as it is, and rank r's uneven rows are its own
    # block for r from every rank; every operation is complete when it returns, handles included.
    g = FakeGang(torch.device("cpu"), rank=1, size=3)
    received = torch.arange(4.0)
    g.send(torch.ones(4), 0)
    g.recv(received, 2)
    work = g.send_recv([(torch.ones(4), 2)], [(received, 0)], async_op=True)
    assert work.is_completed() and received.tolist() == [0.0, 1.0, 2.0, 3.0]
    inp = torch.arange(10.0).reshape(5, 2)  # rows 1-2 are the block for rank 1
    out = torch.empty(6, 2)
    g.all_to_all_uneven(out, inp, [2, 2, 2], [1, 2, 2])
    assert out.tolist() == [[2.0, 3.0], [4.0, 5.0]] * 3
    rows, splits = exchange_rows(g, inp, [1, 2, 2])
    assert torch.equal(rows, out) and splits == [2, 2, 2]
    with pytest.raises(ValueError, match=r"`output_splits` must all equal `input_splits\[1\]` \(2\) on a `FakeGang`"):
        g.all_to_all_uneven(torch.empty(6, 2), inp, [1, 2, 3], [1, 2, 2])
