"""Building blocks for implementing a kind of gang outside this package.

A new kind of gang subclasses :class:`gang.Gang`, passes its ``rank``, ``size`` and ``device`` to
``Gang.__init__`` and implements the protected methods (``_all_reduce(tensor, op, async_op)``,
``_send_recv(sends, recvs, async_op, operation)``, ``_split``, ...; those that take ``async_op``
return a :class:`gang.Work`, or ``None`` once the operation is done: see "Adding a kind of gang" in
``docs/contributing.rst``). The
public methods of :class:`~gang.Gang` already check their arguments; this module holds those same
checks and the error builders for the code a gang adds around them (a factory, a JAX-native
collective, a fault-tolerant wrapper), so that every gang rejects bad input, and reports a failed
operation, with the same words:

.. code-block:: python

    from gang.extend import check_open, check_rank, guard

    def broadcast_array(gang, x, source_rank=0):
        check_open(gang, "broadcast_array")
        source_rank = check_rank("source_rank", source_rank, gang.size)
        with guard("broadcast_array", gang):
            ...  # the backend's own broadcast

This module reads a gang only through :class:`GangView` (what any :class:`gang.Gang` offers), so
that :mod:`gang.gang` can use its checks without a cycle between the two modules.
"""

from __future__ import annotations

import numbers
import pickle
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Literal, Protocol, final, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from gang.errors import BACKEND_ERRORS, GangError, InvalidOperationError, NotSupportedError
from gang.ops import ReduceOperation
from gang.trace._recorder import claim_rank

__all__ = [
    "SUPPORTED_DTYPES",
    "DryRunnable",
    "GangView",
    "all_gather_bytes",
    "check_device",
    "check_dtype",
    "check_int",
    "check_op",
    "check_open",
    "check_rank",
    "check_splits",
    "check_timeout",
    "check_values_exchangeable",
    "claim_rank",
    "guard",
    "operation_error",
    "pickle_or_error",
]

SUPPORTED_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
"""The tensor dtypes every gang accepts: what gloo, the narrowest backend, can move.

gloo refuses ``int16``, ``uint16``, ``uint32``, ``uint64`` and the ``float8`` types ("Invalid scalar
type", measured with torch 2.13 on two processes), so every gang refuses them. Which reductions
apply to which dtypes is checked by :func:`check_op`.
"""

_REDUCTIONS_OF_COMPLEX = frozenset({ReduceOperation.SUM, ReduceOperation.MEAN})


class GangView(Protocol):
    """What the helpers of this module read of a gang; every :class:`gang.Gang` is one."""

    @property
    def rank(self) -> int:
        """The rank of this process in the gang."""

    @property
    def size(self) -> int:
        """The number of processes in the gang."""

    @property
    def device(self) -> torch.device:
        """The device of the gang's tensors."""

    @property
    def closed(self) -> bool:
        """Whether the gang was closed."""

    def all_gather(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        """Gather every member's ``input_tensor`` into the rows of ``output_tensor``."""


@runtime_checkable
class DryRunnable(Protocol):
    """A kind of gang that can be part of a dry run (:class:`~gang.ProcessGroupGang` on torch's ``fake`` backend)."""

    @property
    def dry_run(self) -> bool:
        """Whether this gang is part of a dry run: its collectives complete without computing anything."""


def check_open(gang: GangView, operation: str) -> None:
    """Refuse ``operation`` on a closed gang.

    :raises InvalidOperationError: If :attr:`gang.closed <gang.Gang.closed>` is true.
    """
    if gang.closed:
        raise InvalidOperationError(f"`{operation}` cannot be called on a closed gang ({gang!r}).")


def check_values_exchangeable(gang: GangView, operation: str) -> None:
    """Refuse ``operation``, which needs values from peers, on a gang whose collectives compute nothing.

    A dry run (:func:`gang.testing.dry_run`, torch's ``fake`` backend) completes every collective
    without moving data, so what reads peers' values back (objects, flags, dicts, debug mode's
    checks) would silently see garbage.

    :raises NotSupportedError: If ``gang`` is part of a dry run.
    """
    if isinstance(gang, DryRunnable) and gang.dry_run:
        raise NotSupportedError(
            f"`{operation}` needs values from the other ranks, which a dry run (torch's `fake` backend, "
            f"rank {gang.rank} of a gang of size {gang.size}) does not have."
        )


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` as an ``int`` if it is an integer (NumPy integers too) and at least ``minimum``.

    ``bool`` is refused although Python counts it as an integer: ``True`` as a rank or size is a bug.

    :param name: The argument's name, used in the error message.
    :param value: The value to check.
    :param minimum: The smallest value allowed (``None``: no bound).
    :raises TypeError: If ``value`` is not an integer, or is a ``bool``.
    :raises ValueError: If ``value`` is below ``minimum``.
    """
    if type(value) is int:  # the common case, without the ABC check (0.4 us, per collective in `broadcast`)
        checked = value
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an `int`, but is {value!r} of type `{type(value).__name__}` instead.")
    else:
        checked = int(value)
    if minimum is not None and checked < minimum:
        raise ValueError(f"`{name}` must be at least {minimum}, but is {checked} instead.")
    return checked


def check_rank(name: str, value: object, size: int) -> int:
    """Return ``value`` as an ``int`` if it is a rank of a gang of ``size``, that is in ``[0, size)``.

    :raises TypeError: If ``value`` is not an integer (see :func:`check_int`).
    :raises ValueError: If ``value`` is outside ``[0, size)``.
    """
    rank = check_int(name, value)
    if not 0 <= rank < size:
        raise ValueError(f"`{name}` must be in the range [0, {size}), but is {rank} instead.")
    return rank


def check_splits(name: str, splits: object, size: int, rows: int, tensor_name: str) -> list[int]:
    """Return ``splits`` as a list if it holds ``size`` non-negative integers that sum to ``rows``.

    The split sizes of an uneven all-to-all (:meth:`gang.Gang.all_to_all_uneven`,
    :func:`gang.exchange_rows`): rows of ``tensor_name`` (dim 0) per rank.

    :raises TypeError: If ``splits`` is not a sequence, or an entry not an integer.
    :raises ValueError: If it has not ``size`` entries, an entry is negative, or they do not sum to ``rows``.
    """
    if (type(splits) is list or type(splits) is tuple) and len(splits) == size:
        # The common case, without building a name per entry (it runs before every uneven all-to-all).
        total = 0
        for n in splits:
            if type(n) is not int or n < 0:
                break
            total += n
        else:
            if total == rows:
                return list(splits)
    if isinstance(splits, (str, bytes)) or not isinstance(splits, Sequence):
        raise TypeError(f"`{name}` must be a sequence of `int`, but is {splits!r} instead.")
    if len(splits) != size:
        raise ValueError(f"`{name}` must have {size} entries (the gang size), but has {len(splits)} instead.")
    checked = [check_int(f"{name}[{i}]", n, minimum=0) for i, n in enumerate(splits)]
    if sum(checked) != rows:
        raise ValueError(
            f"`{name}` must sum to the {rows} rows (dim 0) of `{tensor_name}`, "
            f"but {checked} sums to {sum(checked)} instead."
        )
    return checked


def check_dtype(name: str, dtype: torch.dtype) -> None:
    """Refuse a tensor dtype that some backend cannot move (see :data:`SUPPORTED_DTYPES`).

    :raises ValueError: If ``dtype`` is not in :data:`SUPPORTED_DTYPES`.
    """
    if dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
        raise ValueError(f"`{name}` must have a dtype that every gang supports ({supported}), but has {dtype} instead.")


def check_op(name: str, op: object, dtype: torch.dtype | str, *, of: str = "the tensor") -> ReduceOperation:
    """Return ``op`` if it is a :class:`~gang.ReduceOperation` every gang can apply to ``dtype``.

    Every reduction applies to floating-point dtypes; ``MEAN`` needs a floating-point or complex
    dtype; complex dtypes only take ``SUM`` and ``MEAN`` (gloo and NCCL have no complex ``MIN``,
    ``MAX`` or ``PRODUCT``). ``bool`` reduces as a logical or (``SUM``, ``MAX``) and a logical and
    (``PRODUCT``, ``MIN``), as gloo and NCCL do. Every public reduction of every gang, and every
    helper that reduces (:func:`gang.all_reduce_dict`, ``gang_jax.functional``), checks with this.

    :param name: The argument's name, used in the error message.
    :param op: The reduction to check.
    :param dtype: The dtype of the values to reduce: a ``torch.dtype``, or the name of a NumPy or
        JAX dtype (``"bfloat16"``, ``"int32"``: the names torch uses too).
    :param of: What holds the values, as the error message names it (``"`x`"``, ``"`data['a']`"``).
    :raises TypeError: If ``op`` is not a :class:`~gang.ReduceOperation`.
    :raises ValueError: If no gang can apply ``op`` to ``dtype``.
    """
    if not isinstance(op, ReduceOperation):
        raise TypeError(f"`{name}` must be a `ReduceOperation`, but is {op!r} instead.")
    kind = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(kind, torch.dtype):
        raise TypeError(f"`dtype` must be a `torch.dtype` or the name of one, but is {dtype!r} instead.")
    if op is ReduceOperation.MEAN and not (kind.is_floating_point or kind.is_complex):
        raise ValueError(
            f"`{name}` is `ReduceOperation.MEAN`, which needs floating-point values, "
            f"but {of} has dtype {dtype} instead."
        )
    if kind.is_complex and op not in _REDUCTIONS_OF_COMPLEX:
        raise ValueError(
            f"`{name}` must be `ReduceOperation.SUM` or `ReduceOperation.MEAN` for complex values, "
            f"but is `ReduceOperation.{op.name}` and {of} has dtype {dtype}."
        )
    return op


def check_timeout(timeout: object, *, default: timedelta, name: str = "timeout") -> timedelta:
    """Return ``timeout``, or ``default`` when it is ``None``; ``name`` names it in errors.

    :raises TypeError: If ``timeout`` is neither ``None`` nor a ``datetime.timedelta``.
    :raises ValueError: If ``timeout`` is not positive.
    """
    if timeout is None:
        return default
    if not isinstance(timeout, timedelta):
        raise TypeError(f"`{name}` must be a `datetime.timedelta`, but is {timeout!r} instead.")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"`{name}` must be positive, but is {timeout} instead.")
    return timeout


def check_device(name: str, device: object) -> torch.device:
    """Return ``device`` normalised: any CPU device (``cpu:0`` too) becomes ``cpu``, where CPU tensors live.

    :raises TypeError: If ``device`` is not a ``torch.device``.
    """
    if not isinstance(device, torch.device):
        raise TypeError(f"`{name}` must be a `torch.device`, but is {device!r} instead.")
    if device.type == "cpu" and device.index is not None:
        return torch.device("cpu")
    return device


def operation_error(operation: str, gang: GangView | tuple[int | None, int | None], cause: object) -> GangError:
    """Return the :class:`~gang.GangError` that reports that ``operation`` failed on ``gang``.

    The message is "```operation``` failed on rank *r* of a gang of size *n*: *cause*". Raise it
    with ``raise operation_error(...) from cause`` so the original error is chained.

    :param operation: The name of the operation (a method name such as ``"all_reduce"``).
    :param gang: The gang, or the ``(rank, size)`` of a gang that is still being created
        (``None`` where not known yet).
    :param cause: What went wrong: the backend's exception, or a description.
    """
    rank, size = gang if isinstance(gang, tuple) else (gang.rank, gang.size)
    return GangError(f"`{operation}` failed on rank {rank} of a gang of size {size}: {cause}")


@final
class guard:  # noqa: N801 (used as a function: `with guard(...)`)
    """A context that reports a backend failure inside it as the :class:`~gang.GangError` every gang raises.

    An exception of :data:`gang.errors.BACKEND_ERRORS` raised in the ``with`` block becomes
    :func:`operation_error(operation, gang, cause) <operation_error>`, chained to the original
    (``raise ... from``); other exceptions pass unchanged. This is the one failure path of every
    gang's communication::

        with guard("all_reduce", self):
            self._backend.all_reduce(tensor)

    :param operation: The name of the operation (a method name such as ``"all_reduce"``).
    :param gang: The gang, or the ``(rank, size)`` of a gang that is still being created.
    :param context: Words put before the cause in the message (``"<context>: <cause>"``), such as
        the address a rendezvous used; ``None``: the cause alone.
    """

    __slots__ = ("_context", "_gang", "_operation")

    def __init__(
        self, operation: str, gang: GangView | tuple[int | None, int | None], context: str | None = None
    ) -> None:
        self._operation = operation
        self._gang = gang
        self._context = context

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, ex: BaseException | None, traceback: TracebackType | None
    ) -> Literal[False]:
        if isinstance(ex, BACKEND_ERRORS):
            cause = ex if self._context is None else f"{self._context}: {ex}"
            raise operation_error(self._operation, self._gang, cause) from ex
        return False


def pickle_or_error(obj: object) -> tuple[bytes | None, str]:
    """Pickle ``obj``; return ``(payload, "")``, or ``(None, "TypeError: ...")`` if it cannot be pickled.

    Gangs pickle *before* any communication and tell their peers when it failed, so that every
    rank raises the same error instead of some of them waiting for data that never comes.
    """
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), ""
    except Exception as ex:
        return None, f"{type(ex).__name__}: {ex}"


def all_gather_bytes(
    gang: GangView, payload: bytes | None, *, gather: Callable[[Tensor, Tensor], None] | None = None
) -> list[bytes | None]:
    """Return every rank's ``payload``, in rank order: lengths first, then the padded bytes.

    A rank that passes ``None`` (it has nothing to send, for example because pickling failed) is
    ``None`` in the result on every rank; the bytes are then not exchanged at all (the other
    entries are empty), so every rank can raise the same error. Every member must call this.

    :param gang: The gang to exchange over.
    :param payload: This rank's bytes, or ``None``.
    :param gather: The all-gather to use (``output, input``); :meth:`gang.Gang.all_gather` by default.
    """
    if gather is None:
        gather = gang.all_gather
    device = gang.device
    length = torch.tensor([-1 if payload is None else len(payload)], dtype=torch.int64, device=device)
    lengths = torch.empty((gang.size, 1), dtype=torch.int64, device=device)
    gather(lengths, length)
    sizes = [int(n) for n in lengths.view(-1).tolist()]
    if min(sizes) < 0:
        return [None if n < 0 else b"" for n in sizes]
    width = max(sizes)
    if width == 0:
        return [b"" for _ in sizes]
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    if payload:
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    table = torch.empty((gang.size, width), dtype=torch.uint8, device=device)
    gather(table, padded)
    rows = table.cpu().numpy()
    return [rows[rank, :n].tobytes() for rank, n in enumerate(sizes)]
