"""Test hosts on one Linux machine: network namespaces with their own addresses, names and faults.

:class:`TestHosts` (a context manager) makes ``n`` hosts, each a Linux network namespace with
one interface (``eth0``) on a private bridge, its own IPv4 address in a private test subnet and its
own host name, which resolves to that address on every host (``/etc/netns/<namespace>/hosts``).
Processes started on a host (:meth:`Host.popen`) run inside its namespace with that host name
(``socket.gethostname()``), so multi-node code runs over real interfaces, routes and names instead
of loopback. Faults are made on the network: :meth:`TestHosts.cut` and :meth:`TestHosts.restore` a
host's link, :meth:`TestHosts.partition` two hosts (each gets a blackhole route to the other, and
both still reach the rest) and :meth:`TestHosts.heal` them, :meth:`TestHosts.flap` a link (a
background thread), :meth:`TestHosts.limit_rate` of a link (``tc ... tbf``).

It needs Linux, root and ``ip`` (iproute2; ``tc`` for rates, ``ss`` for :meth:`TestHosts.leaks`,
``unshare`` for the host names): :func:`skip_reason` says in one line why it cannot run here, so a
test can skip with that line.

**Safety.** Nothing a test does with these hosts can leave the machine:

- every process of :meth:`Host.popen` runs inside its host's namespace, whose only interfaces are
  ``lo`` and ``eth0`` on the bridge, and no namespace has a default route (nor any route beyond
  the test subnet);
- the root namespace gets a blackhole route for the test subnet, so that a packet for a test
  address sent from outside the namespaces is dropped instead of following the default route;
- :meth:`TestHosts.close` (the end of the ``with`` block) kills every process in the namespaces and
  removes every namespace, interface, route and hosts file it made; the names of all of them carry
  the owner's process id (namespaces ``gth<pid><k><i>``, bridge ``gtb<pid><k>``, veths
  ``gtv<pid><k><i>``, the root's blackhole route has metric ``<pid>``), and every start first
  removes what an owner that is no longer alive left (a run killed before its teardown);
- :meth:`TestHosts.leaks` lists every socket, in each namespace and among the caller's own
  processes, that reaches beyond loopback and the test subnet, and every process the caller started
  outside the namespaces: a test asserts that it is empty.

Each :class:`TestHosts` takes its own ``/24`` of :data:`SUBNETS` (``10.213.0.0/16``), so several may
run at once on one machine, from one process or many. IPv6 is turned off in the namespaces.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

__all__ = [
    "SUBNETS",
    "Flap",
    "Host",
    "HostProcess",
    "TestHosts",
    "clean_up_dead_owners",
    "skip_reason",
]

SUBNETS = ipaddress.IPv4Network("10.213.0.0/16")
"""The private range test hosts take their addresses from: each :class:`TestHosts` takes one ``/24``."""

_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
_LOCK = Path(tempfile.gettempdir()) / "gang-test-hosts.lock"
_NETNS_ETC = Path("/etc/netns")
# The names of what an owner makes: namespaces gth<pid><k><i>, bridge gtb<pid><k>, veths gtv<pid><k><i>.
_OWNED = re.compile(r"^gt([hbv])(\d+)([a-z])(\d*)$")
_letters = itertools.cycle("abcdefghijklmnopqrstuvwxyz")
_letters_lock = threading.Lock()


def _tool(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))


def skip_reason() -> str | None:
    """Why test hosts cannot be made here, in one line, or ``None`` if they can.

    They need Linux, root (to make namespaces, interfaces and routes) and the programs ``ip``,
    ``tc``, ``ss`` and ``unshare``.
    """
    if not sys.platform.startswith("linux"):
        return f"test hosts need Linux network namespaces, but this is {sys.platform}"
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, a bridge and routes), but this process is not root"
    missing = [name for name in ("ip", "tc", "ss", "unshare") if _tool(name) is None]
    if missing:
        return f"test hosts need {', '.join(missing)} (iproute2, util-linux), which are not installed"
    if not Path("/proc/self/ns/net").exists():
        return "test hosts need network namespaces, which this kernel does not offer"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc``/``ss`` command (by path) and return it; raise with its output if it fails and ``check``."""
    program = _tool(argv[0]) or argv[0]
    done = subprocess.run([program, *argv[1:]], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed with exit status {done.returncode}: {done.stderr.strip()}")
    return done


def _in_subnets(network: str) -> bool:
    """Whether ``network`` (a route's destination) lies in :data:`SUBNETS`."""
    try:
        found = ipaddress.ip_network(network, strict=False)
    except ValueError:
        return False
    return isinstance(found, ipaddress.IPv4Network) and found.subnet_of(SUBNETS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process in ``namespace`` and wait (briefly) until none is left."""
    for _ in range(50):
        found = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.05)


def _remove(owner: int, letter: str | None = None) -> list[str]:
    """Remove what owner ``owner`` made (only its set ``letter`` if given); return what was removed."""
    removed = []

    def mine(name: str, kind: str) -> bool:
        m = _OWNED.match(name)
        return m is not None and m[1] == kind and int(m[2]) == owner and (letter is None or m[3] == letter)

    namespaces = [line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines() if line]
    for namespace in namespaces:
        if mine(namespace, "h"):
            _kill_namespace_processes(namespace)
            _run("ip", "netns", "del", namespace, check=False)
            removed.append(f"namespace {namespace}")
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().partition("@")[0] if ":" in line else ""
        if mine(name, "v") or mine(name, "b"):
            _run("ip", "link", "del", name, check=False)
            removed.append(f"link {name}")
    for line in _run("ip", "route", "show", "type", "blackhole", check=False).stdout.splitlines():
        m = re.match(r"blackhole (\S+).* metric (\d+)", line)
        if m and int(m[2]) == owner and _in_subnets(m[1]) and _letter_of_route.get(m[1]) in (None, letter):
            _run("ip", "route", "del", "blackhole", m[1], "metric", m[2], check=False)
            removed.append(f"route blackhole {m[1]} metric {m[2]}")
    if _NETNS_ETC.is_dir():
        for folder in _NETNS_ETC.iterdir():
            if mine(folder.name, "h"):
                shutil.rmtree(folder, ignore_errors=True)
    return removed


_letter_of_route: dict[str, str] = {}
"""This process's own subnets and the set letter that owns each (for removing one set of several)."""


def clean_up_dead_owners() -> list[str]:
    """Remove the namespaces, interfaces, routes and hosts files of test hosts whose owner process is
    no longer alive (a run killed before its teardown); return what was removed, one line each.

    :class:`TestHosts` calls it on every start.
    """
    owners: set[int] = set()
    namespaces = [line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines() if line]
    links = [
        line.split(":")[1].strip().partition("@")[0]
        for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines()
        if ":" in line
    ]
    for name in [*namespaces, *links, *(p.name for p in (_NETNS_ETC.iterdir() if _NETNS_ETC.is_dir() else ()))]:
        m = _OWNED.match(name)
        if m:
            owners.add(int(m[2]))
    for line in _run("ip", "route", "show", "type", "blackhole", check=False).stdout.splitlines():
        m = re.match(r"blackhole (\S+).* metric (\d+)", line)
        if m and _in_subnets(m[1]):
            owners.add(int(m[2]))
    removed = []
    for owner in sorted(owners):
        if owner != os.getpid() and not _alive(owner):
            removed += _remove(owner)
    return removed


class HostProcess(subprocess.Popen[str]):
    """A process started on a test host (:meth:`Host.popen`): a ``subprocess.Popen`` whose output
    (stdout and stderr together) goes to the file :attr:`log` unless the caller redirected it.

    :ivar host: The host it runs on.
    :ivar log: The file its output is written to (``None`` if the caller gave ``stdout``).
    """

    host: Host
    log: Path | None

    def output(self) -> str:
        """What the process wrote so far (its log file), or ``""`` without one."""
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")


class Host:
    """One test host: a network namespace with interface ``eth0`` at :attr:`address` and the name :attr:`name`.

    :ivar index: Its position among its :class:`TestHosts` (0 first).
    :ivar name: Its host name: what ``socket.gethostname()`` returns in its processes, and a name
        every host resolves to :attr:`address` (its own too, unless ``own_name="loopback"``).
    :ivar address: Its IPv4 address on the test subnet.
    :ivar namespace: The name of its network namespace (``ip netns``).
    :ivar link: The root namespace's end of its link (a veth on the bridge): what faults act on.
    """

    def __init__(self, owner: TestHosts, index: int, name: str, address: str, namespace: str, link: str) -> None:
        self._owner = owner
        self.index = index
        self.name = name
        self.address = address
        self.namespace = namespace
        self.link = link

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run on this host: in its namespace, with its host name (``ip netns
        exec``, then ``unshare --uts`` and ``hostname``)."""
        ip, unshare = _tool("ip") or "ip", _tool("unshare") or "unshare"
        hostname = 'hostname "$0" && exec "$@"'
        return [ip, "netns", "exec", self.namespace, unshare, "--uts", "sh", "-c", hostname, self.name, *argv]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdout: int | None = None,
        log: str | os.PathLike[str] | None = None,
    ) -> HostProcess:
        """Start ``argv`` on this host and return its handle.

        It runs in its own process group (so :meth:`TestHosts.close` stops it with its children),
        with the caller's environment updated by ``env``. Its output (stdout and stderr together)
        goes to ``log`` (default: a new file in the hosts' ``log_dir`` named after the host and
        the program), or to ``stdout`` if given (e.g. ``subprocess.PIPE``).

        :raises ValueError: If ``argv`` is empty.
        :raises RuntimeError: If the hosts are closed.
        """
        if not argv:
            raise ValueError(f"`argv` must name a program, but is {argv!r} instead.")
        self._owner._check_open()
        full_env = {**os.environ, **(env or {})}
        path: Path | None = None
        if stdout is None:
            path = Path(log) if log is not None else self._owner._next_log(self, argv)
            sink = path.open("w")
        try:
            process = HostProcess(
                self.command(argv),
                env=full_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=sink if stdout is None else stdout,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        finally:
            if stdout is None:
                sink.close()
        process.host, process.log = self, path
        self._owner._processes.append(process)
        return process

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to its end and return it (stdout and stderr captured, not checked)."""
        if not argv:
            raise ValueError(f"`argv` must name a program, but is {argv!r} instead.")
        self._owner._check_open()
        return subprocess.run(
            self.command(argv),
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )


class Flap(threading.Thread):
    """A link taken down and brought up again every ``period`` seconds for ``duration`` seconds
    (:meth:`TestHosts.flap`); the link is up when it ends. :meth:`stop` ends it early."""

    def __init__(self, hosts: TestHosts, host: Host, period: float, duration: float) -> None:
        super().__init__(name=f"flap {host.name}", daemon=True)
        self._hosts, self._host, self._period, self._duration = hosts, host, period, duration
        self._stopped = threading.Event()
        self.changes = 0
        """How many times the link went down so far."""

    def run(self) -> None:
        """Alternate down and up (``period`` seconds each) until ``duration`` has passed or :meth:`stop`."""
        end = time.monotonic() + self._duration
        try:
            while not self._stopped.is_set() and time.monotonic() < end:
                self._hosts.cut(self._host)
                self.changes += 1
                if self._stopped.wait(min(self._period, max(0.0, end - time.monotonic()))):
                    break
                self._hosts.restore(self._host)
                self._stopped.wait(min(self._period, max(0.0, end - time.monotonic())))
        finally:
            with contextlib.suppress(RuntimeError):
                self._hosts.restore(self._host)

    def stop(self) -> None:
        """End the flapping now (the link is brought up) and wait for the thread."""
        self._stopped.set()
        if self.is_alive():
            self.join()


class TestHosts:
    """``n`` test hosts on one Linux machine (see the module's description); a context manager.

    ``with TestHosts(3) as hosts:`` makes them (:meth:`start`) and removes them (:meth:`close`).
    ``hosts[i]`` (or ``hosts.hosts[i]``) is host ``i``, named ``f"{prefix}{i}"``.

    :param n: How many hosts (1 to 200).
    :param prefix: The host names' prefix (a DNS label: letters, digits and ``-``).
    :param own_name: ``"address"``: every host resolves its own name to its address. ``"loopback"``:
        each host resolves its own name to ``127.0.1.1`` (as many Linux distributions, containers
        and VMs do) while the others resolve it to its address: the case where whatever binds to
        "this host's name" binds to loopback.
    :param log_dir: Where the processes' logs go (default: a new temporary folder, kept after close).
    :raises ValueError: If ``n``, ``prefix`` or ``own_name`` is out of range.
    :raises RuntimeError: On :meth:`start`, if test hosts cannot be made here (see :func:`skip_reason`).
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        n: int,
        *,
        prefix: str = "host",
        own_name: Literal["address", "loopback"] = "address",
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"`n` must be an `int`, but is of type `{type(n).__name__}` instead.")
        if not 1 <= n <= 200:
            raise ValueError(f"`n` must be between 1 and 200, but is {n} instead.")
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,40}", prefix):
            raise ValueError(f"`prefix` must be a lowercase DNS label, but is {prefix!r} instead.")
        if own_name not in ("address", "loopback"):
            raise ValueError(f"`own_name` must be 'address' or 'loopback', but is {own_name!r} instead.")
        self.n, self.prefix, self.own_name = n, prefix, own_name
        self.owner = os.getpid()
        with _letters_lock:
            self._letter = next(_letters)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.hosts: list[Host] = []
        self.subnet: ipaddress.IPv4Network | None = None
        """This set's ``/24`` of :data:`SUBNETS` (once started)."""
        self.bridge = f"gtb{self.owner}{self._letter}"
        self._processes: list[HostProcess] = []
        self._flaps: list[Flap] = []
        self._logs = itertools.count()
        self._open = False

    # -- the hosts ---------------------------------------------------------------------------------

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __enter__(self) -> TestHosts:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> TestHosts:
        """Make the hosts: clean up after dead owners, take a free ``/24`` of :data:`SUBNETS`,
        blackhole it in the root namespace, then make the bridge, the namespaces, their links,
        addresses and hosts files. Returns ``self``.

        :raises RuntimeError: If test hosts cannot be made here, or a command fails (what was made is removed).
        """
        reason = skip_reason()
        if reason is not None:
            raise RuntimeError(f"Test hosts cannot be made here: {reason}.")
        if self._open or self.hosts:
            raise RuntimeError("These test hosts were started already.")
        clean_up_dead_owners()
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix=f"gang-hosts-{self.owner}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._open = True
        try:
            self._claim_subnet()
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _claim_subnet(self) -> None:
        """Take the lowest ``/24`` of :data:`SUBNETS` that no blackhole route of the root namespace
        holds, by adding that route (under a lock file, so that concurrent starts take different ones)."""
        with _LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken: set[ipaddress.IPv4Network] = set()
            for line in _run("ip", "route", "show", "type", "blackhole").stdout.splitlines():
                with contextlib.suppress(ValueError, IndexError):
                    network = ipaddress.ip_network(line.split()[1], strict=False)
                    if isinstance(network, ipaddress.IPv4Network):
                        taken.add(network)
            for subnet in SUBNETS.subnets(new_prefix=24):
                if not any(subnet.overlaps(t) for t in taken):
                    _run("ip", "route", "add", "blackhole", str(subnet), "metric", str(self.owner))
                    self.subnet = subnet
                    _letter_of_route[str(subnet)] = self._letter
                    return
        raise RuntimeError(f"Every /24 of {SUBNETS} is taken by other test hosts.")

    def _make(self) -> None:
        assert self.subnet is not None
        addresses = list(self.subnet.hosts())
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.n):
            namespace = f"gth{self.owner}{self._letter}{i}"
            link, peer = f"gtv{self.owner}{self._letter}{i}", f"gtp{self.owner}{self._letter}{i}"
            host = Host(self, i, f"{self.prefix}{i}", str(addresses[i]), namespace, link)
            self.hosts.append(host)
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", link, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", peer, "netns", namespace)
            _run("ip", "-n", namespace, "link", "set", peer, "name", "eth0")
            _run("ip", "link", "set", link, "master", self.bridge)
            _run("ip", "link", "set", link, "up")
            for key in ("all", "default"):
                sysctl = f"net.ipv6.conf.{key}.disable_ipv6=1"
                _run("ip", "netns", "exec", namespace, "sysctl", "-qw", sysctl, check=False)
            _run("ip", "-n", namespace, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
        for host in self.hosts:
            lines = ["127.0.0.1\tlocalhost"]
            for other in self.hosts:
                if other is host and self.own_name == "loopback":
                    lines.append(f"127.0.1.1\t{other.name}")
                else:
                    lines.append(f"{other.address}\t{other.name}")
            folder = _NETNS_ETC / host.namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")
        problems = self._route_problems()
        if problems:
            raise RuntimeError(f"The test hosts are not contained: {'; '.join(problems)}.")

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("These test hosts are closed (or not started).")

    def _next_log(self, host: Host, argv: Sequence[str]) -> Path:
        assert self.log_dir is not None
        program = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(argv[0]).name)[:40]
        return self.log_dir / f"{host.name}-{next(self._logs):03d}-{program}.log"

    def host(self, which: Host | int | str) -> Host:
        """The host ``which`` names: a :class:`Host` of these hosts, its index or its name.

        :raises ValueError: If it names none of them.
        """
        if isinstance(which, Host) and which in self.hosts:
            return which
        if isinstance(which, int) and not isinstance(which, bool) and 0 <= which < len(self.hosts):
            return self.hosts[which]
        if isinstance(which, str):
            for host in self.hosts:
                if host.name == which:
                    return host
        raise ValueError(f"`host` must be one of {self.hosts} (or its index or name), but is {which!r} instead.")

    # -- faults ------------------------------------------------------------------------------------

    def cut(self, host: Host | int | str) -> None:
        """Cut ``host``'s link (its veth on the bridge goes down): it reaches no other host and no
        other host reaches it; its packets are dropped silently, as when its cable or switch port fails."""
        self._check_open()
        _run("ip", "link", "set", self.host(host).link, "down")

    def restore(self, host: Host | int | str) -> None:
        """Bring ``host``'s link up again (after :meth:`cut`).

        Every host's neighbour (ARP) entries are flushed, so that addresses which failed to resolve
        while the link was down are resolved again at once instead of failing with ``EHOSTUNREACH``
        for a few more seconds.
        """
        self._check_open()
        _run("ip", "link", "set", self.host(host).link, "up")
        self._flush_neighbours()

    def _flush_neighbours(self) -> None:
        for each in self.hosts:
            _run("ip", "-n", each.namespace, "neigh", "flush", "all", check=False)

    def partition(self, a: Host | int | str, b: Host | int | str) -> None:
        """Make ``a`` and ``b`` unreachable from each other while both still reach every other host:
        each gets a blackhole route to the other's address (sending to it fails at once with
        ``EINVAL`` on that host; nothing is delivered either way)."""
        self._check_open()
        first, second = self.host(a), self.host(b)
        if first is second:
            raise ValueError(f"`b` must be another host than `a`, but both are {first!r}.")
        for here, there in ((first, second), (second, first)):
            _run("ip", "-n", here.namespace, "route", "replace", "blackhole", f"{there.address}/32")

    def heal(self, a: Host | int | str, b: Host | int | str) -> None:
        """Undo :meth:`partition` of ``a`` and ``b`` (and flush the neighbour entries, as :meth:`restore`)."""
        self._check_open()
        first, second = self.host(a), self.host(b)
        for here, there in ((first, second), (second, first)):
            _run("ip", "-n", here.namespace, "route", "del", "blackhole", f"{there.address}/32", check=False)
        self._flush_neighbours()

    def flap(self, host: Host | int | str, *, period: float = 1.0, duration: float = 10.0) -> Flap:
        """Start flapping ``host``'s link in a background thread: down for ``period`` seconds, up for
        ``period`` seconds, and so on for ``duration`` seconds, then up. Returns the running
        :class:`Flap` (``join()`` waits for its end, ``stop()`` ends it now); :meth:`close` stops it.

        :raises ValueError: If ``period`` or ``duration`` is not positive.
        """
        self._check_open()
        for name, value in (("period", period), ("duration", duration)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`{name}` must be a positive number of seconds, but is {value!r} instead.")
        flap = Flap(self, self.host(host), float(period), float(duration))
        self._flaps.append(flap)
        flap.start()
        return flap

    def limit_rate(self, host: Host | int | str, bits_per_second: int) -> None:
        """Limit ``host``'s link to ``bits_per_second`` in each direction (a ``tbf`` queue on both
        ends of its veth); :meth:`unlimit_rate` removes the limit.

        :raises ValueError: If ``bits_per_second`` is not a positive ``int``.
        """
        self._check_open()
        if isinstance(bits_per_second, bool) or not isinstance(bits_per_second, int) or bits_per_second < 8000:
            raise ValueError(
                f"`bits_per_second` must be an `int` of at least 8000, but is {bits_per_second!r} instead."
            )
        target = self.host(host)
        burst = max(16_000, bits_per_second // 8 // 100)  # bytes: at least 10 ms of traffic, and a few packets
        tbf = ["root", "tbf", "rate", f"{bits_per_second}bit", "burst", str(burst), "latency", "100ms"]
        _run("tc", "qdisc", "replace", "dev", target.link, *tbf)
        _run("ip", "netns", "exec", target.namespace, _tool("tc") or "tc", "qdisc", "replace", "dev", "eth0", *tbf)

    def unlimit_rate(self, host: Host | int | str) -> None:
        """Remove the limit :meth:`limit_rate` put on ``host``'s link."""
        self._check_open()
        target = self.host(host)
        _run("tc", "qdisc", "del", "dev", target.link, "root", check=False)
        tc = _tool("tc") or "tc"
        _run("ip", "netns", "exec", target.namespace, tc, "qdisc", "del", "dev", "eth0", "root", check=False)

    # -- safety ------------------------------------------------------------------------------------

    def _allowed(self, address: str) -> bool:
        """Whether a socket's address stays within loopback and the test subnet (or is a wildcard)."""
        text = address.strip("[]").partition("%")[0]
        if text in ("*", "0.0.0.0", "::"):
            return True
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback or (self.subnet is not None and ip in self.subnet)

    def _route_problems(self) -> list[str]:
        problems = []
        assert self.subnet is not None
        root = _run("ip", "route", "show", "type", "blackhole", check=False).stdout
        if not re.search(rf"^blackhole {re.escape(str(self.subnet))} .*metric {self.owner}\b", root, re.MULTILINE):
            problems.append(f"the root namespace has no blackhole route for {self.subnet}")
        for host in self.hosts:
            for family in ("-4", "-6"):
                table = _run("ip", family, "-n", host.namespace, "route", "show", "table", "all", check=False)
                for line in table.stdout.splitlines():
                    words = line.split()
                    if not words or words[0] in ("local", "broadcast", "multicast") or "table local" in line:
                        continue
                    destination = words[1] if words[0] in ("blackhole", "unreachable", "prohibit") else words[0]
                    if destination == "default":
                        problems.append(f"{host.name} has a default route ({line})")
                        continue
                    with contextlib.suppress(ValueError):
                        network = ipaddress.ip_network(destination, strict=False)
                        if not (isinstance(network, ipaddress.IPv4Network) and network.subnet_of(self.subnet)):
                            problems.append(f"{host.name} has a route beyond the test subnet ({line})")
        return problems

    def leaks(self) -> list[str]:
        """Everything that breaks containment, one line each (empty: contained).

        - a route in a namespace beyond the test subnet (a default route above all), or the root
          namespace's blackhole route for the subnet missing;
        - a TCP or UDP socket in a namespace (``ss -tuanp`` inside it) whose local or peer address
          is neither loopback nor in the test subnet (a wildcard listener counts as contained: the
          namespace has no other interface);
        - a process the caller started (a descendant) that runs outside the namespaces while
          holding a socket beyond loopback.
        """
        self._check_open()
        problems = self._route_problems()
        for host in self.hosts:
            table = _run("ip", "netns", "exec", host.namespace, _tool("ss") or "ss", "-H", "-tuanp", check=False)
            for line in table.stdout.splitlines():
                words = line.split()
                if len(words) < 6:
                    continue
                local, peer = words[4].rpartition(":")[0], words[5].rpartition(":")[0]
                if not (self._allowed(local) and self._allowed(peer)):
                    problems.append(f"{host.name}: {line.strip()}")
        from gang.address import non_loopback_sockets

        root = os.stat("/proc/self/ns/net").st_ino
        for pid in _descendants(os.getpid()):
            try:
                if os.stat(f"/proc/{pid}/ns/net").st_ino != root:
                    continue
                problems += [f"outside the test hosts: {line}" for line in non_loopback_sockets(pid)]
            except OSError:  # it ended meanwhile
                continue
        return problems

    # -- teardown ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every flap, kill every process in the namespaces and remove everything made: the
        namespaces, veths, bridge, routes and hosts files (idempotent). The logs stay in :attr:`log_dir`."""
        self._open = False
        for flap in self._flaps:
            flap.stop()
        for process in self._processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        _remove(self.owner, self._letter)
        _run("ip", "link", "del", self.bridge, check=False)
        if self.subnet is not None:
            _run("ip", "route", "del", "blackhole", str(self.subnet), "metric", str(self.owner), check=False)
            _letter_of_route.pop(str(self.subnet), None)


def _descendants(pid: int) -> list[int]:
    """The process ids of every descendant of ``pid`` (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            parent = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
