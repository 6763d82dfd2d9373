"""The flight recorder on real processes: one rank goes wrong, every rank dumps, both analyzers name it.

Each scenario runs a real job (gloo ``ProcessGroupGang`` ranks, isolated ``JaxGang`` ranks, or
``gang.ft`` replicas around a store process), lets the gangs' short timeouts turn the desync into
``GangError`` on every rank, then reads the directory of dumps with ``python -m gang.trace --json``
and with torch's own analyzer, ``python -m torch.distributed.flight_recorder.fr_trace``.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from trace_workers import desync

from gang.testing import World, free_port

HERE = Path(__file__).parent
TIMEOUT = 4.0  # the gangs' collective timeout, in seconds
HARNESS_TIMEOUT_S = 600  # a bound on each scenario's processes on a loaded machine: a hang fails here


def _gang_trace(directory: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "gang.trace", str(directory), "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=HARNESS_TIMEOUT_S,
    )
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


def _fr_trace(directory: Path, *extra: str) -> str:
    """torch's analyzer on the same files (it logs what it finds)."""
    module = "torch.distributed.flight_recorder.fr_trace"
    cmd = [sys.executable, "-m", module, str(directory), "-p", "gang_trace_rank_", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=HARNESS_TIMEOUT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def _check_tp_culprit(summary: dict[str, Any], victim: int, peer: int, stage: str, seq: int) -> None:
    first = summary["suspects"][0]
    assert first["rank"] == victim, summary["suspects"]
    assert first["gang"].startswith("tp of ") and stage in first["gang"], first
    assert first["seq"] == seq and first["operation"] == "all_reduce", first
    assert f"[{peer}]" in first["reason"], first


@pytest.mark.parametrize("mode", ["skip", "shape"])
def test_process_group_gang_desync(tmp_path: Path, mode: str) -> None:
    # 8 ranks, tp 2 x pp 2 x dp 2; in the last of 3 steps rank 5 (pp 1, dp 0, tp 1) skips its tp
    # all-reduce, or calls it with 3 elements instead of 4: its tp peer, rank 4, waits there.
    with World(8, gang_timeout=TIMEOUT) as world:
        reports = world.run(desync, mode, str(tmp_path), 5, timeout=HARNESS_TIMEOUT_S)
    for rank, report in enumerate(reports):
        assert report["error"] is not None, f"rank {rank} raised no GangError"
        assert report["dumped"], f"rank {rank} left no dump"
    summary = _gang_trace(tmp_path)
    assert sorted(summary["dumps"], key=int) == [str(r) for r in range(8)]
    _check_tp_culprit(summary, 5, 4, "pp 1", 3)
    tp = next(row for row in summary["gangs"] if row["gang"] == summary["suspects"][0]["gang"])
    assert tp["ranks"] == [4, 5]
    if mode == "skip":
        assert tp["behind"] == [{"rank": 5, "seq": 3, "operation": "all_reduce"}]
    else:
        assert "Float[3]" in tp["mismatches"][0]["calls"]["5"] and "Float[4]" in tp["mismatches"][0]["calls"]["4"]
    torch_says = _fr_trace(tmp_path)
    found = torch_says.split("group info: ")
    tp_block = next(b for b in found[1:] if b.split(":", 1)[1].startswith("tp of pp 1"))
    assert "sequence number: 3" in found[found.index(tp_block) - 1], torch_says
    assert "expected ranks: {4, 5}" in tp_block, tp_block
    if mode == "skip":
        assert "missing ranks: {5}" in tp_block, tp_block
    else:
        assert "SIZE_OR_SYNTAX_MISMATCH" in tp_block and "[[3]]" in tp_block and "[[4]]" in tp_block, tp_block


def _run_all(cmds: list[list[str]]) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for c in cmds]
    try:
        return [p.communicate(timeout=HARNESS_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_jax_gang_desync(tmp_path: Path) -> None:
    # 4 isolated JaxGang ranks, tp 2 x pp 2: rank 3 (pp 1, tp 1) skips its tp all-reduce in step 3.
    port = free_port("127.0.0.1")
    worker = str(HERE / "trace_jax_worker.py")
    outs = _run_all([[sys.executable, worker, str(r), "4", str(port), "3", "20", str(tmp_path)] for r in range(4)])
    for rank, out in enumerate(outs):
        assert "GANGERROR:" in out and "DUMPED" in out, f"rank {rank}:\n{out[-3000:]}"
    summary = _gang_trace(tmp_path)
    _check_tp_culprit(summary, 3, 2, "pp 1", 3)
    torch_says = _fr_trace(tmp_path)
    tp_block = next(b for b in torch_says.split("group info: ")[1:] if b.split(":", 1)[1].startswith("tp of pp 1"))
    assert "missing ranks: {3}" in tp_block and "expected ranks: {2, 3}" in tp_block, tp_block


def _wait_for(path: Path, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.monotonic() + HARNESS_TIMEOUT_S
    while not path.exists():
        assert proc is None or proc.poll() is None, f"{proc.args!r} ended first"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_replica_stuck_in_step(tmp_path: Path) -> None:
    # Three gang.ft replicas; replica 2 is stuck inside step 3 (its heartbeat goes on, so only the
    # gang's timeout ends the survivors' all-reduce). The survivors' dumps name it and the step.
    dumps = tmp_path / "dumps"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    port_file = tmp_path / "port"
    store_cmd = [sys.executable, "-m", "gang.ft.store", "--port", "0", "--host", "127.0.0.1", "--port-file"]
    store = subprocess.Popen([*store_cmd, str(port_file)], env=env)
    procs: list[subprocess.Popen[str]] = []
    try:
        _wait_for(port_file, store)
        address = port_file.read_text().strip()
        worker = str(HERE / "trace_ft_worker.py")
        for rid in "012":
            cmd = [sys.executable, worker, rid, address, str(dumps), "2", str(TIMEOUT)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
        survivors = [p.communicate(timeout=HARNESS_TIMEOUT_S)[0] for p in procs[:2]]
        for out in survivors:
            assert "ABORTED 3" in out and "DUMPED" in out, out[-3000:]
        assert sorted(p.name for p in dumps.iterdir()) == ["gang_trace_rank_0", "gang_trace_rank_1"]
        for rank in (0, 1):  # the collective the replica gang recorded as failed is marked so, with its error
            with (dumps / f"gang_trace_rank_{rank}").open("rb") as f:
                records = pickle.load(f)["gang"]["records"]
            last = [r for r in records if r["operation"] == "all_reduce"][-1]
            assert last["state"] == "failed" and f"replica '{rank}' in step 3" in last["error"], last
            assert [r["state"] for r in records if r["operation"] == "step"][-1] == "failed", records
        summary = _gang_trace(dumps)
        first = summary["suspects"][0]
        assert first["rank"] == 2 and first["gang"] == "replica gang at step 3", summary["suspects"]
        assert first["operation"] == "all_reduce" and "no dump" in first["reason"] and "step 3" in first["reason"]
        # On request: SIGUSR1 makes the stuck replica dump too; torch's analyzer then names it.
        procs[2].send_signal(signal.SIGUSR1)
        _wait_for(dumps / "gang_trace_rank_2", procs[2])
        torch_says = _fr_trace(dumps)
        assert "replica gang at step 3" in torch_says and "missing ranks: {2}" in torch_says, torch_says
        summary = _gang_trace(dumps)
        assert summary["suspects"][0]["rank"] == 2 and "never entered all_reduce" in summary["suspects"][0]["reason"]
    finally:
        everything: list[subprocess.Popen[Any]] = [*procs, store]
        for p in everything:
            if p.poll() is None:
                p.kill()
            p.wait()
