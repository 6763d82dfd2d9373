"""Hooks on every gang operation and a flight recorder built on them; ``python -m gang.trace DIR`` reads its dumps.

Every gang (every kind, its sub-gangs, traffic operations and ``async_op`` handles included)
records its last operations in a ring (the flight recorder, on by default) and calls the hooks
added with :func:`add_hook` before each operation starts and when it ends. When an operation
raises :class:`~gang.GangError` (or a :class:`~gang.ft.ReplicaGang` records one), the process
writes its recorder to ``<dir>/gang_trace_rank_<global rank>`` in the format of torch's flight
recorder, so ``python -m torch.distributed.flight_recorder.fr_trace DIR -p gang_trace_rank_``
and ``python -m gang.trace DIR`` both read it. ``SIGUSR1`` (when nothing else handles it) and
:func:`dump` write it on request.

Environment: ``GANG_TRACE_DIR`` (where dumps go; default ``<temp dir>/gang_trace``),
``GANG_TRACE_BUFFER_SIZE`` (operations kept per gang, default 2000; ``0`` turns the recorder
off), ``GANG_TRACE_FRAMES`` (caller frames kept per operation, default 1), ``GANG_TRACE_RANK``
(this process's global rank in file names, when no root gang knows it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from gang.trace._recorder import (
    FILE_PREFIX,
    STATE,
    Hook,
    OpRecord,
    process_rank,
    trace_directory,
)
from gang.trace._recorder import dump as _dump

__all__ = [
    "FILE_PREFIX",
    "Hook",
    "OpRecord",
    "add_hook",
    "buffer_size",
    "dump",
    "process_rank",
    "set_buffer_size",
    "set_rank",
    "set_trace_dir",
    "trace_directory",
]


def add_hook(
    started: Callable[[OpRecord], object] | None = None, ended: Callable[[OpRecord], object] | None = None
) -> Hook:
    """Call ``started(record)`` before every operation of every gang of this process starts and ``ended(record)``
    once it ended; return a handle whose :meth:`Hook.remove` stops it.

    An ``async_op`` operation ends when its handle's ``wait()`` returns or raises. Hooks run on the
    thread that calls the operation, in the order they were added. They see the operation, never
    its tensors: they cannot change results. A hook that raises is logged (logger ``gang.trace``)
    and its exception propagates to the caller of the operation: from ``started``, the operation
    does not run on this rank (its peers then fail at the gang's timeout, and the dump shows
    why); from ``ended``, after the operation completed and its result is in place.

    :raises TypeError: If a hook is not callable, or neither is given.
    """
    for name, fn in (("started", started), ("ended", ended)):
        if fn is not None and not callable(fn):
            raise TypeError(f"`{name}` must be callable or `None`, but is {fn!r} instead.")
    if started is None and ended is None:
        raise TypeError("`add_hook` needs `started`, `ended` or both, but got neither.")
    hook = Hook(started, ended)
    with STATE.lock:
        STATE.hooks = (*STATE.hooks, hook)
        STATE.update()
    return hook


def set_buffer_size(size: int) -> None:
    """Keep the last ``size`` operations of each gang (``0`` turns the recorder off; default 2000, or
    ``GANG_TRACE_BUFFER_SIZE``). Applies to existing gangs at once.

    :raises TypeError: If ``size`` is not an ``int``.
    :raises ValueError: If ``size`` is negative.
    """
    from gang.trace._recorder import _TRACES

    if type(size) is not int:
        raise TypeError(f"`size` must be an `int`, but is {size!r} instead.")
    if size < 0:
        raise ValueError(f"`size` must be non-negative, but is {size} instead.")
    with STATE.lock:
        STATE.buffer_size = size
        STATE.update()
        for trace in list(_TRACES):
            trace.resize(size)


def buffer_size() -> int:
    """How many operations each gang keeps (``0``: the recorder is off)."""
    return STATE.buffer_size


def set_trace_dir(directory: str | os.PathLike[str] | None) -> None:
    """Write dumps into ``directory`` (``None``: back to ``GANG_TRACE_DIR``, else ``<temp dir>/gang_trace``).

    :raises TypeError: If ``directory`` is not a path.
    """
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"`directory` must be a path or `None`, but is {directory!r} instead.")
    STATE.directory = None if directory is None else os.fspath(directory)


def set_rank(rank: int | None) -> None:
    """Name this process's dump after global rank ``rank`` (``None``: as :func:`process_rank` finds it).

    :raises TypeError: If ``rank`` is not an ``int``.
    :raises ValueError: If ``rank`` is negative.
    """
    if rank is not None and type(rank) is not int:
        raise TypeError(f"`rank` must be an `int` or `None`, but is {rank!r} instead.")
    if rank is not None and rank < 0:
        raise ValueError(f"`rank` must be non-negative, but is {rank} instead.")
    STATE.rank = rank


def dump(reason: str = "on request", directory: str | os.PathLike[str] | None = None) -> Path:
    """Write this process's flight recorder now and return the file (``<dir>/gang_trace_rank_<global rank>``).

    :param reason: Recorded in the dump (``python -m gang.trace`` shows it).
    :param directory: Where to write (``None``: :func:`trace_directory`).
    """
    return _dump(reason, directory)
