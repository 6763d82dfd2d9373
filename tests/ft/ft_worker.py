"""One process of one replica in the gang.ft tests: trains the shared model until a step count.

Run as ``python ft_worker.py LOG STEPS`` with ``GANG_FT_REPLICA_ID``/``GANG_FT_STORE`` set. It
appends JSON lines to LOG: ``{"event": "joined"}``, ``{"event": "enter", "step": s}`` before each
step, ``{"event": "collective", "step": s}`` before the gradient exchange, one ``commit`` line with
the members and the parameters after every committed step, ``error`` when the gang raised, and
``done`` at the end. ``FT_PAUSE=<event>:<step>`` makes it report ``paused`` at that point and wait
until the file ``LOG.release`` exists (the harness kills or stops it there).
``FT_TIMEOUT`` and ``FT_MIN_REPLICAS`` set the gang's timeout and ``min_replicas``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from ft_model import gradient, initial_params, update

from gang import GangError, ReduceOperation
from gang.ft import ReplicaGang


class Replica:
    def __init__(self, log: Path) -> None:
        self.log = log
        self.params = initial_params()
        pause = os.environ.get("FT_PAUSE", "")
        self.pause_event, _, step = pause.partition(":")
        self.pause_step = int(step) if step else -1

    def emit(self, event: str, **fields: Any) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps({"event": event, "pid": os.getpid(), "t": round(time.time(), 3), **fields}) + "\n")

    def maybe_pause(self, event: str, step: int) -> None:
        if event == self.pause_event and step == self.pause_step:
            self.emit("paused", at=event, step=step)
            release = Path(str(self.log) + ".release")
            while not release.exists():
                time.sleep(0.01)
            self.pause_event = ""

    def state_dict(self) -> Mapping[str, Any]:
        self.maybe_pause("heal", -1)
        return {"params": self.params}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.params = state["params"].clone()
        self.emit("healed")


def main() -> None:
    log, steps = Path(sys.argv[1]), int(sys.argv[2])
    replica = Replica(log)
    rid = os.environ["GANG_FT_REPLICA_ID"]
    gang = ReplicaGang.join(
        state_dict=replica.state_dict,
        load_state_dict=replica.load_state_dict,
        timeout=timedelta(seconds=float(os.environ.get("FT_TIMEOUT", "3"))),
        min_replicas=int(os.environ.get("FT_MIN_REPLICAS", "1")),
    )
    replica.emit("joined")
    try:
        while gang.step_number < steps:
            replica.maybe_pause("enter", gang.step_number + 1)
            with gang.step():
                step = gang.step_number + 1
                replica.maybe_pause("collective", step)
                replica.emit("collective", step=step, members=list(gang.quorum))
                grad = gradient(replica.params, rid, step)
                table = torch.zeros(gang.size, grad.numel())
                gang.all_gather(table, grad)
                count = torch.tensor([1], dtype=torch.int64)
                gang.all_reduce(count, ReduceOperation.SUM)
                if gang.should_commit():
                    assert int(count) == gang.size, (int(count), gang.size)
                    replica.params = update(replica.params, table)
                    replica.emit(
                        "commit", step=gang.step_number, members=list(gang.quorum), params=replica.params.tolist()
                    )
                else:
                    replica.emit("abort", step=step, error=str(gang.errored()))
    except GangError as ex:
        replica.emit("error", error=str(ex))
        sys.stdout.flush()
        os._exit(3)
    gang.close()
    replica.emit("done", step=gang.step_number, params=replica.params.tolist())
    os._exit(0)


if __name__ == "__main__":
    main()
