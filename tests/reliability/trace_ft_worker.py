"""One replica of the gang.ft flight-recorder scenario (run as a script by test_trace.py).

``python trace_ft_worker.py REPLICA_ID STORE DIR STUCK_ID TIMEOUT_S``: three one-process replicas
train three steps of one all-reduce each (``min_replicas=3``). Replica ``STUCK_ID`` is stuck inside
step 3, before its all-reduce: it prints ``STUCK`` and sleeps until killed (``SIGUSR1`` makes it
dump its recorder meanwhile). The others print ``ABORTED <step>`` when a step is not committed,
then close their gang; ``DUMPED`` if their dump exists.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

import gang.trace
from gang import ReduceOperation
from gang.ft import ReplicaGang


def main() -> None:
    replica_id, store, directory, stuck, timeout_s = sys.argv[1:6]
    gang.trace.set_trace_dir(directory)
    params = torch.zeros(4)

    def load(state: Any) -> None:
        params.copy_(state["params"])

    g = ReplicaGang.join(
        replica_id=replica_id,
        store=store,
        state_dict=lambda: {"params": params},
        load_state_dict=load,
        min_replicas=3,
        timeout=timedelta(seconds=float(timeout_s)),
        quorum_timeout=timedelta(seconds=300),  # the three replicas start slowly on a loaded machine
    )
    for step in range(1, 4):
        with g.step():
            if replica_id == stuck and step == 3:
                print("STUCK", flush=True)
                while True:
                    time.sleep(0.1)
            grad = torch.ones(4)
            g.all_reduce(grad, ReduceOperation.SUM)
            if g.should_commit():
                params.add_(grad)
            else:
                print(f"ABORTED {step}", flush=True)
                break
    g.close()
    if (Path(directory) / f"gang_trace_rank_{replica_id}").is_file():
        print("DUMPED", flush=True)


if __name__ == "__main__":
    main()
