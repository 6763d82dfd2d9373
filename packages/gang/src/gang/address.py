"""Loopback addresses: the one test of "a local run stays on 127.0.0.0/8".

A run on one machine (:class:`gang.testing.World`, the fault-tolerance examples' local jobs, a JAX
coordinator reached over loopback) keeps its traffic on loopback addresses. These helpers tell
whether an address or a name is one (:func:`is_loopback`), give the environment that keeps gloo
there (:func:`local_env`), and list a process's TCP sockets that reach beyond it
(:func:`non_loopback_sockets`), and pick a free port (:func:`free_port`). :mod:`gang.testing` re-exports them
for tests.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from contextlib import suppress
from pathlib import Path

LOOPBACK = "127.0.0.1"
"""The address every local run listens on and talks to."""


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that is free on ``host`` now (loopback by default; ``localhost`` and an
    empty host mean loopback too).

    Another process may take it before it is used, so use it at once (a test's store, a
    coordinator, a daemon's port).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("localhost", "") else LOOPBACK, 0))
        return int(s.getsockname()[1])


def is_loopback_address(address: str) -> bool:
    """Whether ``address`` is an IP address in the loopback range (``127.0.0.0/8`` or ``::1``).

    :raises ValueError: If ``address`` is not an IP address.
    """
    return ipaddress.ip_address(address.partition("%")[0]).is_loopback


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` (an IP address or a name) stands for is a loopback address.

    A name that cannot be resolved is not loopback.
    """
    try:
        return is_loopback_address(host)
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(found) and all(is_loopback_address(str(info[4][0])) for info in found)


def local_env() -> dict[str, str]:
    """Environment variables that keep a local run's traffic on loopback whatever this host's name
    resolves to: gloo binds to the host name's address unless ``GLOO_SOCKET_IFNAME`` names an
    interface, so this names the loopback interface (``lo``, or ``lo0`` on macOS) when there is one
    and the caller's environment names none."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    found = next((name for name in ("lo", "lo0") if name in names), None)
    return {} if found is None else {"GLOO_SOCKET_IFNAME": found}


def _decode(field: str) -> tuple[str, int]:
    """An address of ``/proc/net/tcp{,6}`` (little-endian hex words, then ``:PORT`` in hex)."""
    text, _, port = field.partition(":")
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host order
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), int(port, 16)


def non_loopback_sockets(pid: int) -> list[str]:
    """Describe each TCP socket of process ``pid`` that listens on, or talks to, anything but loopback.

    Reads ``/proc`` (Linux); a socket listening on every interface (``0.0.0.0``, ``::``) counts, as
    it can be reached from outside. An empty list: the process's TCP traffic stays on loopback.

    :raises OSError: If ``/proc`` does not describe the process (not Linux, or no such process).
    """
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        with suppress(FileNotFoundError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] not in inodes:
                    continue
                (local, lport), (remote, rport) = _decode(fields[1]), _decode(fields[2])
                listening = fields[3] == "0A"
                if not is_loopback_address(local) or not (listening or is_loopback_address(remote)):
                    what = "listens on" if listening else "connects"
                    peer = "" if listening else f" with {remote}:{rport}"
                    found.append(f"process {pid} {what} {local}:{lport}{peer}")
    return found


__all__ = ["LOOPBACK", "free_port", "is_loopback", "is_loopback_address", "local_env", "non_loopback_sockets"]
