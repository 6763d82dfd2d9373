"""The handle of an operation started with ``async_op=True``: :class:`Work`.

A gang's public methods return a :class:`Work` when called with ``async_op=True``. The handle
keeps its own state (done, or the error it ended with) rather than passing the backend's
through: torch 2.13's gloo ``reduce_scatter_tensor`` reports ``is_completed() == False`` even
after ``wait()`` returned, and a JAX program has no handle at all.

A kind of gang that starts operations in the background subclasses :class:`Work` and implements
``_wait`` and ``_poll``; one whose operation already ran returns ``None`` from its protected
method and the gang hands the caller a :class:`CompletedWork`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from abc import ABC, abstractmethod
from typing import final

from gang.errors import GangError

__all__ = ["CompletedWork", "Work", "check_wait_timeout"]


def check_wait_timeout(timeout: object) -> float | None:
    """Return ``timeout`` (seconds) as a ``float`` if it is ``None`` or a positive, finite real number.

    :raises TypeError: If ``timeout`` is not a real number (a ``bool`` neither) nor ``None``.
    :raises ValueError: If ``timeout`` is not positive and finite.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"`timeout` must be a number of seconds or `None`, but is {timeout!r} of type "
            f"`{type(timeout).__name__}` instead."
        )
    seconds = float(timeout)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"`timeout` must be a positive, finite number of seconds, but is {timeout!r} instead.")
    return seconds


class Work(ABC):
    """The handle of an operation in flight (a gang method called with ``async_op=True``).

    The tensors of the operation must not be read or written until :meth:`wait` returned. A
    failure of the operation (a dead peer, the gang's timeout) is raised by :meth:`wait` as
    :class:`~gang.GangError`, again at every later call (a :class:`~gang.ft.ReplicaGang` records it
    instead, as it records a blocking collective's failure, and the step is not committed).

    :param operation: The name of the gang method that started the operation (``"send"``), used
        in error messages.
    """

    __slots__ = ("_done", "_error", "_operation")

    def __init__(self, operation: str) -> None:
        self._operation = operation
        self._done = False
        self._error: GangError | None = None

    @property
    def operation(self) -> str:
        """The name of the gang method that started the operation."""
        return self._operation

    @final
    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation is complete and its output tensors hold the result.

        On a CUDA gang, as with torch's own handles, ``wait()`` makes the current CUDA stream wait
        for the operation: what is queued on that stream afterwards sees the result, and the host
        does not block. The handle then counts as completed (:meth:`is_completed` is ``True``);
        poll :meth:`is_completed` *before* waiting to learn whether the device finished. (Not yet
        run on a GPU.)

        :param timeout: At most this many seconds for this wait (``None``: up to the gang's own
            timeout, after which the operation fails). When the time is up the operation is not
            complete, and its tensors must still be left alone: call ``wait()`` again, or let the
            gang's own timeout end it.
        :raises GangError: If the operation failed, or ``timeout`` passed first (the message names
            the operation).
        :raises TypeError: If ``timeout`` is not a number.
        :raises ValueError: If ``timeout`` is not positive and finite.
        """
        seconds = None if timeout is None else check_wait_timeout(timeout)
        if self._done:
            if self._error is not None:
                raise self._error
            return
        try:
            finished = self._wait(seconds)
        except GangError as ex:
            self._done, self._error = True, ex
            raise
        if not finished:
            raise GangError(
                f"`{self._operation}` did not complete within the `wait` timeout of {seconds:g} s "
                "(it is still in flight: leave its tensors alone and wait again)."
            )
        self._done = True

    @final
    def is_completed(self) -> bool:
        """Whether the operation finished (successfully or not: :meth:`wait` then returns or raises at once)."""
        if not self._done and self._poll():
            self._settle()
        return self._done

    def _settle(self) -> None:
        """Finish a work that :meth:`_poll` found complete, recording its error."""
        with contextlib.suppress(GangError):
            self.wait()

    @abstractmethod
    def _wait(self, timeout: float | None) -> bool:
        """Wait for the operation, at most ``timeout`` seconds (``None``: until it ends).

        :returns: Whether it completed (``False``: the time was up first).
        :raises GangError: If the operation failed.
        """

    @abstractmethod
    def _poll(self) -> bool:
        """Whether the operation finished, without blocking (``True`` also when it failed)."""

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "completed" if self._done else "pending"
        return f"{type(self).__name__}({self._operation!r}, {state})"


@final
class CompletedWork(Work):
    """The handle of an operation that already completed when the gang method returned it."""

    __slots__ = ()

    def __init__(self, operation: str) -> None:
        super().__init__(operation)
        self._done = True

    def _wait(self, timeout: float | None) -> bool:
        return True

    def _poll(self) -> bool:
        return True


def _block(work: Work | None) -> None:
    """Wait for what a protected method returned with ``async_op=False`` (a kind may return a work anyway)."""
    if work is not None:
        work.wait()
