"""One process of the JAX dead-peer scenario (run as a script by test_jax_faults.py).

``python jax_dead_peer.py RANK SIZE PORT VICTIM TIMEOUT_S``: every rank all-reduces in a loop;
the victim ``os._exit(3)``s after a few steps. A survivor whose all-reduce raises prints
``GANGERROR: <message>`` on stdout and then closes its gang (what a careful user does).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

from gang import GangError, ReduceOperation
from gang_jax import JaxGang

VICTIM_EXIT = 3


def main() -> None:
    rank, size, port, victim, timeout_s = (int(a) for a in sys.argv[1:6])
    g = JaxGang.create_default(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=size,
        process_id=rank,
        timeout=timedelta(seconds=timeout_s),
    )
    print("READY", flush=True)
    t = torch.ones(4)
    step = 0
    while True:
        if rank == victim and step == 5:
            os._exit(VICTIM_EXIT)
        try:
            g.all_reduce(t.fill_(1.0), ReduceOperation.SUM)
        except GangError as ex:
            print(f"GANGERROR: {ex}", flush=True)
            g.close()
            print("CLOSED", flush=True)
            return
        step += 1


if __name__ == "__main__":
    main()
