"""The argument checks of :class:`gang.Gang`'s public methods, as functions of the gang they check.

Every public method of :class:`~gang.Gang` runs these before any communication, so every kind of
gang rejects a bad call alike and with the same words. The code of this package around a gang
(:mod:`gang.helpers`) runs the same functions. The checks that need no gang (ints, ranks, dtypes,
ops, splits) are :mod:`gang.extend`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from gang.extend import SUPPORTED_DTYPES, check_dtype, check_int, check_rank

if TYPE_CHECKING:
    from gang.gang import Gang


def check_ranks(gang: Gang, name: str, ranks: Sequence[int]) -> list[int]:
    """``ranks``, unique ranks of ``gang``, sorted; ``name`` names the argument in errors."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"`{name}` must be a sequence of `int`, but is {ranks!r} instead.")
    checked = []
    for r in ranks:
        try:
            checked.append(check_int(name, r))
        except TypeError:
            raise TypeError(f"`{name}` must contain only `int` ranks, but contains {r!r} instead.") from None
    ranks = checked
    if len(ranks) == 0:
        raise ValueError(f"`{name}` must not be empty.")
    if len(set(ranks)) != len(ranks):
        duplicates = sorted({r for r in ranks if list(ranks).count(r) > 1})
        raise ValueError(f"`{name}` must be unique, but has duplicates {duplicates} in {list(ranks)} instead.")
    bad = [r for r in ranks if not 0 <= r < gang.size]
    if bad:
        raise ValueError(
            f"`{name}` must be ranks of this gang in the range [0, {gang.size}), "
            f"but has {bad} in {list(ranks)} instead."
        )
    return sorted(ranks)


def check_peer(gang: Gang, name: str, value: object) -> int:
    """A rank of ``gang`` other than this process's own: the peer of a send or receive."""
    if type(value) is int and 0 <= value < gang._size and value != gang._rank:
        return value  # the common case, in a few bytecodes (it runs between a wake-up and the transfer)
    peer = check_rank(name, value, gang._size)
    if peer == gang._rank:
        raise ValueError(
            f"`{name}` must be a rank other than this process's own ({gang._rank}) "
            f"in the range [0, {gang._size}), but is {peer} instead."
        )
    return peer


def check_pairs(gang: Gang, name: str, pairs: object, peer_name: str, *, contiguous: bool) -> list[tuple[Tensor, int]]:
    """The ``(tensor, rank)`` pairs of :meth:`~gang.Gang.send_recv`, checked, with contiguous tensors (those
    of ``sends`` made so; ``recvs`` must be); ``name[i]`` names an entry."""
    if type(pairs) is list or type(pairs) is tuple:  # the common case: no error message is built
        fast = []
        for pair in pairs:
            if type(pair) is not tuple or len(pair) != 2:
                break
            t, peer = pair
            if not (
                type(t) is Tensor
                and (t.is_cpu if gang._on_cpu else t.device == gang._device)
                and t.dtype in SUPPORTED_DTYPES
                and t.is_contiguous()
                and type(peer) is int
                and 0 <= peer < gang._size
                and peer != gang._rank
            ):
                break
            fast.append(pair)
        else:
            return fast
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
        raise TypeError(f"`{name}` must be a sequence of `(tensor, {peer_name})` pairs, but is {pairs!r} instead.")
    checked = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"`{name}[{i}]` must be a `(tensor, {peer_name})` pair, but is {pair!r} instead.")
        t = check_tensor(gang, f"{name}[{i}][0]", pair[0], contiguous=contiguous)
        checked.append((t.contiguous(), check_peer(gang, f"{name}[{i}][1]", pair[1])))
    return checked


def check_tensor(gang: Gang, name: str, value: object, *, contiguous: bool = False) -> Tensor:
    """``value`` as a tensor on ``gang``'s device with a dtype every gang moves (a writeable NumPy array
    becomes a tensor sharing its memory on a CPU gang)."""
    if (
        type(value) is Tensor
        and (value.is_cpu if gang._on_cpu else value.device == gang._device)
        and value.dtype in SUPPORTED_DTYPES
        and (not contiguous or value.is_contiguous())
    ):
        return value  # the common case, in a few bytecodes (it runs between a wake-up and the collective)
    if not isinstance(value, Tensor):
        value = from_array(gang, name, value)
    if value.device != gang.device:
        raise ValueError(f"`{name}` must be on the gang's device {gang.device}, but is on {value.device} instead.")
    check_dtype(name, value.dtype)
    if contiguous and not value.is_contiguous():
        raise ValueError(f"`{name}` must be contiguous, but is not (strides {list(value.stride())}).")
    return value


def from_array(gang: Gang, name: str, value: object) -> Tensor:
    """A writeable NumPy array as a tensor sharing its memory (CPU gangs only)."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"`{name}` must be a `torch.Tensor`, but is of type `{type(value).__name__}` instead.")
    if gang.device.type != "cpu":
        raise TypeError(f"`{name}` must be a `torch.Tensor` on {gang.device}, but is a NumPy array instead.")
    if not value.flags.writeable:
        raise ValueError(f"`{name}` must be a writeable NumPy array, but is read-only.")
    return torch.from_numpy(value)


def check_same_dtype(name: str, value: Tensor, reference: Tensor) -> None:
    """Raise unless ``value`` has ``reference``'s dtype."""
    if value.dtype != reference.dtype:
        raise ValueError(f"`{name}` must have dtype {reference.dtype}, but has {value.dtype} instead.")


def check_shape(name: str, value: Tensor, shape: tuple[int, ...]) -> None:
    """Raise unless ``value`` has the shape ``shape``."""
    if value.shape != shape:
        raise ValueError(f"`{name}` must have shape {list(shape)}, but has shape {list(value.shape)} instead.")


def check_async(async_op: object) -> None:
    """Raise unless ``async_op`` is a ``bool``."""
    if async_op is not True and async_op is not False:
        raise TypeError(f"`async_op` must be a `bool`, but is {async_op!r} instead.")


def unpicklable_objects(source_rank: int, error: str) -> str:
    """The error every rank raises when the source of :meth:`~gang.Gang.broadcast_objects` cannot pickle its
    list."""
    detail = f" with {error}" if error else f" on source rank {source_rank}"
    return f"`objects` must be picklable, but pickling failed{detail}."
