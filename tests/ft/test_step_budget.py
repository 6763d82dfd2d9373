"""The bound on a step attempt: ``timeout + quorum_timeout`` of the gang's own time, all phases together.

Two one-process replicas on loopback (real processes, a real store, gloo). In one step, replica
``a`` runs its own code for 2.2 s before each of two collectives (its own time, which spends
nothing of its budget), so replica ``b`` waits about 2.2 s in each: either wait is shorter than
``timeout`` (3 s), but together they pass ``timeout + quorum_timeout`` (4 s). ``b``'s attempt
ends when its budget is spent, uncommitted on both; the next step commits. Both processes begin
their first step together (a file the test writes once both joined).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gang._torch_groups import TCPStore

TIMEOUT, QUORUM_TIMEOUT = 3.0, 1.0
SLACK = 1.0  # the watch interval and scheduling on a loaded machine

_REPLICA = """
import json, os, sys, time
from datetime import timedelta
import torch
from gang import ReduceOperation
from gang.ft import ReplicaGang

rid, store, timeout, quorum_timeout, go = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
params = torch.zeros(4)
gang = ReplicaGang.join(
    replica_id=rid, store=store, min_replicas=2, init_sync=False,
    state_dict=lambda: {"p": params}, load_state_dict=lambda s: params.copy_(s["p"]),
    timeout=timedelta(seconds=timeout), quorum_timeout=timedelta(seconds=quorum_timeout),
    heartbeat_timeout=timedelta(seconds=5),
)
print("joined", flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
for step in (1, 2, 3):
    slow = rid == "a" and step == 2
    began = time.monotonic()
    with gang.step():
        for _ in range(2):
            if slow:
                time.sleep(2.2)  # this replica's own code: the other one waits for it
            gang.all_reduce(torch.ones(4), ReduceOperation.SUM)
        committed = gang.should_commit()
    error = gang.errored()
    print(json.dumps({"step": step, "commit": committed, "seconds": time.monotonic() - began,
                      "error": None if error is None else str(error)}), flush=True)
gang.close()
"""


def test_a_step_attempt_ends_when_its_budget_is_spent(tmp_path: Path) -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address, go = f"127.0.0.1:{server.port}", tmp_path / "go"
    procs = {
        rid: subprocess.Popen(
            [sys.executable, "-c", _REPLICA, rid, address, str(TIMEOUT), str(QUORUM_TIMEOUT), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rid in ("a", "b")
    }
    for proc in procs.values():
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "joined", proc.stderr
    go.touch()
    out = {}
    for rid, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out[rid] = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    a, b = out["a"], out["b"]
    assert [s["commit"] for s in a] == [s["commit"] for s in b] == [True, False, True], (a, b)
    # b's waits (two collectives, each shorter than `timeout`) end with its budget.
    assert "is spent" in b[1]["error"], b[1]
    assert b[1]["seconds"] < TIMEOUT + QUORUM_TIMEOUT + SLACK, b[1]
