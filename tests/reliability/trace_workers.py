"""Functions the flight-recorder tests run on every rank: a tp x pp x dp job where one rank goes wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import gang.trace
from gang import Gang, GangError, ReduceOperation, create_parallel_gangs

STEPS = 3  # the victim goes wrong in the last step


def desync(root: Gang, mode: str, directory: str, victim: int) -> dict[str, Any]:
    """Train ``STEPS`` steps of tp all-reduce, dp all-reduce and a pp exchange, then a world barrier.

    In the last step rank ``victim`` skips its tp all-reduce (``mode="skip"``) or calls it with
    another shape (``mode="shape"``). Returns the GangError this rank saw and whether it left a dump.
    """
    gang.trace.set_trace_dir(directory)
    gangs = create_parallel_gangs(root, tp_size=2, pp_size=2)
    error = None
    try:
        for step in range(1, STEPS + 1):
            t = torch.ones(4)
            odd = root.rank == victim and step == STEPS
            if not (odd and mode == "skip"):
                gangs.tp.all_reduce(torch.ones(3) if odd and mode == "shape" else t, ReduceOperation.SUM)
            gangs.dp.all_reduce(t, ReduceOperation.SUM)
            other = 1 - gangs.pp.rank
            gangs.pp.send_recv([(t, other)], [(torch.empty(4), other)])
        root.barrier()
    except GangError as ex:
        error = str(ex)
    return {"error": error, "dumped": (Path(directory) / f"gang_trace_rank_{root.rank}").is_file()}
