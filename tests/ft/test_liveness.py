"""gang.ft's death signal (:mod:`gang.ft.liveness`) on real processes and real sockets."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from gang.ft import liveness
from gang.ft.liveness import Liveness

# A process that listens, prints its address, waits for its watcher, then forks a child that
# sleeps (as a data-loader worker does, holding copies of every socket), prints the child's pid
# and serves until it is killed.
_WATCHED = """
import os, sys, time
from gang.ft.liveness import Liveness
me = Liveness("127.0.0.1", "watched")
print(me.address, flush=True)
while me.watchers == 0:
    me.serve()
    time.sleep(0.01)
child = os.fork()
if child == 0:
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
while True:
    me.serve()
    time.sleep(0.01)
"""


def _until(check: Callable[[], bool], limit: float = 30.0) -> bool:
    """Poll ``check()`` until it is true or ``limit`` seconds passed; return its last answer."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.01)
    return False


def _served(liveness: Liveness) -> int:
    liveness.serve()
    return liveness.watchers


@pytest.fixture
def watched() -> Iterator[tuple[subprocess.Popen[str], Liveness, int]]:
    proc = subprocess.Popen([sys.executable, "-c", _WATCHED], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    me = Liveness("127.0.0.1", "watcher")
    me.watch(address, "watched")
    child = int(proc.stdout.readline())
    yield proc, me, child
    me.close()
    for pid in (proc.pid, child):
        subprocess.run(["kill", "-9", str(pid)], check=False, capture_output=True)
    proc.wait()


def test_a_killed_process_is_seen_dead_and_a_stopped_one_is_not(
    watched: tuple[subprocess.Popen[str], Liveness, int],
) -> None:
    proc, me, _ = watched
    assert not me.died()
    # Stopped: its sockets stay open, so only its heartbeat can tell.
    proc.send_signal(signal.SIGSTOP)
    time.sleep(0.3)
    assert not me.died()
    proc.send_signal(signal.SIGCONT)
    # Killed: its child, forked while the connection was open, closed its copy at the fork, so
    # the connection ends with the process.
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _until(me.died)
    assert not me.died()  # reported once, then nothing is watched


def test_only_the_end_of_a_connection_that_greeted_as_expected_is_a_death() -> None:
    me, other = Liveness("127.0.0.1", "me"), Liveness("127.0.0.1", "other")
    try:
        port = int(other.address.rpartition(":")[2])
        other.close()  # nobody listens there any more: the connection is refused
        me.watch(f"127.0.0.1:{port}", "other")
        assert not _until(me.died, limit=0.3)
        me.watch("-")
        assert not me.died()
        # Something else listens at the address (a port taken over by another program, an
        # address not reachable as published): it accepts, then closes the connection.
        with socket.create_server(("127.0.0.1", 0)) as stranger:
            me.watch(f"127.0.0.1:{stranger.getsockname()[1]}", "other")
            conn, _ = stranger.accept()
            conn.close()
            assert not _until(me.died, limit=0.3)
        # Another incarnation listens there: its greeting is not the one expected.
        third = Liveness("127.0.0.1", "third")
        me.watch(third.address, "other")
        assert _until(lambda: _served(third) == 1)
        third.close()
        assert not _until(me.died, limit=0.3)
        # The network resets the connection (the watched side's end closes, the process lives):
        # connecting again is greeted, so it is no death, and the watch goes on.
        fifth = Liveness("127.0.0.1", "fifth")
        me.watch(fifth.address, "fifth")
        assert _until(lambda: _served(fifth) == 1)
        assert not _until(lambda: _served(fifth) < 0 or me.died(), limit=0.3)  # greeted
        for conn in fifth._accepted:  # as a middlebox that resets an idle connection would
            conn.close()
        fifth._accepted.clear()
        assert not _until(lambda: _served(fifth) < 0 or me.died(), limit=0.5)
        assert fifth.watchers == 1  # the watch goes on over a new connection
        fifth.close()
        assert _until(me.died)  # now nobody listens: refused
        # A watcher that goes away (a new quorum) is closed on the watched side at its next serve.
        fourth = Liveness("127.0.0.1", "fourth")
        me.watch(fourth.address, "fourth")
        assert _until(lambda: _served(fourth) == 1)
        me.watch(None)
        assert _until(lambda: _served(fourth) == 0)
        fourth.close()
    finally:
        me.close()


def test_a_confirming_connect_refused_at_once_is_a_death(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where a refused connect is answered by the call itself (not on Linux's loopback, where it is
    # in progress first), the confirming connect alone tells the death: the test-only seam waits
    # for the kernel's answer, so the only refusal `died()` can see is the confirming connect's own.
    monkeypatch.setattr(liveness, "_connect_wait", 5.0)
    me, other = Liveness("127.0.0.1", "me"), Liveness("127.0.0.1", "other")
    try:
        me.watch(other.address, "other")
        assert _until(lambda: _served(other) == 1)
        assert not _until(lambda: _served(other) < 0 or me.died(), limit=0.3)  # greeted, connected
        other.close()
        assert _until(me.died)
        assert not me.died()  # reported once, then nothing is watched
    finally:
        me.close()
        other.close()
