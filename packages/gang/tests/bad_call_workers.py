"""A catalogue of bad calls: each must raise before any communication, naming the argument.

Each entry maps a name to ``(call, exception type, text the message must contain)``. The same
table runs on a FakeGang and on real gloo gangs; afterwards the gang must still work.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gang import Gang, InvalidOperationError, ReduceOperation, exchange_rows

SUM = ReduceOperation.SUM


def _closed_sub(g: Gang) -> None:
    sub = g.create_gang(list(range(g.size)))
    assert sub is not None
    sub.close()
    sub.all_reduce(torch.ones(1), SUM)


class _Unpicklable:
    def __reduce__(self) -> str:
        raise TypeError("not picklable on purpose")


BadCall = Callable[[Gang], object]


def _peer(g: Gang) -> int:
    """A valid peer of this rank (every gang of the catalogue has at least two ranks)."""
    return (g.rank + 1) % g.size


def _uneven(g: Gang, *, output: torch.Tensor | None = None, inp: torch.Tensor | None = None, **splits: object) -> None:
    """``all_to_all_uneven`` of one row per rank, with ``output``, ``input`` or splits replaced."""
    g.all_to_all_uneven(  # type: ignore[call-overload]
        torch.empty(g.size, 2) if output is None else output,
        torch.ones(g.size, 2) if inp is None else inp,
        splits.get("output_splits", [1] * g.size),
        splits.get("input_splits", [1] * g.size),
    )


CATALOGUE: dict[str, tuple[BadCall, type[Exception], str]] = {
    "all_reduce not a tensor": (lambda g: g.all_reduce([1.0], SUM), TypeError, "`tensor`"),  # type: ignore[call-overload]
    "all_reduce op not an enum": (lambda g: g.all_reduce(torch.ones(2), "sum"), TypeError, "`op`"),  # type: ignore[call-overload]
    "all_reduce MEAN on int32": (
        lambda g: g.all_reduce(torch.ones(2, dtype=torch.int32), ReduceOperation.MEAN),
        ValueError,
        "MEAN",
    ),
    "all_reduce MEAN on int64": (
        lambda g: g.all_reduce(torch.ones(2, dtype=torch.int64), ReduceOperation.MEAN),
        ValueError,
        "int64",
    ),
    "all_reduce non-contiguous": (lambda g: g.all_reduce(torch.ones(4, 4).t(), SUM), ValueError, "contiguous"),
    "all_reduce wrong device": (lambda g: g.all_reduce(torch.ones(2, device="meta"), SUM), ValueError, "device"),
    "all_reduce read-only numpy": (
        lambda g: g.all_reduce(np.broadcast_to(np.ones(1), (2,)), SUM),
        ValueError,
        "writeable",
    ),
    "all_gather wrong output shape": (
        lambda g: g.all_gather(torch.empty(g.size + 1, 2), torch.ones(2)),
        ValueError,
        "`output_tensor` must have shape",
    ),
    "all_gather dtype mismatch": (
        lambda g: g.all_gather(torch.empty(g.size, 2, dtype=torch.float64), torch.ones(2)),
        ValueError,
        "dtype",
    ),
    "all_gather non-contiguous output": (
        lambda g: g.all_gather(torch.empty(2, g.size).t(), torch.ones(2)),
        ValueError,
        "contiguous",
    ),
    "all_gather input not a tensor": (
        lambda g: g.all_gather(torch.empty(g.size, 2), "x"),  # type: ignore[call-overload]
        TypeError,
        "`input_tensor`",
    ),
    "all_gather_to_list not a list": (
        lambda g: g.all_gather_to_list(tuple(torch.empty(2) for _ in range(g.size)), torch.ones(2)),  # type: ignore[arg-type]
        TypeError,
        "`output_tensors`",
    ),
    "all_gather_to_list wrong length": (
        lambda g: g.all_gather_to_list([torch.empty(2) for _ in range(g.size + 1)], torch.ones(2)),
        ValueError,
        "entries",
    ),
    "all_gather_to_list wrong entry shape": (
        lambda g: g.all_gather_to_list([torch.empty(3) for _ in range(g.size)], torch.ones(2)),
        ValueError,
        "`output_tensors[0]`",
    ),
    "all_gather_to_list entry dtype": (
        lambda g: g.all_gather_to_list([torch.empty(2, dtype=torch.int64) for _ in range(g.size)], torch.ones(2)),
        ValueError,
        "dtype",
    ),
    "reduce_scatter wrong input shape": (
        lambda g: g.reduce_scatter(torch.empty(2), torch.ones(g.size + 1, 2), SUM),
        ValueError,
        "`input_tensor` must have shape",
    ),
    "reduce_scatter dtype mismatch": (
        lambda g: g.reduce_scatter(torch.empty(2), torch.ones(g.size, 2, dtype=torch.float64), SUM),
        ValueError,
        "dtype",
    ),
    "reduce_scatter MEAN on ints": (
        lambda g: g.reduce_scatter(
            torch.empty(2, dtype=torch.int32), torch.ones(g.size, 2, dtype=torch.int32), ReduceOperation.MEAN
        ),
        ValueError,
        "MEAN",
    ),
    "reduce_scatter bad op": (
        lambda g: g.reduce_scatter(torch.empty(2), torch.ones(g.size, 2), 0),  # type: ignore[call-overload]
        TypeError,
        "`op`",
    ),
    "all_to_all wrong first dim": (
        lambda g: g.all_to_all(torch.empty(g.size + 1, 2), torch.ones(g.size + 1, 2)),
        ValueError,
        "`input_tensor` must have shape",
    ),
    "all_to_all scalar input": (
        lambda g: g.all_to_all(torch.empty(()), torch.ones(())),
        ValueError,
        "`input_tensor`",
    ),
    "all_to_all shape mismatch": (
        lambda g: g.all_to_all(torch.empty(g.size, 3), torch.ones(g.size, 2)),
        ValueError,
        "`output_tensor` must have shape",
    ),
    "broadcast source == size": (lambda g: g.broadcast(torch.ones(2), g.size), ValueError, "`source_rank`"),
    "broadcast negative source": (lambda g: g.broadcast(torch.ones(2), -1), ValueError, "`source_rank`"),
    "broadcast float source": (lambda g: g.broadcast(torch.ones(2), 0.0), TypeError, "`source_rank`"),  # type: ignore[call-overload]
    "broadcast bool source": (lambda g: g.broadcast(torch.ones(2), True), TypeError, "`source_rank`"),
    "broadcast_objects not a list": (lambda g: g.broadcast_objects((1, 2)), TypeError, "`objects`"),  # type: ignore[arg-type]
    "broadcast_objects bad source": (lambda g: g.broadcast_objects([1], g.size), ValueError, "`source_rank`"),
    "broadcast_objects unpicklable": (lambda g: g.broadcast_objects([_Unpicklable()]), ValueError, "picklable"),
    "create_gang duplicates": (lambda g: g.create_gang([0, 0]), ValueError, "duplicates"),
    "create_gang rank == size": (lambda g: g.create_gang([0, g.size]), ValueError, "`ranks`"),
    "create_gang negative rank": (lambda g: g.create_gang([-1]), ValueError, "`ranks`"),
    "create_gang empty": (lambda g: g.create_gang([]), ValueError, "empty"),
    "create_gang not ints": (lambda g: g.create_gang(["0"]), TypeError, "`ranks`"),  # type: ignore[list-item]
    "create_gang a string": (lambda g: g.create_gang("01"), TypeError, "`ranks`"),  # type: ignore[arg-type]
    "split overlapping": (lambda g: g.split([[0], [0]]), ValueError, "disjoint"),
    "collective on closed gang": (_closed_sub, InvalidOperationError, "closed"),
    # Dtypes and reductions that some backend (gloo) cannot do are refused on every gang.
    "all_reduce int16": (lambda g: g.all_reduce(torch.ones(2, dtype=torch.int16), SUM), ValueError, "int16"),
    "all_gather uint16": (
        lambda g: g.all_gather(torch.empty(g.size, 2, dtype=torch.uint16), torch.ones(2, dtype=torch.uint16)),
        ValueError,
        "uint16",
    ),
    "broadcast uint32": (lambda g: g.broadcast(torch.ones(2, dtype=torch.uint32)), ValueError, "`tensor`"),
    "all_to_all uint64": (
        lambda g: g.all_to_all(torch.empty(g.size, dtype=torch.uint64), torch.ones(g.size, dtype=torch.uint64)),
        ValueError,
        "uint64",
    ),
    "all_reduce complex MAX": (
        lambda g: g.all_reduce(torch.ones(2, dtype=torch.complex64), ReduceOperation.MAX),
        ValueError,
        "complex64",
    ),
    "all_reduce complex MIN": (
        lambda g: g.all_reduce(torch.ones(2, dtype=torch.complex128), ReduceOperation.MIN),
        ValueError,
        "`op`",
    ),
    "reduce_scatter complex PRODUCT": (
        lambda g: g.reduce_scatter(
            torch.empty(2, dtype=torch.complex64), torch.ones(g.size, 2, dtype=torch.complex64), ReduceOperation.PRODUCT
        ),
        ValueError,
        "PRODUCT",
    ),
    "broadcast numpy float source": (lambda g: g.broadcast(torch.ones(2), np.float64(0)), TypeError, "`source_rank`"),
    # Point-to-point, uneven rows and handles (the SPEC's "Traffic for every parallelism").
    "send to own rank": (lambda g: g.send(torch.ones(2), g.rank), ValueError, "`dest_rank` must be a rank other"),
    "send dest == size": (lambda g: g.send(torch.ones(2), g.size), ValueError, "`dest_rank`"),
    "recv negative source": (lambda g: g.recv(torch.empty(2), -1), ValueError, "`source_rank`"),
    "recv from own rank": (lambda g: g.recv(torch.empty(2), g.rank), ValueError, "`source_rank` must be a rank other"),
    "send float rank": (lambda g: g.send(torch.ones(2), 1.0), TypeError, "`dest_rank`"),  # type: ignore[call-overload]
    "recv bool rank": (lambda g: g.recv(torch.empty(2), True), TypeError, "`source_rank`"),
    "send not a tensor": (lambda g: g.send([1.0], _peer(g)), TypeError, "`tensor`"),  # type: ignore[call-overload]
    "recv non-contiguous": (lambda g: g.recv(torch.empty(4, 4).t(), _peer(g)), ValueError, "contiguous"),
    "send int16": (lambda g: g.send(torch.ones(2, dtype=torch.int16), _peer(g)), ValueError, "int16"),
    "send async_op not a bool": (
        lambda g: g.send(torch.ones(2), _peer(g), async_op=1),  # type: ignore[call-overload]
        TypeError,
        "`async_op`",
    ),
    "send_recv sends not pairs": (lambda g: g.send_recv([torch.ones(2)]), TypeError, "`sends[0]`"),  # type: ignore[list-item]
    "send_recv recvs a string": (lambda g: g.send_recv(recvs="ab"), TypeError, "`recvs`"),  # type: ignore[arg-type]
    "send_recv to own rank": (lambda g: g.send_recv([(torch.ones(2), g.rank)]), ValueError, "`sends[0][1]`"),
    "send_recv numpy rank": (
        lambda g: g.send_recv(recvs=[(torch.empty(2), np.float32(0))]),
        TypeError,
        "`recvs[0][1]`",
    ),
    "send_recv recv non-contiguous": (
        lambda g: g.send_recv(recvs=[(torch.empty(4, 4).t(), _peer(g))]),
        ValueError,
        "`recvs[0][0]` must be contiguous",
    ),
    "all_to_all_uneven splits too short": (
        lambda g: _uneven(g, input_splits=[g.size]),
        ValueError,
        "`input_splits` must have",
    ),
    "all_to_all_uneven negative split": (
        lambda g: _uneven(g, output_splits=[-1, 2] + [1] * (g.size - 2)),
        ValueError,
        "`output_splits[0]` must be at least 0",
    ),
    "all_to_all_uneven float split": (
        lambda g: _uneven(g, input_splits=[1.0] + [1] * (g.size - 1)),
        TypeError,
        "`input_splits[0]`",
    ),
    "all_to_all_uneven bool split": (
        lambda g: _uneven(g, output_splits=[True] + [1] * (g.size - 1)),
        TypeError,
        "`output_splits[0]`",
    ),
    "all_to_all_uneven splits not a sequence": (lambda g: _uneven(g, input_splits=3), TypeError, "`input_splits`"),
    "all_to_all_uneven splits do not sum to rows": (
        lambda g: _uneven(g, input_splits=[2] * g.size),
        ValueError,
        "`input_splits` must sum to",
    ),
    "all_to_all_uneven trailing shape": (
        lambda g: _uneven(g, output=torch.empty(g.size, 3)),
        ValueError,
        "`output` must have shape [rows, 2]",
    ),
    "all_to_all_uneven dtype mismatch": (
        lambda g: _uneven(g, output=torch.empty(g.size, 2, dtype=torch.float64)),
        ValueError,
        "dtype",
    ),
    "all_to_all_uneven non-contiguous output": (
        lambda g: _uneven(g, output=torch.empty(2, g.size).t()),
        ValueError,
        "`output` must be contiguous",
    ),
    "all_to_all_uneven scalar input": (
        lambda g: _uneven(g, output=torch.empty(()), inp=torch.ones(())),
        ValueError,
        "`input` must have at least one dimension",
    ),
    "all_reduce async_op not a bool": (
        lambda g: g.all_reduce(torch.ones(2), SUM, async_op="yes"),  # type: ignore[call-overload]
        TypeError,
        "`async_op`",
    ),
    "exchange_rows splits do not sum to rows": (
        lambda g: exchange_rows(g, torch.ones(g.size, 2), [0] * g.size),
        ValueError,
        "`input_splits` must sum to",
    ),
    "exchange_rows negative split": (
        lambda g: exchange_rows(g, torch.ones(0, 2), [-1, 1] + [0] * (g.size - 2)),
        ValueError,
        "`input_splits[0]`",
    ),
}

BAD_CALLS: dict[str, BadCall] = {name: call for name, (call, _, _) in CATALOGUE.items()}
