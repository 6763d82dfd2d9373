"""One process of the JAX dead-peer scenarios (run as a script by test_jax_faults.py).

``python jax_dead_peer.py RANK SIZE PORT VICTIM TIMEOUT_S [isolated [handles]]``: every rank
all-reduces in a loop and prints ``STEP n`` as it goes; with ``handles`` each step is instead a
``send_recv`` ring shift started with ``async_op=True``, whose ``wait()`` is where a failure shows.

- In-process (default): the victim ``os._exit(3)``s after a few steps. A survivor whose
  all-reduce raises prints ``GANGERROR: <message>`` and ``CAUSE: <type of its __cause__>`` on
  stdout and then closes its gang.
- ``isolated``: the gang runs JAX in a child process; the test SIGKILLs the victim. A survivor
  prints ``GANGERROR: <message>`` when its pending all-reduce fails, ``NEXT: <message>`` when the
  next one fails too, closes the gang, shows that its process goes on (``ALIVE``) and exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch

from gang import GangError, ReduceOperation
from gang_jax import JaxGang

VICTIM_EXIT = 3


def main() -> None:
    rank, size, port, victim, timeout_s = (int(a) for a in sys.argv[1:6])
    isolated = sys.argv[6:7] == ["isolated"]
    handles = sys.argv[7:8] == ["handles"]
    g = JaxGang.create_default(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=size,
        process_id=rank,
        timeout=timedelta(seconds=timeout_s),
        isolated=isolated,
    )
    print("READY", flush=True)
    t = torch.ones(4)
    step = 0
    while True:
        if rank == victim and step == 5 and not isolated:
            os._exit(VICTIM_EXIT)
        try:
            if handles:
                received = torch.empty(4)
                ring = [(t.fill_(1.0), (rank + 1) % size)], [(received, (rank - 1) % size)]
                g.send_recv(*ring, async_op=True).wait()
            else:
                g.all_reduce(t.fill_(1.0), ReduceOperation.SUM)
        except GangError as ex:
            failed_at = time.monotonic()
            print(f"GANGERROR: {ex}", flush=True)
            print(f"CAUSE: {type(ex.__cause__).__name__}", flush=True)
            break
        step += 1
        print(f"STEP {step}", flush=True)
        if isolated:
            time.sleep(0.05)  # keep the log short while the test waits to kill the victim
    if isolated:
        try:
            g.all_reduce(t, ReduceOperation.SUM)
            print("NEXT: no error", flush=True)
        except GangError as ex:
            print(f"NEXT: {ex} (after {time.monotonic() - failed_at:.3f} s)", flush=True)
    g.close()
    print("CLOSED", flush=True)
    if isolated:
        # The process goes on: more work after the gang is gone.
        print(f"ALIVE {float(torch.arange(4.0).sum())}", flush=True)
        sys.exit(0)


if __name__ == "__main__":
    main()
