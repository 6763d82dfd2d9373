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
the token it expects and then closed counts; one that cannot be made (a firewall, a process that
died before it was watched) or that reached anything else is not a death. Children forked by the
process (data-loader workers) close their copies of these sockets at once
(``os.register_at_fork``), so a child cannot hold a dead parent's connection open.

Used by the heartbeat thread only (its owner closes it once that thread stopped). Internal to
:mod:`gang.ft` (its names may change); not part of the public API.
"""

from __future__ import annotations

import errno
import os
import socket
import weakref
from contextlib import suppress

_CONNECTED = (0, errno.EISCONN)
_PENDING = (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK)


class Liveness:
    """This process's listening socket, and the connection to the one process it watches.

    A process greets every watcher with its incarnation's token as it accepts the connection; a
    watcher counts the connection only once it read the token it expects, so a connection that
    reached something else (an address not reachable as published, a port reused by another
    program) is never taken for the watched process, nor its end for a death.

    :param toward: The store's host: the socket listens on the address this host reaches it from,
        so processes on other hosts of the job can connect.
    :param token: This process's incarnation, sent to every watcher.
    """

    def __init__(self, toward: str, token: str) -> None:
        self._greeting = _greeting(token)
        self._accepted: list[socket.socket] = []
        self._watching: socket.socket | None = None
        self._peer: tuple[str, int] = ("", 0)
        self._established = False
        self._expected = b""  # the rest of the watched process's greeting, not read yet
        self.address = "-"
        """``"host:port"`` this process listens on (``"-"`` when no socket could be opened)."""
        self._listener: socket.socket | None = None
        with suppress(OSError):  # no usable address: the heartbeat alone tells this process's death
            host = _local_address(toward)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, 0), family=family, backlog=64)
            self._listener.setblocking(False)
            self.address = f"{host}:{self._listener.getsockname()[1]}"
        _OPEN.add(self)

    def serve(self) -> None:
        """Accept and greet the connections of the processes that watch this one; close those
        they closed."""
        if self._listener is None:
            return
        while True:
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
        instead; ``None`` (or ``"-"``) watches nothing."""
        if self._watching is not None:
            _close(self._watching)
        self._watching, self._established, self._expected = None, False, _greeting(token)
        if address is None or address == "-":
            return
        host, _, port = address.rpartition(":")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        self._peer = (host, int(port))
        if sock.connect_ex(self._peer) not in (*_CONNECTED, *_PENDING):
            _close(sock)
            return
        self._watching = sock

    def died(self) -> bool:
        """Whether the watched process's connection, once it greeted this one, was closed: it exited.

        A connection that could not be made, or that answered anything but the greeting expected
        (or ended before it), stops the watch (``False``: the heartbeat decides).
        """
        sock = self._watching
        if sock is None:
            return False
        if not self._established:
            code = sock.connect_ex(self._peer)  # a connect in progress answers how it went
            if code in _PENDING:
                return False
            if code not in _CONNECTED:
                self.watch(None)
                return False
            self._established = True
        if self._expected:
            try:
                data = sock.recv(len(self._expected))
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                data = b""
            if not data or not self._expected.startswith(data):
                self.watch(None)
                return False
            self._expected = self._expected[len(data) :]
            return False
        if _open(sock):
            return False
        self.watch(None)
        return True

    def close(self) -> None:
        """Close every socket: the processes watching this one see it end."""
        self.watch(None)
        for conn in self._accepted:
            _close(conn)
        self._accepted = []
        if self._listener is not None:
            _close(self._listener)
            self._listener = None


def _greeting(token: str) -> bytes:
    return f"gang.ft {token}\n".encode()


def _local_address(host: str) -> str:
    """The address of this host's interface that reaches ``host`` (no packet is sent)."""
    family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return str(probe.getsockname()[0])


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


def _close_in_child() -> None:
    """In a forked child: close the copies of every socket, which only the parent may hold."""
    for liveness in list(_OPEN):
        liveness.close()


os.register_at_fork(after_in_child=_close_in_child)

__all__ = ["Liveness"]
