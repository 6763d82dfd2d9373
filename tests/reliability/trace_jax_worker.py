"""One rank of the JAX flight-recorder scenario (run as a script by test_trace.py).

``python trace_jax_worker.py RANK SIZE PORT VICTIM TIMEOUT_S DIR``: an isolated ``JaxGang`` split
into tp 2 x pp 2; three steps of a tp all-reduce and a pp exchange, then a barrier; in the last
step rank ``VICTIM`` skips its tp all-reduce. Prints ``GANGERROR: <message>`` when a collective
fails and ``DUMPED`` if this rank's dump exists afterwards.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch

import gang.trace
from gang import GangError, ReduceOperation, create_parallel_gangs
from gang_jax import JaxGang


def main() -> None:
    rank, size, port, victim, timeout_s = (int(a) for a in sys.argv[1:6])
    directory = sys.argv[6]
    gang.trace.set_trace_dir(directory)
    root = JaxGang.create_default(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=size,
        process_id=rank,
        timeout=timedelta(seconds=timeout_s),
        isolated=True,
    )
    gangs = create_parallel_gangs(root, tp_size=2, pp_size=2)
    try:
        for step in range(1, 4):
            t = torch.ones(4)
            if not (rank == victim and step == 3):
                gangs.tp.all_reduce(t, ReduceOperation.SUM)
            other = 1 - gangs.pp.rank
            gangs.pp.send_recv([(t, other)], [(torch.empty(4), other)])
        root.barrier()
        print("NO ERROR", flush=True)
    except GangError as ex:
        print(f"GANGERROR: {ex}", flush=True)
    if (Path(directory) / f"gang_trace_rank_{rank}").is_file():
        print("DUMPED", flush=True)
    root.close()


if __name__ == "__main__":
    main()
