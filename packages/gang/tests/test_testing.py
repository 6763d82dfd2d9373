"""gang.testing: real processes, results in rank order, remote failures re-raised, no orphans."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
from core_workers import fail_on, outside_loopback, raise_worker_only, rank_and_pid, sleep_forever

from gang.testing import RemoteTraceback, World, launch, non_loopback_sockets, spawn


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); check its state.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_spawn_returns_results_in_rank_order_and_leaves_no_process() -> None:
    results = spawn(rank_and_pid, 3, "x")
    assert [r[0] for r in results] == [0, 1, 2]
    assert all(r[2] == "x" for r in results)
    assert len({r[1] for r in results}) == 3
    assert not any(_alive(pid) for _, pid, _ in results)


def test_remote_failure_is_reraised_with_rank_and_traceback() -> None:
    with World(3) as world:
        pids = [pid for _, pid, _ in world.run(rank_and_pid, "")]
        with pytest.raises(KeyError, match="bad things on 2") as info:
            world.run(fail_on, 2)
        assert not world.alive
    assert "raised on rank 2 of 3 while running fail_on" in " ".join(getattr(info.value, "__notes__", []))
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and cause.rank == 2
    assert "bad things on 2" in cause.text and "core_workers.py" in cause.text
    # Every other rank (blocked in the barrier) was stopped.
    assert not any(_alive(pid) for pid in pids)


def test_timeout_stops_every_rank() -> None:
    world = World(2)
    pids = [pid for _, pid, _ in world.run(rank_and_pid, "")]
    with pytest.raises(TimeoutError, match=r"Rank\(s\) \[0, 1\] did not finish sleep_forever within 2"):
        world.run(sleep_forever, timeout=2)
    assert not world.alive
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="stopped"):
        world.run(rank_and_pid, "")


def test_what_cannot_be_pickled_or_unpickled_gives_a_clear_error() -> None:
    with World(1) as world:
        with pytest.raises(ValueError, match="picklable"):
            world.run(lambda g: g)
        # A remote exception that cannot be rebuilt here still names itself, with the remote traceback.
        with pytest.raises(RuntimeError, match=r"^WorkerOnlyError: made on rank 0\b") as info:
            world.run(raise_worker_only)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "could not be unpickled here" in notes and "raised on rank 0 of 1" in notes, notes
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and cause.rank == 0
    assert "WorkerOnlyError: made on rank 0" in cause.text and "core_workers.py" in cause.text
    with pytest.raises(ValueError, match="`world_size`"):
        World(0)
    with pytest.raises(ValueError, match=r"`start_timeout` must be positive, but is 0 instead\."):
        World(1, start_timeout=0)


def test_remote_traceback_pickles() -> None:
    rt = pickle.loads(pickle.dumps(RemoteTraceback(1, "tb")))
    assert isinstance(rt, RemoteTraceback)


CALLER = """
from core_workers import rank_and_pid, sleep_forever
from gang.testing import World

world = World(2)
print(" ".join(str(pid) for _, pid, _ in world.run(rank_and_pid, "")), flush=True)
world.run(sleep_forever, timeout=600)
"""


def test_workers_end_when_their_caller_is_killed() -> None:
    # The workers are forked by a fork server, not by the caller. A caller killed while they are
    # busy (so that they do not read their end of the pipe) still takes them down: the fork server
    # ends with its last client, and the workers watch their parent.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    caller = subprocess.Popen([sys.executable, "-c", CALLER], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert caller.stdout is not None
        pids = [int(pid) for pid in caller.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    finally:
        caller.kill()
        caller.wait()
    try:
        # Polled until gone; the harness timeout bounds the wait.
        while any(_alive(pid) for pid in pids):
            time.sleep(0.1)
    finally:
        for pid in filter(_alive, pids):  # only after a failure
            os.kill(pid, signal.SIGKILL)


def test_workers_see_the_callers_environment_as_it_is_when_the_world_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fork server keeps the environment it started with; a world passes on the caller's own.
    launch(os.getpid, 1)  # the fork server runs from here on
    monkeypatch.setenv("GANG_TESTING_PROBE", "set after the fork server started")
    monkeypatch.delenv("GANG_DEBUG", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert launch(os.getenv, 1, "GANG_TESTING_PROBE") == ["set after the fork server started"]
    with World(1, init_gang=False, env={"OMP_NUM_THREADS": "3"}) as world:
        assert world.run(os.getenv, "OMP_NUM_THREADS") == ["3"]  # `env` wins over the caller's


def test_a_world_stays_on_loopback() -> None:
    # Its store listens on 127.0.0.1 only, and a process whose sockets reach beyond loopback fails
    # the world's start (checked in every process once its gang is up).
    with World(2) as world:
        assert world.run(outside_loopback) == [[], []]
        assert non_loopback_sockets(os.getpid()) == []  # the world's store, served here
    with pytest.raises(ValueError, match=r"`env\['MASTER_ADDR'\]` must be a loopback address, but is '192.0.2.1'"):
        World(1, env={"MASTER_ADDR": "192.0.2.1"})
