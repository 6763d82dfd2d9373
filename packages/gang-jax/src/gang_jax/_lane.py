"""The one queue of a process's JAX gangs: the order their operations run in, their timeouts, their handles.

One :class:`Lane` serves every in-process :class:`~gang_jax.JaxGang` of a process (one JAX runtime:
the root, its sub-gangs, the gangs of :func:`~gang_jax.from_jax_mesh` and the calls of
:mod:`gang_jax.functional`), and one serves an isolated root and its sub-gangs (one child and its
socket). Every operation, blocking or not, runs on the lane's one worker thread in the order the
process posted it, as JAX's multi-process programs and the child's socket both require: no JAX
program of a gang starts while another is in flight. A blocking call waits in the caller's thread
for its own operation; one called with ``async_op=True`` returns a :class:`LaneWork` at once. The
JAX work releases the GIL, so the caller computes while an operation is in flight.

**Timeouts.** An operation that has run for longer than its gang's timeout (its peers did not
meet it) breaks the lane, as soon as a caller waits for it or for anything queued behind it (or
polls one of those handles): every waiter gets a :class:`~gang.GangError` naming its operation,
its gang and the operation that did not complete, and every later call on a gang of the lane
raises at once. The stuck program cannot be cancelled (XLA offers no way to): it stays on the
worker thread, a daemon thread, so it never keeps the process from exiting; it ends when its
peers do reach it, or when XLA itself gives up on them. An isolated lane also ends its child.

**Point-to-point.** ``send``, ``recv`` and ``send_recv`` calls are not run one by one: they wait in
a group (one per gang) until one of them is waited for or polled, a blocking one is made, or an
operation that is not point-to-point is posted; the group then runs as one ``send_recv``, whose
engine orders the transfers so that no two ranks wait for each other (as NCCL groups its
point-to-point work). So a ring shifted by separate ``send`` and ``recv`` handles completes in any
posting order. The transfers between two ranks must be posted in the same groups on both.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Callable
from functools import partial
from queue import SimpleQueue
from typing import Any, Generic, TypeVar

from torch import Tensor

from gang import GangError, Work
from gang.extend import GangView, operation_error

T = TypeVar("T")
_Pairs = list[tuple[Tensor, int]]
_POLL_S = 0.05
"""How often a waiter looks at the operation in flight while its own has not started yet."""
_RUNNING = threading.local()
"""The job a lane's worker thread is running (``job``), for :func:`restart_clock`."""


def restart_clock() -> None:
    """Start the timeout of the operation running in this thread now: what it did so far (compiling its
    program, which takes seconds on a loaded machine) does not count as waiting for its peers.

    Does nothing outside a lane's worker thread.
    """
    job = getattr(_RUNNING, "job", None)
    if job is not None:
        job.started = time.monotonic()


class _Done:
    """Whether a job has ended, as a ``threading.Event`` says it, on one lock (set once).

    The waiter blocks on the lock itself, which the worker releases when the job ends: one wake-up,
    where an ``Event`` takes a condition variable and a lock made per wait (microseconds a call).
    """

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._set = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        """Whether the job has ended."""
        return self._set

    def set(self) -> None:
        """Say that the job has ended (once) and wake its waiters."""
        self._set = True
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Wait until the job has ended, at most ``timeout`` seconds; return whether it has."""
        if self._set:
            return True
        if self._lock.acquire(timeout=max(timeout, 0.0)):
            self._lock.release()  # the next waiter, if any, passes too
            return True
        return self._set


class _Job(Generic[T]):
    """One operation on the lane: what it runs, for whom, and how it ended."""

    __slots__ = ("done", "error", "fn", "gang", "name", "result", "started", "timeout_s")

    def __init__(self, name: str, gang: GangView, fn: Callable[[], T], timeout_s: float) -> None:
        self.name = name
        self.gang = gang
        self.fn = fn
        self.timeout_s = timeout_s
        self.started: float | None = None
        self.done = _Done()
        self.result: T | None = None
        self.error: BaseException | None = None


class _Group:
    """The point-to-point calls of one gang posted since its last group ran."""

    __slots__ = ("gang", "job", "names", "recvs", "run", "sends", "timeout_s")

    def __init__(self, gang: GangView, run: Callable[[_Pairs, _Pairs, str], None], timeout_s: float) -> None:
        self.gang = gang
        self.run = run
        self.timeout_s = timeout_s
        self.sends: _Pairs = []
        self.recvs: _Pairs = []
        self.names: list[str] = []
        self.job: _Job[None] | None = None

    @property
    def name(self) -> str:
        """The operation as error messages name it: ``send``, or ``send, recv`` for a group of several."""
        return ", ".join(dict.fromkeys(self.names))


class LaneWork(Work):
    """The handle of an operation on a :class:`Lane`: its failure is the ``GangError`` it ended with."""

    def __init__(self, operation: str, lane: Lane, job: _Job[None] | None = None, group: _Group | None = None) -> None:
        super().__init__(operation)
        self._lane = lane
        self._job = job
        self._group = group

    def _started(self) -> _Job[None]:
        if self._job is None:
            assert self._group is not None
            if self._group.job is None:
                self._lane.flush()
            self._job = self._group.job
            assert self._job is not None
        return self._job

    def _wait(self, timeout: float | None) -> bool:
        return self._lane.wait(self._started(), timeout)

    def _poll(self) -> bool:
        job = self._started()
        try:
            self._lane.watch(job)
        except GangError:
            return True  # it failed: `wait()` raises the error
        return job.done.is_set()


class Lane:
    """Runs the operations of a process's JAX gangs one after the other on a worker thread (see the module).

    :param grace_s: Added to an operation's timeout before the lane gives up on it (an isolated
        engine's own wait then ends first, with its own message).
    :param on_break: Called once, with the reason, when an operation overruns its timeout (an
        isolated lane ends its child there).
    """

    def __init__(self, *, grace_s: float = 0.0, on_break: Callable[[str], None] | None = None) -> None:
        self._grace_s = grace_s
        self._on_break = on_break
        self._queue: SimpleQueue[_Job[Any] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._current: _Job[Any] | None = None
        self._groups: dict[int, _Group] = {}
        self._lock = threading.Lock()
        self.broken: str | None = None
        """Why the lane is broken (an operation overran its timeout); ``None`` while it works."""
        self.closed = False
        """Whether :meth:`close` was called."""
        self._then: Callable[[], object] | None = None
        self._finishing = False

    # -- posting ---------------------------------------------------------------------------------

    def check(self, name: str, gang: GangView) -> None:
        """Raise the ``GangError`` of ``name`` on ``gang`` at once if the lane is broken."""
        if self.broken is not None:
            raise operation_error(name, gang, f"the gang is broken: {self.broken}")

    def call(self, name: str, gang: GangView, fn: Callable[[], T], timeout_s: float) -> T:
        """Run ``fn`` after every operation posted before it; return its result here (or raise its error).

        :raises GangError: If the lane is broken, or breaks before ``fn`` is done.
        """
        job = self._post(name, gang, fn, timeout_s)
        self.wait(job, None)
        return job.result  # type: ignore[return-value]

    def start(self, name: str, gang: GangView, fn: Callable[[], None], timeout_s: float) -> LaneWork:
        """Post ``fn`` after every operation posted before it; return its handle at once."""
        return LaneWork(name, self, job=self._post(name, gang, fn, timeout_s))

    def post_p2p(
        self,
        key: int,
        gang: GangView,
        run: Callable[[_Pairs, _Pairs, str], None],
        sends: _Pairs,
        recvs: _Pairs,
        name: str,
        timeout_s: float,
        *,
        async_op: bool,
    ) -> LaneWork | None:
        """Add point-to-point transfers to the group of the gang ``key``; ``run(sends, recvs, name)`` runs a group.

        Returns the handle (``async_op``), or runs the group now and returns ``None``.
        """
        self.check(name, gang)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = _Group(gang, run, timeout_s)
            group.sends += sends
            group.recvs += recvs
            group.names.append(name)
        work = LaneWork(name, self, group=group)
        if async_op:
            return work
        work.wait()
        return None

    def flush(self) -> None:
        """Run the pending point-to-point groups (one ``send_recv`` per gang, in the order they were first posted)."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            run = partial(group.run, group.sends, group.recvs, group.name)
            group.job = self._submit(group.name, group.gang, run, group.timeout_s)

    def _post(self, name: str, gang: GangView, fn: Callable[[], T], timeout_s: float) -> _Job[T]:
        self.check(name, gang)
        if self._groups:
            self.flush()
        return self._submit(name, gang, fn, timeout_s)

    def _submit(self, name: str, gang: GangView, fn: Callable[[], T], timeout_s: float) -> _Job[T]:
        job = _Job(name, gang, fn, timeout_s)
        if self.broken is not None or self.closed:
            why = f"the gang is broken: {self.broken}" if self.broken else "the root gang of its JAX runtime was closed"
            job.error = operation_error(name, gang, why)
            job.done.set()
            return job
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="gang-jax-lane", daemon=True)
            self._thread.start()
        self._queue.put(job)
        return job

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                with self._lock:
                    then, self._then = self._then, None
                    self._finishing = then is not None
                if then is not None:
                    with contextlib.suppress(Exception):  # nobody is left to tell
                        then()
                self._finishing = False
                return
            if self.broken is not None:
                job.error = operation_error(job.name, job.gang, f"the gang is broken: {self.broken}")
                job.done.set()
                continue
            job.started = time.monotonic()
            self._current = _RUNNING.job = job
            try:
                job.result = job.fn()
            except BaseException as ex:  # handed to the waiter, which raises it
                job.error = ex
            finally:
                self._current = _RUNNING.job = None
                job.done.set()

    # -- waiting ---------------------------------------------------------------------------------

    def wait(self, job: _Job[Any], timeout: float | None) -> bool:
        """Wait for ``job``, at most ``timeout`` seconds (``None``: until it ends or the lane breaks).

        :returns: Whether it completed (``False``: ``timeout`` passed first).
        :raises GangError: If the job failed, or the lane broke first (an operation overran its timeout).
        """
        until = None if timeout is None else time.monotonic() + timeout
        while not job.done.is_set():
            step = self.watch(job)
            now = time.monotonic()
            if until is not None:
                if now >= until:
                    return False
                step = min(step, until - now)
            job.done.wait(step)
        if job.error is not None:
            raise job.error
        return True

    def watch(self, job: _Job[Any]) -> float:
        """Break the lane if the operation in flight overran its timeout while ``job`` waits behind or on it.

        :returns: How long a waiter may sleep before it looks again.
        :raises GangError: If the lane is broken and ``job`` is not done.
        """
        if job.done.is_set():
            return 0.0
        current = self._current
        if self.broken is None and current is not None and current.started is not None and not current.done.is_set():
            left = current.started + current.timeout_s + self._grace_s - time.monotonic()
            if left > 0:
                return left
            self._break(current)
        if self.broken is not None and not job.done.is_set():
            if job is current or current is None:
                raise operation_error(job.name, job.gang, self.broken)
            raise operation_error(job.name, job.gang, f"the gang is broken: {self.broken}")
        return _POLL_S

    def _break(self, stuck: _Job[Any]) -> None:
        with self._lock:
            if self.broken is not None:
                return
            self.broken = (
                f"`{stuck.name}` did not complete within the gang's timeout of {stuck.timeout_s:g} s (its peers did "
                "not meet it); every later call on this gang and the gangs it shares its JAX runtime with fails "
                "at once"
            )
        if self._on_break is not None:
            self._on_break(self.broken)

    # -- closing ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether an operation is on the worker thread now (one that overran its timeout may stay there)."""
        current = self._current
        return current is not None and not current.done.is_set()

    def close(self, then: Callable[[], object] | None = None) -> None:
        """Stop the worker thread once the operations posted so far are done; it does not wait for a stuck one.

        :param then: Run by the worker thread last, once a program stuck on it has ended (it never
            runs if that program never ends); here at once if no worker thread was started.
        """
        if self.closed:
            return
        if self._groups:
            self.flush()
        self.closed = True
        if self._thread is None:
            if then is not None:
                then()
            return
        self._then = then
        self._queue.put(None)

    def at_exit(self) -> None:
        """Forget the last step of :meth:`close` if it has not started (the process is exiting, and the
        thread must not shut the runtime down while the interpreter is torn down: the runtime's own
        teardown at exit does it); wait for it if it has."""
        with self._lock:
            self._then = None
            thread = self._thread if self._finishing else None
        if thread is not None:
            thread.join()


_LOCAL: Lane | None = None


@atexit.register
def _at_exit() -> None:
    if _LOCAL is not None:
        _LOCAL.at_exit()


def local_lane() -> Lane:
    """The lane of this process's JAX runtime (a new one once the last was closed)."""
    global _LOCAL
    if _LOCAL is None or _LOCAL.closed:
        _LOCAL = Lane()
    return _LOCAL
