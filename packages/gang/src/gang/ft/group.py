"""The cross-replica process group of a :mod:`gang.ft` step: waiting on its collectives while
watching the peers, and dropping it off the training thread.

Internal to :mod:`gang.ft` (its names may change); not part of the public API.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch

from gang._torch_groups import StandaloneGroup


class Reaper:
    """Destroys dropped process groups off the training thread (gloo's destructor waits ~1-2 s).

    The thread is not a daemon: the interpreter waits for it at exit instead of tearing a group
    down half-destroyed (which aborts the process).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[StandaloneGroup] = []
        self._thread: threading.Thread | None = None

    def drop(self, pg: StandaloneGroup) -> None:
        """Abort ``pg`` and destroy it on the reaper's thread.

        Aborting ends a stuck NCCL collective; torch's gloo group does nothing on ``abort()``
        (nor ``shutdown()``), so destroying one whose collective is still waiting waits until a
        peer it waits on closes its connections (or the collective's timeout).
        """
        with suppress(RuntimeError):
            pg.abort()
        with self._lock:
            self._pending.append(pg)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gang.ft reaper", daemon=False)
                self._thread.start()

    def wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every dropped group to be destroyed."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(seconds)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                pg = self._pending.pop()
            del pg


reaper = Reaper()
"""The one reaper of this process."""


class _Build:
    """One process group being built on a thread of its own (see :func:`build_within`)."""

    def __init__(self, make: Callable[[], StandaloneGroup]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.group: StandaloneGroup | None = None
        self.error: BaseException | None = None
        self._abandoned = False
        threading.Thread(target=self._run, name="gang.ft group build", daemon=False).start()

    def _run(self) -> None:
        try:
            group = self._make()
        except BaseException as ex:  # handed to the caller (or dropped with the abandoned build)
            forget_frames(ex)
            self.error = ex
            self.done.set()
            return
        with self._lock:
            if self._abandoned:
                reaper.drop(group)
            else:
                self.group = group
        self.done.set()

    def abandon(self) -> None:
        """Give the build up: a group it makes later is dropped at once."""
        with self._lock:
            self._abandoned = True
            group, self.group = self.group, None
        if group is not None:
            reaper.drop(group)


def build_within(
    make: Callable[[], StandaloneGroup], timeout: float, interval: float, watch: Callable[[], None]
) -> StandaloneGroup:
    """Build a process group with ``make`` on a thread of its own, waiting at most ``timeout``
    seconds and calling ``watch`` (which raises to stop waiting) every ``interval`` seconds.

    torch's gloo group connects to every peer in its constructor and waits there, uninterruptibly,
    for a peer that does not answer: about five times its timeout was seen over a cut link (gloo
    retries a connection attempt that the kernel failed). A build given up is abandoned to its thread, which
    ends when torch gives up or succeeds (a group made then is dropped); the thread is not a
    daemon (see :class:`Reaper`), so a process exiting meanwhile waits for it.

    :raises RuntimeError: If the group was not built within ``timeout`` seconds.
    """
    build = _Build(make)
    try:
        if not wait_until(build.done.is_set, timeout, interval, watch):
            raise RuntimeError(f"the process group was not built within the timeout of {timeout:g} s")
    except BaseException:
        build.abandon()
        raise
    if build.error is not None:
        raise build.error
    assert build.group is not None
    return build.group


def settle(work: Any, device: torch.device, timeout: float, interval: float, watch: Callable[[], None] | None) -> None:
    """Wait until ``work`` finished, on the device too, calling ``watch`` every ``interval`` seconds meanwhile.

    ``work`` must be a collective's: the short waits use ``Work.wait(timeout)``, which for gloo's
    point-to-point works closes the connection when the time is up (give those ``watch=None``,
    which waits for them whole). ``watch`` raises to stop waiting (the caller then drops the
    group; a gloo collective left behind ends at its own timeout, in the background: a blocking
    one of :class:`~gang.ft.ReplicaGang` is given what is left of the step attempt's budget).
    ``Work.wait()`` returns when a CPU (gloo) collective finished; for a CUDA (NCCL) one it only
    makes the current stream wait for it. There, an event recorded on the current stream after
    ``wait()`` completes once the collective ran on the device; it is polled up to ``timeout``
    seconds, and a collective still running then raises (the caller drops the group, whose
    ``abort()`` ends the stuck non-blocking NCCL communicator). This is the one place the CUDA
    path differs.
    """
    if device.type != "cuda":
        if watch is None:
            work.wait()
            return
        while not wait_briefly(work, interval):
            watch()
        return
    work.wait()
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(torch.cuda.current_stream(device))
    if not wait_until(done.query, timeout, interval, watch):
        raise RuntimeError(f"the collective did not finish on {device} within the timeout of {timeout:g} s")


def forget_frames(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and of every exception it was raised from or while handling.

    A traceback's frames keep their locals alive: a failed collective's ``Work`` among them holds
    the group's gloo context, whose connections then stay open after the group is dropped. A peer
    waiting on one of them in the abandoned collective would wait for the whole ``timeout``, and
    so would that peer's own dropped group and its ``close()``. Errors chain implicitly: an error
    raised inside an ``except`` block keeps the handled one as ``__context__`` (see :func:`wait_briefly`).
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        ex = stack.pop()
        if ex is None or id(ex) in seen:
            continue
        seen.add(id(ex))
        ex.__traceback__ = None
        stack += [ex.__cause__, ex.__context__]


def wait_briefly(work: Any, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``work``; return whether it finished (raising its error if it failed).

    ``Work.wait(timeout)`` raises both when the time is up (the work goes on) and when the work
    failed; only a finished work has failed.
    """
    try:
        work.wait(timedelta(seconds=seconds))
    except RuntimeError:
        if not work.is_completed():
            return False
        work.wait()  # raises the collective's own error
    return True


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    interval: float = float("inf"),
    watch: Callable[[], None] | None = None,
) -> bool:
    """Poll ``condition`` (sleeping 0.1 ms doubling up to 10 ms) until it holds or ``timeout`` seconds
    passed, calling ``watch`` (which may raise) every ``interval`` seconds meanwhile."""
    deadline = checked = time.monotonic()
    deadline += timeout
    pause = 0.0001
    while not condition():
        now = time.monotonic()
        if now >= deadline:
            return condition()
        if watch is not None and now - checked >= interval:
            checked = now
            watch()
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    return True


__all__ = [
    "Reaper",
    "build_within",
    "forget_frames",
    "reaper",
    "settle",
    "wait_briefly",
    "wait_until",
]
