"""Quickstart: the same function on a simulated gang and on 4 real local processes.

Run it directly (``python examples/quickstart.py``), or under a launcher
(``torchrun --nproc-per-node 4 examples/quickstart.py``): ``create_default_gang`` picks a
``FakeGang`` for one process and a real ``ProcessGroupGang`` otherwise.
"""

from __future__ import annotations

import torch

from gang import FakeGang, Gang, ReduceOperation, create_default_gang, get_world_size
from gang.testing import spawn


def average_loss(gang: Gang, local_loss: float) -> float:
    """Average a per-rank loss over the gang: written once, runs anywhere."""
    loss = torch.tensor([local_loss], device=gang.device)
    gang.all_reduce(loss, ReduceOperation.MEAN)
    return float(loss.item())


def per_rank(gang: Gang) -> float:
    return average_loss(gang, local_loss=float(gang.rank))


def main() -> None:
    if get_world_size() > 1:  # launched by torchrun/SLURM: one real gang per process
        with create_default_gang(torch.device("cpu")) as gang:
            print(f"rank {gang.rank}: mean loss {per_rank(gang)}")
        return

    # One process: simulate rank 2 of 4 (every simulated rank holds the same data).
    print("FakeGang(rank=2, size=4):", average_loss(FakeGang(torch.device("cpu"), rank=2, size=4), 1.5))

    # Four real processes with gloo: losses 0, 1, 2, 3 average to 1.5 on every rank.
    results = spawn(per_rank, 4)
    print("4 real ranks:", results)
    assert results == [1.5] * 4


if __name__ == "__main__":
    main()
