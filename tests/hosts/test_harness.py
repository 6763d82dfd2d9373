"""The test hosts themselves: names, addresses, containment, faults and teardown (real namespaces)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gang.testing import TestHosts
from gang.testing_hosts import clean_up_dead_owners

PY = sys.executable
# Prints what this host's name and another host's name resolve to, then "ok".
RESOLVE = (
    "import socket, sys; n = socket.gethostname(); print(n, socket.gethostbyname(n), socket.gethostbyname(sys.argv[1]))"
)
# Listens on every interface at port 7000 and answers each connection with its host name.
SERVE = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 7000)); s.listen(); print('listening', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(socket.gethostname().encode()); c.close()\n"
)
# Connects to argv[1]:7000 (2 s timeout) and prints the answer, or the error's name.
ASK = (
    "import socket, sys\n"
    "try:\n"
    "    with socket.create_connection((sys.argv[1], 7000), timeout=2) as c: print(c.recv(100).decode())\n"
    "except OSError as e: print(type(e).__name__ if type(e) is not OSError else f'OSError{e.errno}')\n"
)


def ask(hosts: TestHosts, src: int, dst: int) -> str:
    return hosts[src].run([PY, "-c", ASK, hosts[dst].name]).stdout.strip()


def wait_for(process: subprocess.Popen[str], text: str, log: Path | None) -> None:
    deadline = time.monotonic() + 60
    while log is None or text not in log.read_text():
        assert process.poll() is None, log.read_text() if log else process.returncode
        assert time.monotonic() < deadline, f"no {text!r} in {log}"
        time.sleep(0.05)


def ours(pid: int) -> str:
    """Every namespace, link, route and hosts folder whose name carries owner ``pid``."""
    out = subprocess.run(
        "ip netns list; ip -o link show; ip route show type blackhole; ls /etc/netns 2>/dev/null",
        shell=True,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return "\n".join(
        line
        for line in out.splitlines()
        if f"gth{pid}" in line or f"gtv{pid}" in line or f"gtb{pid}" in line or f"metric {pid}" in line
    )


def test_names_addresses_and_containment() -> None:
    with TestHosts(3) as hosts:
        assert [h.name for h in hosts] == ["host0", "host1", "host2"]
        assert len({h.address for h in hosts}) == 3
        for h in hosts:
            name, own, other = h.run([PY, "-c", RESOLVE, hosts[(h.index + 1) % 3].name]).stdout.split()
            assert (name, own, other) == (h.name, h.address, hosts[(h.index + 1) % 3].address)
            routes = subprocess.run(["ip", "-n", h.namespace, "route"], capture_output=True, text=True).stdout
            assert "default" not in routes and routes.strip(), routes
        server = hosts[0].popen([PY, "-c", SERVE])
        wait_for(server, "listening", server.log)
        assert ask(hosts, 1, 0) == "host0" and ask(hosts, 2, 0) == "host0"
        # The root namespace cannot reach a test address: the subnet is blackholed there.
        with pytest.raises(OSError, match="Invalid argument"):
            socket.create_connection((hosts[0].address, 7000), timeout=2).close()
        assert hosts.leaks() == []


def test_own_name_on_loopback() -> None:
    with TestHosts(2, own_name="loopback", prefix="node") as hosts:
        name, own, other = hosts[0].run([PY, "-c", RESOLVE, "node1"]).stdout.split()
        assert (name, own, other) == ("node0", "127.0.1.1", hosts[1].address)


def test_leaks_are_found() -> None:
    """A socket on an address beyond the test subnet, inside a namespace and outside, and a route
    beyond the subnet: each is reported (nothing is sent; the address is only bound)."""
    # IP_FREEBIND lets a socket bind an address no interface holds (TEST-NET-2: never routed).
    bind = (
        "import socket, time; s = socket.socket(); s.setsockopt(socket.IPPROTO_IP, 15, 1)\n"
        "s.bind(('198.51.100.7', 7001)); s.listen(); print('bound', flush=True); time.sleep(60)\n"
    )
    with TestHosts(2) as hosts:
        inside = hosts[1].popen([PY, "-c", bind])
        wait_for(inside, "bound", inside.log)
        found = hosts.leaks()
        assert len(found) == 1 and found[0].startswith("host1:") and "198.51.100.7:7001" in found[0], found
        inside.kill()
        inside.wait()
        outside = subprocess.Popen([PY, "-c", bind], stdout=subprocess.PIPE, text=True)
        try:
            assert outside.stdout is not None and outside.stdout.readline().strip() == "bound"
            found = hosts.leaks()
            assert len(found) == 1 and "outside the test hosts" in found[0] and "198.51.100.7" in found[0], found
        finally:
            outside.kill()
            outside.wait()
        subprocess.run(["ip", "-n", hosts[0].namespace, "route", "add", "198.51.100.0/24", "dev", "eth0"], check=True)
        found = hosts.leaks()
        assert len(found) == 1 and "host0 has a route beyond the test subnet" in found[0], found


def test_faults() -> None:
    with TestHosts(3) as hosts:
        for h in hosts:
            server = h.popen([PY, "-c", SERVE])
            wait_for(server, "listening", server.log)
        # A cut link: the host reaches nobody and nobody reaches it (silently: a timeout).
        hosts.cut(0)
        assert ask(hosts, 1, 0) == "TimeoutError" and ask(hosts, 0, 2) == "TimeoutError"
        assert ask(hosts, 1, 2) == "host2"
        hosts.restore(0)
        assert ask(hosts, 1, 0) == "host0"
        # A partition of hosts 0 and 2: both still reach host 1, and host 1 both of them.
        hosts.partition(0, 2)
        assert ask(hosts, 0, 2) == ask(hosts, 2, 0) == "OSError22"  # EINVAL: the blackhole route
        others = [ask(hosts, 0, 1), ask(hosts, 2, 1), ask(hosts, 1, 0), ask(hosts, 1, 2)]
        assert others == ["host1", "host1", "host0", "host2"]
        hosts.heal(0, 2)
        assert [ask(hosts, 0, 2), ask(hosts, 2, 0)] == ["host2", "host0"]
        # A flapping link goes down period after period, and is up when the flapping ends.
        flap = hosts.flap(1, period=0.3, duration=1.5)
        flap.join()
        assert flap.changes >= 2
        assert ask(hosts, 0, 1) == "host1"
        assert hosts.leaks() == []


def test_rate_limit() -> None:
    """2 MB through a link limited to 4 Mbit/s take at least 3 s (4 s at the rate, less a burst)."""
    sink = (
        "import socket\n"
        "s = socket.socket(); s.bind(('0.0.0.0', 7002)); s.listen(); print('listening', flush=True)\n"
        "c, _ = s.accept(); n = 0\n"
        "while (b := c.recv(65536)): n += len(b)\n"
        "print('received', n, flush=True)\n"
    )
    send = (
        "import socket, sys, time; t = time.monotonic()\n"
        "with socket.create_connection((sys.argv[1], 7002)) as c:\n"
        "    c.sendall(bytes(2_000_000)); c.shutdown(socket.SHUT_WR); c.recv(1)\n"
        "print(time.monotonic() - t)\n"
    )
    with TestHosts(2) as hosts:
        hosts.limit_rate(0, 4_000_000)
        receiver = hosts[0].popen([PY, "-c", sink])
        wait_for(receiver, "listening", receiver.log)
        seconds = float(hosts[1].run([PY, "-c", send, "host0"], timeout=120).stdout)
        receiver.wait(timeout=60)
        assert "received 2000000" in receiver.output()
        assert seconds >= 3.0, seconds
        hosts.unlimit_rate(0)


def test_teardown_and_a_killed_owner(tmp_path: Path) -> None:
    """close() leaves nothing behind; what a SIGKILLed owner left (its hosts and a process on one)
    is removed by the next start."""
    with TestHosts(2) as hosts:
        hosts[0].popen([PY, "-c", "import time; time.sleep(600)"])
    assert ours(os.getpid()) == ""
    owner_script = (
        "import sys, time\n"
        "from gang.testing import TestHosts\n"
        "hosts = TestHosts(2).start()\n"
        "p = hosts[1].popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(p.pid, flush=True); time.sleep(600)\n"
    )
    owner = subprocess.Popen([PY, "-c", owner_script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    orphan = int(owner.stdout.readline())
    assert ours(owner.pid) != ""
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert ours(owner.pid) != "" and Path(f"/proc/{orphan}").exists()  # left behind
    removed = clean_up_dead_owners()
    assert any(f"gth{owner.pid}" in line for line in removed), removed
    assert ours(owner.pid) == ""
    deadline = time.monotonic() + 30
    while Path(f"/proc/{orphan}").exists() and "Z" not in Path(f"/proc/{orphan}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the left process still runs"
        time.sleep(0.05)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"`n` must be between 1 and 200, but is 0 instead\."):
        TestHosts(0)
    with pytest.raises(TypeError, match="`n` must be an `int`"):
        TestHosts(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`own_name` must be"):
        TestHosts(2, own_name="nowhere")  # type: ignore[arg-type]
