"""One process of the JAX hung-peer scenario (run as a script by test_jax_faults.py).

``python jax_hung_peer.py RANK SIZE PORT TIMEOUT_S LATE_S (warm|first)``: an in-process JaxGang
with ``timeout=TIMEOUT_S``. With ``warm`` every rank first makes one all-reduce together; then the
last rank sleeps ``LATE_S`` (alive: JAX's heartbeats go on) before its all-reduce, while the others
make theirs at once (with ``first`` that is the gang's very first call). A waiting rank prints
``GANGERROR: <message>`` and ``AFTER <seconds>`` when its call fails, ``NEXT: <message>`` when
the next call fails too, closes the gang and exits normally; the late rank prints ``LATE:
<outcome>`` and closes too. Every rank prints ``CLOSED`` and ``EXIT``.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch

from gang import GangError, ReduceOperation
from gang_jax import JaxGang


def main() -> None:
    rank, size, port = (int(a) for a in sys.argv[1:4])
    timeout_s, late_s = float(sys.argv[4]), float(sys.argv[5])
    warm = sys.argv[6] == "warm"
    g = JaxGang.create_default(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=size,
        process_id=rank,
        timeout=timedelta(seconds=timeout_s),
    )
    print("READY", flush=True)
    if warm:
        g.all_reduce(torch.ones(4), ReduceOperation.SUM)
    if rank == size - 1:
        time.sleep(late_s)
        try:
            g.all_reduce(torch.ones(4), ReduceOperation.SUM)
            print("LATE: ok", flush=True)
        except GangError as ex:
            print(f"LATE: {ex}", flush=True)
    else:
        start = time.monotonic()
        try:
            g.all_reduce(torch.ones(4), ReduceOperation.SUM)
            print("NO ERROR", flush=True)
        except GangError as ex:
            print(f"GANGERROR: {ex}", flush=True)
            print(f"AFTER {time.monotonic() - start:.1f}", flush=True)
        try:
            g.barrier()
            print("NEXT: no error", flush=True)
        except GangError as ex:
            print(f"NEXT: {ex}", flush=True)
    g.close()
    print("CLOSED", flush=True)
    print("EXIT", flush=True)


if __name__ == "__main__":
    main()
