"""Who can reach whom: the network probes behind the partition rule of :mod:`gang.ft`.

Before a process builds the process group of a new quorum, it connects to the death signal
(:mod:`gang.ft.liveness`) of the process of equal replica rank of every other member, all at
once, for a bounded time (:func:`probe`). A member it cannot reach is *reported*: the process's
heartbeat carries it (:attr:`gang.ft.policy.Beat.unreachable`), the step is aborted without
waiting for the group, and the next round's leader applies the partition rule
(:meth:`gang.ft.policy.Policy.connected`). The heartbeat thread keeps probing every replica it
reported (:class:`Reports`) and drops a report once a connection is made (or refused: the host
answered), so a replica kept apart is taken in again once its link is back.

Internal to :mod:`gang.ft` (its names may change); not part of the public API.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Mapping
from contextlib import suppress

_ANSWERED = (0, errno.EISCONN, errno.ECONNREFUSED)  # the host answered: it is reachable
_PENDING = (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK)
RETRY = 1.0
"""Seconds a probe of a reported replica may stay unanswered before it is started anew (a
connection attempt whose packets were dropped is retried by the kernel only after seconds)."""


def _start(address: str) -> tuple[socket.socket | None, bool | None]:
    """Start connecting to ``address`` (``"host:port"``): the socket while the attempt is in
    progress, and whether it was answered already (``None`` while in progress)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        code = sock.connect_ex((host, int(port)))
    except (OSError, ValueError):
        code = -1
    if code in _PENDING:
        return sock, None
    sock.close()
    return None, code in _ANSWERED


def _answered(sock: socket.socket, address: str) -> bool | None:
    """Whether the connection of ``sock`` to ``address`` was answered; ``None`` while in progress."""
    host, _, port = address.rpartition(":")
    try:
        code = sock.connect_ex((host.strip("[]"), int(port)))
    except OSError as ex:
        code = ex.errno or -1
    if code in _PENDING:
        return None
    return code in _ANSWERED


def probe(addresses: Mapping[str, str], seconds: float) -> set[str]:
    """The keys of ``addresses`` (each ``"host:port"`` of a death signal) that cannot be connected
    to within ``seconds``; every connection is attempted at once and closed when answered. A
    refused connection counts as reached (the host answered; whether the process lives is the
    heartbeat's to tell)."""
    pending: dict[str, socket.socket] = {}
    failed: set[str] = set()
    for key, address in addresses.items():
        sock, answer = _start(address)
        if sock is not None:
            pending[key] = sock
        elif not answer:
            failed.add(key)
    deadline = time.monotonic() + seconds
    pause = 0.0001
    try:
        while pending:
            for key, sock in list(pending.items()):
                answer = _answered(sock, addresses[key])
                if answer is not None:
                    sock.close()
                    del pending[key]
                    if not answer:
                        failed.add(key)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return failed | set(pending)
    finally:
        for sock in pending.values():
            sock.close()


class Reports:
    """The replicas this process reported unreachable, probed again until they answer.

    The training thread :meth:`add` s the replicas its :func:`probe` could not reach; the
    heartbeat thread writes :meth:`current` with every heartbeat and calls :meth:`poll` after
    each, which drops a replica once a connection to it is answered.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._addresses: dict[str, str] = {}
        self._probes: dict[str, tuple[socket.socket, float]] = {}
        self._written = threading.Condition(self._lock)
        self._beats = 0

    def add(self, unreachable: Mapping[str, str]) -> None:
        """Report the replicas of ``unreachable`` (replica id -> ``"host:port"`` probed)."""
        with self._lock:
            self._addresses.update(unreachable)

    def current(self) -> frozenset[str]:
        """The replicas reported now."""
        with self._lock:
            return frozenset(self._addresses)

    def wrote(self) -> None:
        """Called by the heartbeat thread after each heartbeat it wrote (with :meth:`current`)."""
        with self._lock:
            self._beats += 1
            self._written.notify_all()

    def wait_written(self, seconds: float) -> bool:
        """Wait until two heartbeats were written after this call (the second one read the reports
        added before it), at most ``seconds``; whether they were."""
        with self._lock:
            target = self._beats + 2
            return self._written.wait_for(lambda: self._beats >= target, seconds)

    def poll(self) -> None:
        """Probe every reported replica again; drop those whose connection was answered."""
        now = time.monotonic()
        with self._lock:
            addresses = dict(self._addresses)
        for rid, address in addresses.items():
            started = self._probes.get(rid)
            if started is not None:
                running, when = started
                answer = _answered(running, address)
                if answer is None and now - when < RETRY:
                    continue
                running.close()
                del self._probes[rid]
                if answer:
                    with self._lock:
                        if self._addresses.get(rid) == address:
                            del self._addresses[rid]
                    continue
            sock, answer = _start(address)
            if sock is not None:
                self._probes[rid] = (sock, now)
            elif answer:
                with self._lock:
                    if self._addresses.get(rid) == address:
                        del self._addresses[rid]
        for rid in set(self._probes) - set(addresses):
            with suppress(OSError):
                self._probes.pop(rid)[0].close()

    def close(self) -> None:
        """Close the probes in progress."""
        for sock, _ in self._probes.values():
            with suppress(OSError):
                sock.close()
        self._probes.clear()


__all__ = ["RETRY", "Reports", "probe"]
