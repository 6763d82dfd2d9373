"""Convenience collectives built on any :class:`~gang.Gang`."""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from gang._checks import check_tensor
from gang.extend import (
    all_gather_bytes,
    check_op,
    check_open,
    check_splits,
    check_values_exchangeable,
    pickle_or_error,
)
from gang.gang import Gang, ReduceOperation
from gang.work import _block

T = TypeVar("T")


def broadcast_flag(gang: Gang, flag: bool, source_rank: int = 0) -> bool:
    """Return ``flag`` of ``source_rank`` on every rank.

    :raises TypeError: If ``flag`` is not a ``bool``.
    :raises ValueError: If ``source_rank`` is out of range.
    """
    if not isinstance(flag, bool):
        raise TypeError(f"`flag` must be a `bool`, but is {flag!r} instead.")
    check_values_exchangeable(gang, "broadcast_flag")
    tensor = torch.tensor([int(flag)], dtype=torch.int32, device=gang.device)
    gang.broadcast(tensor, source_rank)
    return bool(tensor.item())


def exchange_rows(gang: Gang, input: Tensor, input_splits: Sequence[int]) -> tuple[Tensor, list[int]]:
    """Send ``input_splits[j]`` rows of ``input`` to each rank ``j``; return what every rank sent this one.

    The token dispatch of a mixture-of-experts layer (and, called with what it returned, its
    reverse): each rank knows only how many rows it sends, so the counts are exchanged first
    (one :meth:`~gang.Gang.all_to_all` of ``int64``), then the rows (one
    :meth:`~gang.Gang.all_to_all_uneven`). Every member of the gang calls it.

    :param gang: The gang to exchange over.
    :param input: The rows to send (dim 0), grouped by destination rank.
    :param input_splits: ``gang.size`` non-negative ``int`` s summing to ``input``'s rows.
    :returns: ``(output, output_splits)``: the rows received, grouped by source rank (a new
        tensor with ``input``'s trailing shape and dtype), and how many came from each rank.
    :raises TypeError: If ``input`` is not a tensor or ``input_splits`` not a sequence of ``int``.
    :raises ValueError: If ``input`` has no dimension, or ``input_splits`` has the wrong length, a
        negative entry or does not sum to ``input``'s rows.
    :raises NotSupportedError: If the gang has no uneven rows (a :class:`~gang.ft.ReplicaGang`),
        before anything is sent.
    :raises GangError: If a collective fails or times out.
    """
    # Everything `all_to_all_uneven` will check, before the counts are exchanged: a bad call on one
    # rank then fails there alone, with nothing sent.
    if gang.closed:
        check_open(gang, "exchange_rows")
    if not isinstance(input, Tensor):
        raise TypeError(f"`input` must be a `torch.Tensor`, but is of type `{type(input).__name__}` instead.")
    check_tensor(gang, "input", input)  # the gang's device, a dtype every gang moves
    if input.dim() == 0:
        raise ValueError("`input` must have at least one dimension (the rows), but is a scalar instead.")
    splits = check_splits("input_splits", input_splits, gang.size, input.shape[0], "input")
    if not gang._moves_uneven_rows:
        gang._refuse_traffic("exchange_rows")
    counts = torch.tensor(splits, dtype=torch.int64, device=gang.device)
    received = torch.empty_like(counts)
    # Row i of `received`: what rank i sends this one. Everything the public methods check is
    # checked above or holds by construction, so outside debug mode (which checks each call across
    # the ranks) the two calls go straight to the gang's own methods.
    if gang.debug:
        gang.all_to_all(received, counts)
    else:
        _block(gang._all_to_all(received, counts, False))
    output_splits: list[int] = received.tolist()
    output = input.new_empty((sum(output_splits), *input.shape[1:]))
    if gang.debug:
        gang.all_to_all_uneven(output, input, output_splits, splits)
    else:
        _block(gang._all_to_all_uneven(output, input.contiguous(), output_splits, splits, False))
    return output, output_splits


def _number_kind(value: object) -> torch.dtype | None:
    """The dtype a Python number is reduced in (``float`` as float64, ``int`` as int64), else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return torch.float64
    if isinstance(value, int):
        return torch.int64
    return None


def all_sum(gang: Gang, value: float | int | Tensor) -> Tensor:
    """Return the sum of ``value`` over every rank as a new tensor on the gang's device.

    A Python ``float`` is summed in float64 and an ``int`` in int64, so the result is what exact
    arithmetic on Python numbers gives (up to float64 rounding). Every rank passes the same kind
    of value (all ``float``, all ``int``, or tensors of one dtype and shape).

    :raises TypeError: If ``value`` is not a number or tensor.
    """
    if isinstance(value, Tensor):
        tensor = value.detach().to(gang.device, copy=True)
    else:
        dtype = _number_kind(value)
        if dtype is None:
            raise TypeError(f"`value` must be a number or a `torch.Tensor`, but is {value!r} instead.")
        tensor = torch.tensor(value, dtype=dtype, device=gang.device)
    check_values_exchangeable(gang, "all_sum")
    gang.all_reduce(tensor, ReduceOperation.SUM)
    return tensor


def all_gather_objects(gang: Gang, obj: T) -> list[T]:
    """Return ``obj`` of every rank, in rank order.

    Each rank pickles its object; lengths are exchanged first so every rank learns if any rank's
    object cannot be pickled, and then all raise the same ``ValueError`` (nobody is left waiting).
    What peers send is unpickled: only use it between processes you trust.

    :raises ValueError: If the object of any rank cannot be pickled.
    """
    check_values_exchangeable(gang, "all_gather_objects")
    payload, error = pickle_or_error(obj)
    rows = all_gather_bytes(gang, payload)
    bad = [rank for rank, row in enumerate(rows) if row is None]
    if bad:
        detail = f" (here: {error})" if error else ""
        raise ValueError(f"`obj` must be picklable, but pickling failed on rank(s) {bad}{detail}.")
    return [pickle.loads(row or b"") for row in rows]


def all_reduce_dict(gang: Gang, data: Mapping[str, Any], op: ReduceOperation = ReduceOperation.SUM) -> dict[str, Any]:
    """Reduce every value of ``data`` (numbers or tensors) over the gang in one collective per dtype.

    Numbers come back as Python numbers, tensors as tensors of the same shape and dtype on the
    gang's device. Python ``float`` values are reduced in float64 and ``int`` values in int64; a key that
    is an ``int`` on some ranks and a ``float`` on others is reduced as float64 on every rank. The
    ranks first exchange their keys and the kind of each value, so a mismatch they cannot
    reconcile raises the same error on every rank instead of a hang.

    :raises TypeError: If ``data`` is not a mapping, ``op`` is not a :class:`~gang.ReduceOperation`,
        or a value on some rank is neither a number nor a tensor (on every rank).
    :raises ValueError: If the ranks' keys differ, a key is a tensor on one rank and a number (or
        a tensor of another dtype or shape) on another, or ``op`` cannot reduce a value's dtype
        (the check of every gang, :func:`gang.extend.check_op`: ``MEAN`` of integers, ``MIN`` of
        complex values; on every rank).
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"`data` must be a mapping, but is of type `{type(data).__name__}` instead.")
    check_values_exchangeable(gang, "all_reduce_dict")
    kinds = {key: _value_kind(value) for key, value in data.items()}
    dtypes = _agree_on_dtypes(all_gather_objects(gang, kinds))
    tensors: dict[str, Tensor] = {}
    for key, value in data.items():
        if isinstance(value, Tensor):
            tensors[key] = value.detach().to(gang.device)
        else:
            tensors[key] = torch.tensor(value, dtype=dtypes[key], device=gang.device)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key in sorted(tensors):
        by_dtype.setdefault(tensors[key].dtype, []).append(key)
    for dtype, keys in by_dtype.items():  # before any reduction: the dtypes are the same on every rank
        check_op("op", op, dtype, of=f"`data[{keys[0]!r}]`")
    result: dict[str, Any] = {}
    for dtype in sorted(by_dtype, key=str):
        keys = by_dtype[dtype]
        flat = torch.cat([tensors[key].reshape(-1) for key in keys])
        gang.all_reduce(flat, op)
        offset = 0
        for key in keys:
            n = tensors[key].numel()
            reduced = flat[offset : offset + n].view(tensors[key].shape)
            offset += n
            result[key] = reduced.clone() if isinstance(data[key], Tensor) else reduced.item()
    return {key: result[key] for key in data}


def _value_kind(value: object) -> tuple[str, ...]:
    """What a rank tells its peers about one value of :func:`all_reduce_dict`."""
    if isinstance(value, Tensor):
        return ("tensor", str(value.dtype), str(list(value.shape)))
    dtype = _number_kind(value)
    if dtype is None:
        return ("invalid", repr(value))
    return ("number", str(dtype))


def _agree_on_dtypes(kinds_by_rank: list[dict[str, tuple[str, ...]]]) -> dict[str, torch.dtype]:
    """The dtype each key is reduced in, the same on every rank; or the same error on every rank."""
    keys = set(kinds_by_rank[0])
    for rank, kinds in enumerate(kinds_by_rank):
        if set(kinds) != keys:
            raise ValueError(
                f"`data` must have the same keys on every rank, but rank 0 has {sorted(keys)} "
                f"and rank {rank} has {sorted(kinds)}."
            )
    dtypes: dict[str, torch.dtype] = {}
    for key in sorted(keys):
        seen = [kinds[key] for kinds in kinds_by_rank]
        invalid = [(rank, kind[1]) for rank, kind in enumerate(seen) if kind[0] == "invalid"]
        if invalid:
            rank, text = invalid[0]
            raise TypeError(f"`data[{key!r}]` must be a number or a `torch.Tensor`, but is {text} on rank {rank}.")
        if all(kind[0] == "number" for kind in seen):
            wide = any(kind[1] == str(torch.float64) for kind in seen)
            dtypes[key] = torch.float64 if wide else torch.int64
        elif any(kind != seen[0] for kind in seen):
            described = "; ".join(f"rank {rank}: {' '.join(kind)}" for rank, kind in enumerate(seen))
            raise ValueError(
                f"`data[{key!r}]` must be the same kind of value on every rank (numbers, or tensors of "
                f"one dtype and shape), but is: {described}."
            )
    return dtypes
