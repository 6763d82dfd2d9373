"""Addresses: the one test of "a local run stays on 127.0.0.0/8", and the one choice of the
address (and interface) other hosts reach this process at.

A run on one machine (:class:`gang.testing.World`, the fault-tolerance examples' local jobs, a JAX
coordinator reached over loopback) keeps its traffic on loopback addresses. These helpers tell
whether an address or a name is one (:func:`is_loopback`), give the environment that keeps gloo
there (:func:`local_env`), and list a process's TCP sockets that reach beyond it
(:func:`non_loopback_sockets`), and pick a free port (:func:`free_port`). :mod:`gang.testing` re-exports them
for tests.

A run across hosts needs the address of this host that the others reach: :func:`outward_address`
finds it from the route toward the rendezvous host (the store, ``MASTER_ADDR``), and
:func:`gloo_env` names the interface holding it for gloo (``GLOO_SOCKET_IFNAME``) unless the user
named one. A rendezvous host reached over loopback keeps everything on loopback.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
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
    if GLOO_SOCKET_IFNAME in os.environ:
        return {}
    return _loopback_env()


GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
"""The variable that names gloo's interface (torch reads it whenever it creates a gloo group)."""

_SET_BY_GANG: dict[str, str] = {}
"""The variables :func:`use_gloo_interface` set in this process, with the value it set."""


def local_address(host: str) -> str:
    """The address of this host's interface that reaches ``host`` (IPv4 if ``host`` has one).

    Only the route is looked up (a UDP socket is connected, nothing is sent).

    :raises OSError: If ``host`` does not resolve or no route reaches it.
    """
    found = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    family, _, _, _, where = next((f for f in found if f[0] == socket.AF_INET), found[0])
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return str(probe.getsockname()[0])


def interface_addresses() -> dict[str, str]:
    """Each interface's IPv4 address, by interface name (Linux; empty elsewhere or without one)."""
    if not sys.platform.startswith("linux"):
        return {}
    import fcntl

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's (first) IPv4 address
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def outward_address(toward: str, *, several_hosts: bool = False) -> str:
    """The address of this host that the other processes of a job reach, for a rendezvous at ``toward``.

    It is the address of the interface on the route toward ``toward`` (the store's host or
    ``MASTER_ADDR``): a rendezvous host reached over loopback gives a loopback address, so a run on
    one machine stays there. One case differs: ``toward`` is a *name* that resolves to a loopback
    address here (this host's own name, as many distributions and containers map it) while the job
    spans ``several_hosts``: the other hosts resolve that name to this host's real address, so the
    address returned is that of the default route's interface, or, without a default route, of the
    only interface besides loopback that has an IPv4 address (loopback if there are several).

    :raises OSError: If ``toward`` does not resolve or no route reaches it.
    """
    local = local_address(toward)
    if not several_hosts or not is_loopback_address(local) or toward == "localhost":
        return local
    try:
        is_loopback_address(toward)
        return local  # an IP address in 127.0.0.0/8: every process is on this machine
    except ValueError:
        pass
    try:
        return local_address("192.0.2.1")  # any routed address: only the route is looked up
    except OSError:
        others = {a for a in interface_addresses().values() if not is_loopback_address(a)}
        return others.pop() if len(others) == 1 else local


def gloo_env(toward: str, *, several_hosts: bool = False) -> dict[str, str]:
    """``{"GLOO_SOCKET_IFNAME": name}``: the interface holding :func:`outward_address` ``(toward)``,
    for gloo to bind; empty if the caller's environment names one already or none is found.

    Without it gloo binds to the address this host's name resolves to, which is loopback on many
    hosts: the other hosts then cannot connect.
    """
    if GLOO_SOCKET_IFNAME in os.environ and os.environ[GLOO_SOCKET_IFNAME] != _SET_BY_GANG.get(GLOO_SOCKET_IFNAME):
        return {}
    try:
        address = outward_address(toward, several_hosts=several_hosts)
    except OSError:
        return {}
    if is_loopback_address(address):
        return _loopback_env()
    name = next((n for n, a in interface_addresses().items() if a == address), None)
    return {} if name is None else {GLOO_SOCKET_IFNAME: name}


def use_gloo_interface(toward: str, *, several_hosts: bool = False) -> None:
    """Set :func:`gloo_env` in this process's environment, where torch reads it whenever it
    creates a gloo group (the default group, its sub-groups, a ``DeviceMesh``'s). A variable the
    user set is left as it is; one this function set is replaced."""
    for key, value in gloo_env(toward, several_hosts=several_hosts).items():
        os.environ[key] = value
        _SET_BY_GANG[key] = value


def user_gloo_interface() -> str | None:
    """The ``GLOO_SOCKET_IFNAME`` the user set (not one :func:`use_gloo_interface` set), if any."""
    value = os.environ.get(GLOO_SOCKET_IFNAME)
    return None if value is None or value == _SET_BY_GANG.get(GLOO_SOCKET_IFNAME) else value


def _loopback_env() -> dict[str, str]:
    """``{"GLOO_SOCKET_IFNAME": "lo"}`` (``lo0`` on macOS) where there is such an interface."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    found = next((name for name in ("lo", "lo0") if name in names), None)
    return {} if found is None else {GLOO_SOCKET_IFNAME: found}


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


__all__ = [
    "GLOO_SOCKET_IFNAME",
    "LOOPBACK",
    "free_port",
    "gloo_env",
    "interface_addresses",
    "is_loopback",
    "is_loopback_address",
    "local_address",
    "local_env",
    "non_loopback_sockets",
    "outward_address",
    "use_gloo_interface",
    "user_gloo_interface",
]
