"""The order in which a process runs its JAX gangs' operations, and the handles of those in flight.

One :class:`Lane` serves a root :class:`~gang_jax.JaxGang` and all its sub-gangs (one JAX runtime,
or one isolated child and its socket). An operation called with ``async_op=True`` runs on the
lane's one background thread and returns a :class:`LaneWork`; every later operation of any gang
of the lane runs after it (a blocking one waits in the caller's thread for its turn), so each
process posts its operations in the order its program called them, as JAX's multi-process
programs and the child's socket both require. While nothing is in flight an operation runs in the
caller's thread directly, as it did before handles existed. The JAX work itself releases the GIL,
so the caller computes while an operation is in flight.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from gang import Work

T = TypeVar("T")


class LaneWork(Work):
    """The handle of an operation running on a :class:`Lane` (its failure is the ``GangError`` it raised)."""

    def __init__(self, operation: str, future: Future[None]) -> None:
        super().__init__(operation)
        self._future = future

    def _wait(self, timeout: float | None) -> bool:
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def _poll(self) -> bool:
        return self._future.done()


class Lane:
    """Runs operations one after the other: in the caller's thread, or on a background thread when asked."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future[None] | None = None

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` after every operation in flight; return its result (or raise its exception) here."""
        if self.idle():
            return fn()
        assert self._executor is not None
        return self._executor.submit(fn).result()

    def idle(self) -> bool:
        """Whether nothing is in flight, so that an operation may run in the caller's thread right away.

        Only the caller's thread starts operations, so once it sees the last one finished it
        forgets it, and the next calls answer from one attribute.
        """
        last = self._last
        if last is None:
            return True
        if last.done() or self._executor is None:
            self._last = None
            return True
        return False

    def start(self, operation: str, fn: Callable[[], None]) -> LaneWork:
        """Start ``fn`` after every operation in flight, on the background thread; return its handle."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="gang-jax")
        self._last = self._executor.submit(fn)
        return LaneWork(operation, self._last)

    def close(self) -> None:
        """Wait for the operations in flight (an isolated one fails within the timeout), then stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._last = None
