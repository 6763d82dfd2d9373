"""A death signal faster than a heartbeat: a TCP connection that closes when its process dies.

Every :mod:`gang.ft` process listens on a TCP port of the address it reaches the store from
(published with its identity, see :mod:`gang.ft.quorum`). During a quorum, the process that watches
it (:func:`gang.ft.policy.watched`) connects and holds the connection open; the watched process
sends its incarnation's token once, and nothing else is ever sent. When the watched process exits
in any way (``SIGKILL``, a crash, an out-of-memory kill), its kernel closes the connection, and
the watcher reads the end of it at its next heartbeat (within 0.1 s) instead of waiting
``heartbeat_timeout`` for the heartbeat to go silent.

What it does not see is left to the heartbeat: a stopped (``SIGSTOP``) or hung process keeps its
connections open, and a lost host closes nothing. Only a connection that greeted the watcher with
the token it expects counts; one that cannot be made (a firewall, a process that died before it
was watched) or that reached anything else is not a death. When such a connection ends, the
watcher connects again to confirm: only a refused connection (nobody listens there any more) is a
death; a new greeting means the end came from the network (a reset idle connection), and the
watch goes on over the new connection. Children forked by the process with ``os.fork``
(data-loader workers) close their copies of these sockets at once (``os.register_at_fork``), so
such a child does not hold a dead parent's connection open.

Used by the heartbeat thread only (its owner closes it once that thread stopped). Internal to
:mod:`gang.ft` (its names may change); not part of the public API.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import weakref
from contextlib import suppress

from gang.address import local_address

_CONNECTED = (0, errno.EISCONN)
_PENDING = (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK)
_KEEPALIVE_IDLE = 60  # seconds an idle watch connection waits before TCP keepalive probes start
_LOCK = threading.Lock()  # held while sockets are made or closed, and across a fork (see the end)

_connect_wait: float | None = None
"""A test-only seam (``tests/ft/test_liveness.py`` sets it): seconds :meth:`Liveness._connect`
waits for the kernel's answer to a connect, instead of returning while it is in progress.

A non-blocking connect to a port nobody listens on is answered ``ECONNREFUSED`` by the call itself
where the kernel handled the peer's reset before the call returned (a kernel that hands loopback
packets on within the sending call can, as BSD-derived ones do), and ``EINPROGRESS``, the refusal
coming at the next ``connect_ex``, where it handles it later (Linux on loopback, as measured here,
and any kernel over a real network). The seam makes the first answer happen on Linux, through a
real refused connection."""


class Liveness:
    """This process's listening socket, and the connection to the one process it watches.

    A process greets every watcher with its incarnation's token as it accepts the connection; a
    watcher counts the connection only once it read the token it expects, so a connection that
    reached something else (an address not reachable as published, a port reused by another
    program) is never taken for the watched process, nor its end for a death.

    :param toward: The store's host.
    :param token: This process's incarnation, sent to every watcher.
    :param publish: Where to listen and what to publish (see :func:`listen_address`): ``None``
        (the address of this host's interface that reaches the store), :data:`ROUTE` (every
        interface; the address of the default route's interface is published) or an IP address.
    """

    def __init__(self, toward: str, token: str, publish: str | None = None) -> None:
        self._greeting = _greeting(token)
        self._accepted: list[socket.socket] = []
        self._sock: socket.socket | None = None  # the connection to the watched process
        self._peer: tuple[str, int] = ("", 0)
        self._connected = False
        self._want = b""  # the greeting of the watched process
        self._expected = b""  # the rest of it, not read yet
        self._confirming = False  # the connection ended: this one confirms (refused: a death)
        self.address = "-"
        """``"host:port"`` this process listens on (``"-"`` when no socket could be opened)."""
        self._listener: socket.socket | None = None
        with suppress(OSError), _LOCK:  # no usable address: the heartbeat alone tells this process's death
            bind, shown = listen_address(toward, publish)
            family = socket.AF_INET6 if ":" in shown else socket.AF_INET
            self._listener = socket.create_server((bind, 0), family=family, backlog=64)
            self._listener.setblocking(False)
            self.address = f"{shown}:{self._listener.getsockname()[1]}"
        _OPEN.add(self)

    def serve(self) -> None:
        """Accept and greet the connections of the processes that watch this one; close those
        they closed."""
        with _LOCK:
            while self._listener is not None:
                try:
                    conn, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    return
                conn.setblocking(False)
                with suppress(OSError):  # a few bytes on a new connection: the send buffer holds them
                    conn.send(self._greeting)
                self._accepted.append(conn)
            self._accepted = [c for c in self._accepted if _open(c) or _close(c)]

    @property
    def watchers(self) -> int:
        """How many connections of watching processes this one held at its last :meth:`serve`."""
        return len(self._accepted)

    def watch(self, address: str | None, token: str = "") -> None:
        """Watch the process of incarnation ``token`` listening at ``address`` (``"host:port"``)
        instead; ``None`` (or ``"-"``, or an address that cannot be connected to) watches nothing."""
        self._drop()
        self._want = self._expected = _greeting(token)
        if address is not None and address != "-":
            host, _, port = address.rpartition(":")
            with suppress(OSError, ValueError):
                self._connect((host, int(port)))

    def died(self) -> bool:
        """Whether the watched process exited: its connection, once it greeted this one, ended,
        and a new connection to the same address is refused.

        A connection that could not be made, or that answered anything but the greeting expected
        (or ended before it), stops the watch (``False``: the heartbeat decides).
        """
        for _ in range(2):  # a confirming connect to this host is refused at once: read it in this call
            sock = self._sock
            if sock is None:
                return False
            if not self._connected:
                code = sock.connect_ex(self._peer)  # a connect in progress answers how it went
                if code in _PENDING:
                    return False
                if code not in _CONNECTED:
                    dead = self._confirming and code == errno.ECONNREFUSED
                    self._drop()
                    return dead
                self._connected = True
            if self._expected:
                try:
                    data = sock.recv(len(self._expected))
                except (BlockingIOError, InterruptedError):
                    return False
                except OSError:
                    data = b""
                if not data or not self._expected.startswith(data):
                    self._drop()
                    return False
                self._expected = self._expected[len(data) :]
                if not self._expected:
                    self._confirming = False  # greeted again: the end was the network's, not a death
                return False
            if _open(sock):
                return False
            # The connection ended: connect again to tell a death (refused) from a network reset.
            peer, code = self._peer, -1
            self._drop()
            self._expected = self._want
            with suppress(OSError):
                code = self._connect(peer)
            if code == errno.ECONNREFUSED:
                return True
            self._confirming = self._sock is not None
        return False

    def close(self) -> None:
        """Close every socket: the processes watching this one see it end."""
        self._drop()
        with _LOCK:
            for conn in self._accepted:
                _close(conn)
            self._accepted = []
            if self._listener is not None:
                _close(self._listener)
                self._listener = None

    def _connect(self, peer: tuple[str, int]) -> int:
        """Start connecting to ``peer``; return ``connect``'s answer (the socket is kept unless it failed)."""
        with _LOCK:
            sock = socket.socket(socket.AF_INET6 if ":" in peer[0] else socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                if hasattr(socket, "TCP_KEEPIDLE"):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_IDLE)
                if _connect_wait is not None:
                    sock.settimeout(_connect_wait)
                code = sock.connect_ex(peer)
                sock.setblocking(False)
            except OSError:
                _close(sock)
                raise
            if code not in (*_CONNECTED, *_PENDING):
                _close(sock)
                return code
            self._sock, self._peer, self._connected = sock, peer, False
            return code

    def _drop(self) -> None:
        with _LOCK:
            if self._sock is not None:
                _close(self._sock)
            self._sock, self._connected, self._confirming = None, False, False


def _greeting(token: str) -> bytes:
    return f"gang.ft {token}\n".encode()


ROUTE = "route"
"""The ``publish`` choice for a multi-host job whose store host reaches the store over loopback
(a host that maps its own name to 127.0.1.1): listen on every interface and publish the address of
the interface of the default route, which the other hosts can reach."""


def listen_address(toward: str, publish: str | None = None) -> tuple[str, str]:
    """Where to listen and which address to publish, for a store at host ``toward``.

    - ``None`` (the default): the address of this host's interface that reaches the store, for both.
      A store on loopback (every process on one machine) gives a loopback address, and nothing is
      listened on or published outside it.
    - :data:`ROUTE`: every interface (``0.0.0.0`` or ``::``), publishing the address of the default
      route's interface (no packet is sent to find it); with no default route, as ``None``.
    - an IP address: that address, for both.
    """
    if publish == ROUTE:
        try:
            outward = local_address("192.0.2.1")  # any routed address: only the route is looked up
        except OSError:  # no default route: as `None`
            local = local_address(toward)
            return local, local
        return ("::" if ":" in outward else "0.0.0.0"), outward
    if publish is not None:
        return publish, publish
    local = local_address(toward)
    return local, local


def _open(sock: socket.socket) -> bool:
    """Whether the peer of a connected, non-blocking ``sock`` (which never receives data) still holds it."""
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:  # reset by the peer
        return False


def _close(sock: socket.socket) -> bool:
    with suppress(OSError):
        sock.close()
    return False


_OPEN: weakref.WeakSet[Liveness] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child: close the copies of every socket, which only the parent may hold.

    The lock was taken before the fork, so no socket was half made or half closed then."""
    _LOCK.release()
    for liveness in list(_OPEN):
        liveness.close()


os.register_at_fork(before=_LOCK.acquire, after_in_parent=_LOCK.release, after_in_child=_after_fork_in_child)

__all__ = ["Liveness"]
