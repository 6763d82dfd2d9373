"""Convenience collectives built on any :class:`~gang.Gang`."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

from gang.extend import all_gather_bytes, pickle_or_error
from gang.gang import Gang, ReduceOperation

T = TypeVar("T")


def broadcast_flag(gang: Gang, flag: bool, source_rank: int = 0) -> bool:
    """Return ``flag`` of ``source_rank`` on every rank.

    :raises TypeError: If ``flag`` is not a ``bool``.
    :raises ValueError: If ``source_rank`` is out of range.
    """
    if not isinstance(flag, bool):
        raise TypeError(f"`flag` must be a `bool`, but is {flag!r} instead.")
    tensor = torch.tensor([int(flag)], dtype=torch.int32, device=gang.device)
    gang.broadcast(tensor, source_rank)
    return bool(tensor.item())


def all_sum(gang: Gang, value: float | int | Tensor) -> Tensor:
    """Return the sum of ``value`` over every rank as a new tensor on the gang's device.

    :raises TypeError: If ``value`` is not a number or tensor.
    """
    if isinstance(value, Tensor):
        tensor = value.detach().to(gang.device, copy=True)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        tensor = torch.tensor(value, device=gang.device)
    else:
        raise TypeError(f"`value` must be a number or a `torch.Tensor`, but is {value!r} instead.")
    gang.all_reduce(tensor, ReduceOperation.SUM)
    return tensor


def all_gather_objects(gang: Gang, obj: T) -> list[T]:
    """Return ``obj`` of every rank, in rank order.

    Each rank pickles its object; lengths are exchanged first so every rank learns if any rank's
    object cannot be pickled, and then all raise the same ``ValueError`` (nobody is left waiting).
    What peers send is unpickled: only use it between processes you trust.

    :raises ValueError: If the object of any rank cannot be pickled.
    """
    payload, error = pickle_or_error(obj)
    rows = all_gather_bytes(gang, payload)
    bad = [rank for rank, row in enumerate(rows) if row is None]
    if bad:
        detail = f" (here: {error})" if error else ""
        raise ValueError(f"`obj` must be picklable, but pickling failed on rank(s) {bad}{detail}.")
    return [pickle.loads(row or b"") for row in rows]


def all_reduce_dict(gang: Gang, data: Mapping[str, Any], op: ReduceOperation = ReduceOperation.SUM) -> dict[str, Any]:
    """Reduce every value of ``data`` (numbers or tensors) over the gang in one collective per dtype.

    Every rank passes the same keys. Numbers come back as Python numbers, tensors as tensors of
    the same shape and dtype on the gang's device.

    :raises TypeError: If ``data`` is not a mapping or a value is neither a number nor a tensor.
    :raises ValueError: If ``op`` is ``MEAN`` and a value is an integer.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"`data` must be a mapping, but is of type `{type(data).__name__}` instead.")
    tensors: dict[str, Tensor] = {}
    for key, value in data.items():
        if isinstance(value, Tensor):
            tensors[key] = value.detach().to(gang.device)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            tensors[key] = torch.tensor(value, device=gang.device)
        else:
            raise TypeError(f"`data[{key!r}]` must be a number or a `torch.Tensor`, but is {value!r} instead.")
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key in sorted(tensors):
        by_dtype.setdefault(tensors[key].dtype, []).append(key)
    if op is ReduceOperation.MEAN:
        for dtype, keys in by_dtype.items():
            if not dtype.is_floating_point:
                raise ValueError(
                    "`op` is `ReduceOperation.MEAN`, which needs floating-point values, "
                    f"but `data[{keys[0]!r}]` has dtype {dtype} instead."
                )
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
