"""Fault-tolerant data-parallel training with :mod:`gang.ft`: the job goes on when a replica dies.

As a replica (``GANG_FT_STORE`` and ``GANG_FT_REPLICA_ID`` set, as a launcher of the replica sets
them): :func:`train` joins the job and trains until the job has taken ``--steps`` committed steps
with every replica in the quorum.

Run as is (``python examples/fault_tolerance.py``): :func:`run_local_job` starts the coordination
store and 3 replicas of this file on this machine, ``SIGKILL``\\ s replica 2 after a few steps, starts
it again a few steps later, and checks that it healed and that every replica finished with
bit-identical parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional

from gang import ReduceOperation
from gang.ft import ReplicaGang

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ft_launch import LocalJob, matching, number_after

REPLICAS = 3
GLOBAL_BATCH = 24


def batch(step: int, rank: int, size: int) -> tuple[Tensor, Tensor]:
    """Return this replica's share of the global batch of ``step`` (the same global batch whatever the quorum)."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=generator)
    y = (x @ torch.linspace(-1, 1, 8).unsqueeze(1)).tanh()  # what the model learns
    share = torch.arange(GLOBAL_BATCH).tensor_split(size)[rank]
    return x[share], y[share]


def fingerprint(model: nn.Module) -> str:
    """Return a short hash of the parameters' bytes: equal on two replicas only if they are bit-identical."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


def train(steps: int, pace: float) -> None:
    """Train until ``steps`` steps are committed and every replica is back in the quorum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: Mapping[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    gang = ReplicaGang.join(
        device=torch.device("cpu"),
        state_dict=state_dict,
        load_state_dict=load_state_dict,
        min_replicas=2,
        timeout=timedelta(seconds=5),
    )
    quorum: tuple[str, ...] = ()
    with gang:
        while gang.step_number < steps or gang.size < REPLICAS:
            before = gang.step_number
            with gang.step():  # forms the quorum; heals this replica if it is behind
                if gang.step_number != before:
                    print(f"healed from a peer: step {before} -> {gang.step_number}")
                if gang.quorum != quorum:
                    quorum = gang.quorum
                    print(f"quorum {list(quorum)} at step {gang.step_number}: I am rank {gang.rank} of {gang.size}")
                x, y = batch(gang.step_number, gang.rank, gang.size)
                loss = functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                time.sleep(pace)  # the rest of a real model's forward and backward
                for param in model.parameters():
                    assert param.grad is not None
                    gang.all_reduce(param.grad, ReduceOperation.MEAN)
                mean_loss = loss.detach().reshape(1)
                gang.all_reduce(mean_loss, ReduceOperation.MEAN)
                committed = gang.should_commit()  # False on every member if any collective failed
                if committed:
                    optimizer.step()
            if committed and gang.rank == 0 and gang.step_number % 5 == 0:
                print(f"step {gang.step_number:3d}  loss {mean_loss.item():.4f}  ({gang.size} replicas)")
            elif not committed:
                print(f"step {gang.step_number + 1} not committed: {gang.errored()}")
    print(f"final step {gang.step_number} parameters {fingerprint(model)}")


def run_local_job(*, steps: int = 24, kill_at: int = 6, restart_at: int = 12, pace: float = 0.05) -> None:
    """Run the store and 3 replicas locally; kill replica 2 at step ``kill_at``, restart it at ``restart_at``."""
    with LocalJob() as job:
        store = job.start_store()
        args = [__file__, "--steps", str(steps), "--pace", str(pace)]

        def start(replica: int) -> None:
            job.start(f"replica {replica}", args, {"GANG_FT_STORE": store, "GANG_FT_REPLICA_ID": str(replica)})

        def reached(step: int) -> None:
            job.expect(lambda line: _step_of(line.text) >= step, timeout=120)

        for replica in range(REPLICAS):
            start(replica)
        job.expect(matching(r"quorum .* of 3$", "replica 2"), timeout=120)  # every replica takes part
        reached(kill_at)
        job.say("=== SIGKILL replica 2")
        job.kill("replica 2")
        reached(restart_at)
        job.say("=== starting replica 2 again")
        start(2)
        final = job.expect_same_ending("final step", [f"replica {replica}" for replica in range(REPLICAS)])
    print(f"=== every replica finished with the same parameters: {final}")


def _step_of(text: str) -> int:
    return number_after("step", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds of simulated compute per step")
    args = parser.parse_args()
    if "GANG_FT_STORE" in os.environ:
        train(args.steps, args.pace)
    else:
        run_local_job(steps=args.steps, pace=args.pace)


if __name__ == "__main__":
    main()
