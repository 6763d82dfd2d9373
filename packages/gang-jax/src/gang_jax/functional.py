"""JAX-native collectives on a :class:`~gang_jax.JaxGang`: ``jax.Array`` in, ``jax.Array`` out.

Each process passes its own (process-local) array and gets back its own result, on the JAX
device it contributes to the gang (:attr:`JaxGang.jax_device`). The calls run in the gang's one
queue, after its operations in flight (those started with ``async_op=True`` included), honour
its timeout and are checked by debug mode, as the gang's own methods are. The semantics and reductions
are those of the matching :class:`gang.Gang` methods; 64-bit inputs keep their dtype even
when ``jax_enable_x64`` is off (JAX then only refuses to *create* 64-bit arrays).

.. code-block:: python

    # On every process of a gang of 4:
    y = all_reduce(gang, jnp.ones(3), ReduceOperation.SUM)  # Array([4., 4., 4.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gang import Gang, NotSupportedError, ReduceOperation
from gang.extend import check_op, check_open, check_rank
from gang_jax._collectives import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, REDUCE_SCATTER
from gang_jax.gang import JaxGang

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter"]


def _check(gang: object, x: object, operation: str) -> JaxGang:
    if not isinstance(gang, JaxGang):
        raise TypeError(f"`gang` must be a `JaxGang`, but is of type `{type(gang).__name__}` instead.")
    check_open(gang, operation)
    if gang.isolated:
        raise NotSupportedError(
            "`gang` must run JAX in this process for `gang_jax.functional`, but it is isolated "
            "(`create_default(isolated=True)`); use its torch collectives instead."
        )
    if not isinstance(x, jax.Array):
        raise TypeError(f"`x` must be a `jax.Array`, but is of type `{type(x).__name__}` instead.")
    if not x.is_fully_addressable:
        raise ValueError("`x` must be a process-local array (fully addressable), but spans several processes.")
    return gang


def _check_rows(gang: JaxGang, x: jax.Array) -> None:
    if x.ndim == 0 or x.shape[0] != gang.size:
        raise ValueError(
            f"`x` must have shape [{gang.size}, ...] (the gang size first), but has shape {list(x.shape)} instead."
        )


_NAMES: dict[Any, str] = {}
"""The name of each dtype met (``np.dtype.name`` takes microseconds, a call's budget)."""


def _name(x: jax.Array) -> str:
    name = _NAMES.get(x.dtype)
    if name is None:
        name = _NAMES[x.dtype] = np.dtype(x.dtype).name
    return name


_ACCEPTED: set[tuple[ReduceOperation, Any]] = set()
"""The (reduction, dtype) pairs :func:`gang.extend.check_op` accepted."""


def _check_op(op: object, x: jax.Array) -> ReduceOperation:
    if isinstance(op, ReduceOperation) and (op, x.dtype) in _ACCEPTED:
        return op
    checked = check_op("op", op, _name(x), of="`x`")
    _ACCEPTED.add((checked, x.dtype))
    return checked


def _run(
    gang: JaxGang, operation: str, x: jax.Array, fn: Any, *args: Any, detail: Callable[[], str] | None = None, **kw: Any
) -> jax.Array:
    """Run ``fn(*args, **kw)`` in the queue, after the operations in flight (debug mode checks the call first).

    :param detail: Returns the arguments after ``x`` as debug mode shows them, such as ``", op=SUM"``.
    """

    def call() -> str:
        return f"functional.{operation}({_name(x)}{list(x.shape)}{'' if detail is None else detail()})"

    def run() -> jax.Array:
        out: jax.Array = fn(*args, **kw)
        return out.block_until_ready()  # done on the queue, so that the gang's timeout bounds it

    return gang._run_jax(operation, call, run)


def _to_bits(x: jax.Array) -> jax.Array:
    """View ``x`` as unsigned integers of the same width (complex numbers as pairs of floats)."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(np.uint8)
    if dtype.kind == "c":
        parts = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
        return jax.lax.bitcast_convert_type(parts, np.dtype(f"uint{4 * dtype.itemsize}"))
    return jax.lax.bitcast_convert_type(x, np.dtype(f"uint{8 * dtype.itemsize}"))


def _from_bits(bits: jax.Array, dtype: np.dtype[Any]) -> jax.Array:
    """Undo :func:`_to_bits`."""
    if dtype == np.bool_:
        return bits.astype(np.bool_)
    if dtype.kind == "c":
        parts = jax.lax.bitcast_convert_type(bits, np.dtype(f"float{4 * dtype.itemsize}"))
        return jax.lax.complex(parts[..., 0], parts[..., 1]).astype(dtype)
    return jax.lax.bitcast_convert_type(bits, dtype)


def all_reduce(gang: Gang, x: jax.Array, op: ReduceOperation) -> jax.Array:
    """Reduce ``x`` over every process of ``gang`` and return the result.

    :param gang: A :class:`~gang_jax.JaxGang`; every member calls this.
    :param x: This process's array; every member passes the same shape and dtype.
    :param op: The reduction. ``MEAN`` needs a floating-point array.
    :returns: The reduction, shaped like ``x``.
    :raises TypeError: If ``gang`` is not a ``JaxGang``, ``x`` not a ``jax.Array`` or ``op`` not a
        :class:`~gang.ReduceOperation`.
    :raises ValueError: If ``op`` is ``MEAN`` and ``x`` is not floating point.
    :raises GangError: If the collective fails.
    """
    g = _check(gang, x, "all_reduce")
    checked = _check_op(op, x)
    return _run(
        g, "all_reduce", x, g.communicator.call, ALL_REDUCE, x, (checked,), detail=lambda: f", op={checked.name}"
    )


def all_gather(gang: Gang, x: jax.Array) -> jax.Array:
    """Gather ``x`` of every process of ``gang``.

    :param gang: A :class:`~gang_jax.JaxGang`; every member calls this.
    :param x: This process's contribution; every member passes the same shape and dtype.
    :returns: An array of shape ``[gang.size, *x.shape]`` whose row ``i`` is rank ``i``'s ``x``.
    :raises TypeError: If ``gang`` is not a ``JaxGang`` or ``x`` not a ``jax.Array``.
    :raises GangError: If the collective fails.
    """
    g = _check(gang, x, "all_gather")
    return _run(g, "all_gather", x, g.communicator.call, ALL_GATHER, x)


def reduce_scatter(gang: Gang, x: jax.Array, op: ReduceOperation) -> jax.Array:
    """Reduce row ``i`` of every process's ``x`` and return it on rank ``i``.

    :param gang: A :class:`~gang_jax.JaxGang`; every member calls this.
    :param x: Of shape ``[gang.size, ...]``.
    :param op: The reduction. ``MEAN`` needs a floating-point array.
    :returns: An array of shape ``x.shape[1:]``.
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If ``x`` is not ``[gang.size, ...]``, or ``op`` is ``MEAN`` on integers.
    :raises GangError: If the collective fails.
    """
    g = _check(gang, x, "reduce_scatter")
    _check_rows(g, x)
    checked = _check_op(op, x)
    detail = lambda: f", op={checked.name}"  # noqa: E731
    return _run(g, "reduce_scatter", x, g.communicator.call, REDUCE_SCATTER, x, (checked,), detail=detail)


def all_to_all(gang: Gang, x: jax.Array) -> jax.Array:
    """Send row ``j`` of ``x`` to rank ``j``; row ``i`` of the result comes from rank ``i``.

    :param gang: A :class:`~gang_jax.JaxGang`; every member calls this.
    :param x: Of shape ``[gang.size, ...]``.
    :returns: An array shaped like ``x``.
    :raises TypeError: If ``gang`` is not a ``JaxGang`` or ``x`` not a ``jax.Array``.
    :raises ValueError: If ``x`` is not ``[gang.size, ...]``.
    :raises GangError: If the collective fails.
    """
    g = _check(gang, x, "all_to_all")
    _check_rows(g, x)
    return _run(g, "all_to_all", x, g.communicator.call, ALL_TO_ALL, x)


def broadcast(gang: Gang, x: jax.Array, source_rank: int = 0) -> jax.Array:
    """Return ``source_rank``'s ``x`` on every process (bit for bit).

    :param gang: A :class:`~gang_jax.JaxGang`; every member calls this.
    :param x: Sent on the source; elsewhere only its shape and dtype matter.
    :param source_rank: A rank of ``gang`` (not a global rank).
    :returns: The source's array.
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If ``source_rank`` is outside ``[0, gang.size)``.
    :raises GangError: If the collective fails.
    """
    g = _check(gang, x, "broadcast")
    source_rank = check_rank("source_rank", source_rank, g.size)

    detail = lambda: f", source_rank={source_rank}"  # noqa: E731
    return _run(
        g,
        "broadcast",
        x,
        g.communicator.call,
        BROADCAST,
        x,
        (source_rank,),
        pre=_to_bits,
        post=_from_bits,
        detail=detail,
    )
