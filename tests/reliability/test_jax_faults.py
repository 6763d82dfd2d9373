"""A dead peer on a JaxGang: what every survivor sees, on real processes.

JAX 0.10.2 gives no Python-level way to survive a dead peer: its coordination service notices the
missing heartbeats and terminates every other process of the job (SIGABRT). What gang_jax
controls is *when* (the gang's ``timeout`` is JAX's heartbeat timeout) and that survivors whose
collective talks to the dead process get a :class:`~gang.GangError` first. This test checks
exactly that: no survivor hangs (the harness timeout bounds the run), every survivor ends with
SIGABRT and JAX's message naming the dead task, and the victim's neighbours saw a GangError
naming the operation, their rank and the size.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gang_jax._rendezvous import free_port

WORKER = Path(__file__).parent / "jax_dead_peer.py"
TIMEOUT_S = 3  # the gang's timeout, hence JAX's heartbeat timeout
HARNESS_TIMEOUT_S = 90  # generous bound on the whole scenario: a hang fails the test here


@pytest.mark.parametrize("size", [2, 4])
def test_dead_peer_terminates_every_survivor_promptly(size: int) -> None:
    victim = size - 1
    port = free_port("127.0.0.1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(size), str(port), str(victim), str(TIMEOUT_S)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(size)
    ]
    outputs: list[tuple[int, str, str]] = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=HARNESS_TIMEOUT_S)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

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
            saw_gang_error += 1
            assert f"`all_reduce` failed on rank {rank} of a gang of size {size}" in out, where
            assert "Gloo" in out, where
    # At least the victim's direct peers in the collective got a Python exception first.
    assert saw_gang_error >= 1, outputs
