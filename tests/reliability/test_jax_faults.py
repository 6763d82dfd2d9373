"""A dead peer on a JaxGang: what every survivor sees, on real processes, in-process and isolated.

JAX 0.10.2 gives no Python-level way to survive a dead peer: its coordination service notices the
missing heartbeats and terminates every other process of the job (SIGABRT). What gang_jax
controls is *when* (the gang's ``timeout`` is JAX's heartbeat timeout) and that survivors whose
collective talks to the dead process get a :class:`~gang.GangError` first. This test checks
exactly that: no survivor hangs (the harness timeout bounds the run), every survivor ends with
SIGABRT and JAX's message naming the dead task, and the victim's neighbours saw a GangError
naming the operation, their rank and the size, with the backend's exception chained as its cause.

With ``isolated=True`` JAX runs in a child process of each rank; the test SIGKILLs one rank and
checks that every survivor's pending all-reduce (or the ``wait()`` of its pending ``send_recv``
handle) and its next all-reduce raise a GangError, that the survivor
closes its gang and exits 0 on its own, and that no child process outlives its rank.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gang.testing import free_port

WORKER = Path(__file__).parent / "jax_dead_peer.py"
HUNG_WORKER = Path(__file__).parent / "jax_hung_peer.py"
HUNG_TIMEOUT_S = 5.0  # the gang's timeout in the hung-peer scenario
HUNG_LATE_S = 15.0  # how late its last rank is (past the timeout, short of JAX's five-minute shutdown wait)
HUNG_MARGIN_S = 15.0  # how long past the timeout a waiting rank may take to fail (the machine is loaded)
TIMEOUT_S = 3  # the gang's timeout, hence JAX's heartbeat timeout
START_TIMEOUT_S = 600  # starting 4 ranks and their JAX children took over 4 minutes under heavy load
ISOLATED_TIMEOUT_S = 20  # also bounds the rendezvous of the children, which start slowly on a loaded machine
HARNESS_TIMEOUT_S = 240  # generous bound on the whole scenario (slow start-up on a loaded machine): a hang fails here


def _start(size: int, victim: int, *extra: str, timeout_s: int = TIMEOUT_S) -> list[subprocess.Popen[str]]:
    port = free_port("127.0.0.1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(size), str(port), str(victim), str(timeout_s), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(size)
    ]


def _finish(procs: list[subprocess.Popen[str]], before: list[str] | None = None) -> list[tuple[int, str, str]]:
    """Wait for every process (bounded by the harness timeout); kill what is left; return (code, out, err)."""
    outputs: list[tuple[int, str, str]] = []
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=HARNESS_TIMEOUT_S)
            outputs.append((p.returncode, (before[i] if before else "") + out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def _isolated_children(parents: set[int]) -> list[str]:
    """The isolated JAX child processes (``child_main``) still running for any of ``parents``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"child_main" in a for a in argv) and argv[-2:-1] and argv[-2].isdigit() and int(argv[-2]) in parents:
            found.append(f"pid {entry.name}: {b' '.join(argv).decode(errors='replace')}")
    return found


@pytest.mark.parametrize("size", [2, 4])
def test_dead_peer_terminates_every_survivor_promptly(size: int) -> None:
    victim = size - 1
    outputs = _finish(_start(size, victim))

    code, out, _ = outputs[victim]
    assert code == 3 and "READY" in out, outputs[victim]
    saw_gang_error = 0
    for rank, (code, out, err) in enumerate(outputs[:victim]):
        where = f"rank {rank}: exit {code}\nstdout:\n{out}\nstderr (tail):\n{err[-3000:]}"
        assert "READY" in out, where
        # JAX's coordination service ends every survivor: SIGABRT, with its message naming the dead task.
        assert code == -signal.SIGABRT, where
        assert "Terminating process because the JAX distributed service detected fatal errors" in err, where
        assert f"Task {victim} heartbeat timeout" in err, where
        if "GANGERROR:" in out:
            assert f"`all_reduce` failed on rank {rank} of a gang of size {size}" in out, where
            if "did not complete within the gang's timeout of" in out:
                continue  # the gang's own timeout came before gloo's error (a rank not next to the victim)
            saw_gang_error += 1
            assert "Gloo" in out, where
            # The backend's exception is chained as the cause, not swallowed (JAX raises a RuntimeError kin).
            assert "CAUSE: " in out and "CAUSE: NoneType" not in out, where
    # At least one of the victim's direct peers in the collective got gloo's exception first.
    assert saw_gang_error >= 1, outputs


@pytest.mark.parametrize(("size", "how"), [(2, "blocking"), (4, "blocking"), (2, "handles")])
def test_isolated_survivors_get_gang_error_and_go_on(size: int, how: str) -> None:
    # "handles": the pending operation is a send_recv started with async_op=True; its wait() raises.
    victim = size - 1
    procs = _start(size, victim, "isolated", how, timeout_s=ISOLATED_TIMEOUT_S)
    before = [""] * size
    try:
        # Kill the victim (a real SIGKILL) once it has run a few collectives with everyone.
        deadline = time.monotonic() + START_TIMEOUT_S
        stream = procs[victim].stdout
        assert stream is not None
        while "STEP 3" not in before[victim]:
            assert time.monotonic() < deadline and procs[victim].poll() is None, before[victim]
            if select.select([stream], [], [], 1.0)[0]:
                before[victim] += stream.readline()
        os.kill(procs[victim].pid, signal.SIGKILL)
    finally:
        outputs = _finish(procs, before)

    code, out, _ = outputs[victim]
    assert code == -signal.SIGKILL, outputs[victim]
    for rank, (code, out, err) in enumerate(outputs):
        if rank == victim:
            continue
        where = f"rank {rank}: exit {code}\nstdout:\n{out[-3000:]}\nstderr (tail):\n{err[-3000:]}"
        # The pending collective fails, so does the next one, and the process closes the gang and goes on.
        assert code == 0, where
        pending = "send_recv" if how == "handles" else "all_reduce"
        assert f"GANGERROR: `{pending}` failed on rank {rank} of a gang of size {size}" in out, where
        assert f"NEXT: `all_reduce` failed on rank {rank} of a gang of size {size}" in out, where
        assert "CLOSED" in out and "ALIVE 6.0" in out, where
    # No JAX child outlives its rank (the victim's died with it, the survivors' were reaped).
    time.sleep(0.5)
    assert _isolated_children({p.pid for p in procs}) == []


@pytest.mark.parametrize(("size", "when"), [(2, "warm"), (3, "first")])
def test_in_process_hung_peer_is_a_gang_error_and_every_rank_exits_normally(size: int, when: str) -> None:
    # An in-process gang: a rank alive but late past the timeout (on the gang's first call too) gives
    # every waiting rank a GangError within the timeout plus a margin; the gang is broken (the next
    # call fails too); every process, the late one included, closes its gang and exits 0: no SIGABRT
    # from JAX's coordination service at shutdown, no stuck XLA thread keeping a process alive.
    port = free_port("127.0.0.1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    args = [str(HUNG_TIMEOUT_S), str(HUNG_LATE_S), when]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HUNG_WORKER), str(rank), str(size), str(port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(size)
    ]
    outputs = _finish(procs)
    for rank, (code, out, err) in enumerate(outputs):
        where = f"rank {rank}: exit {code}\nstdout:\n{out[-3000:]}\nstderr (tail):\n{err[-3000:]}"
        assert code == 0 and "EXIT" in out, where
        if rank == size - 1:
            assert "LATE: " in out, where
            continue
        assert f"GANGERROR: `all_reduce` failed on rank {rank} of a gang of size {size}" in out, where
        assert "did not complete within the gang's timeout of 5 s" in out, where
        after = float(out.split("AFTER ")[1].split()[0])
        assert after < HUNG_TIMEOUT_S + HUNG_MARGIN_S, where
        assert f"NEXT: `barrier` failed on rank {rank} of a gang of size {size}: the gang is broken" in out, where
