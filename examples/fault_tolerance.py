"""Fault-tolerant data-parallel training with :mod:`gang.ft`: the job goes on when a replica dies.

As a replica (``GANG_FT_STORE`` and ``GANG_FT_REPLICA_ID`` set, as a launcher of the replica sets
them): :func:`train` joins the job and trains until the job has taken ``--steps`` committed steps
with every replica in the quorum (and, with ``--done``, that file exists).

Run as is (``python examples/fault_tolerance.py``): :func:`run_local_job` starts the coordination
store and 3 replicas of this file on this machine, ``SIGKILL``\\ s replica 2 after a few steps, starts
it again a few steps later, and checks that it healed and that every replica finished with
bit-identical parameters. Every move waits for an event (a line of a replica, a process's exit),
never for a time, and the training ends only once the launcher, having seen the restarted replica
in a quorum of 3, creates the ``--done`` file: however slow the machine, replica 2 is killed while
it trains and the job cannot end without it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import tempfile
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
TIMEOUT = timedelta(seconds=60)
"""The replicas' ``timeout`` and ``quorum_timeout``: a killed replica is known dead at once (its
death signal), so these only bound a stuck collective or a replica that does not join; short ones
would make a loaded machine's slow process look stuck (a quorum of fewer than ``min_replicas``
gives up)."""


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


def train(steps: int, pace: float, done: Path | None = None) -> None:
    """Train until ``steps`` steps are committed, every replica is back in the quorum and (with
    ``done``) that file exists on some member: the members decide it together in the step."""
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
        timeout=TIMEOUT,
    )
    quorum: tuple[str, ...] = ()
    with gang:
        finished = False
        while not finished:
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
                stop = torch.tensor([float(done is None or done.exists())])
                gang.all_reduce(stop, ReduceOperation.MAX)  # the same answer on every member
                committed = gang.should_commit()  # False on every member if any collective failed
                if committed:
                    optimizer.step()
                    finished = bool(stop) and gang.step_number >= steps and gang.size == REPLICAS
            if committed and gang.rank == 0 and gang.step_number % 5 == 0:
                print(f"step {gang.step_number:3d}  loss {mean_loss.item():.4f}  ({gang.size} replicas)")
            elif not committed:
                print(f"step {gang.step_number + 1} not committed: {gang.errored()}")
    print(f"final step {gang.step_number} parameters {fingerprint(model)}")


def run_local_job(*, steps: int = 24, kill_at: int = 6, restart_at: int = 12, pace: float = 0.05) -> None:
    """Run the store and 3 replicas locally; kill replica 2 ``kill_at`` committed steps after all 3
    first train together (at step ``kill_at`` when they start together), restart it at
    ``restart_at`` steps after that point, and end the training once it is back in a quorum of 3."""
    with tempfile.TemporaryDirectory(prefix="fault_tolerance.") as tmp, LocalJob() as job:
        done = Path(tmp) / "done"
        store = job.start_store()
        args = [__file__, "--steps", str(steps), "--pace", str(pace), "--done", str(done)]

        def start(replica: int) -> None:
            job.start(f"replica {replica}", args, {"GANG_FT_STORE": store, "GANG_FT_REPLICA_ID": str(replica)})

        def reached(step: int) -> None:
            job.expect(lambda line: _step_of(line.text) >= step)

        for replica in range(REPLICAS):
            start(replica)
        # Every replica takes part (two may have started without a slow third: min_replicas=2).
        everyone = _step_of(job.expect(matching(r"quorum .* of 3$", "replica 2")).text)
        reached(everyone + kill_at)
        job.say("=== SIGKILL replica 2")
        job.kill("replica 2")
        if job.returncode("replica 2") != -signal.SIGKILL:  # it cannot have ended: `done` does not exist
            raise RuntimeError(f"replica 2 ended before the kill, with status {job.returncode('replica 2')}")
        job.expect(matching(r"quorum \['0', '1'\]", "replica 0"))  # the survivors go on without it
        reached(everyone + restart_at)
        job.say("=== starting replica 2 again")
        start(2)
        job.expect(matching(r"quorum .* of 3$", "replica 2"))  # healed and back in the quorum
        done.touch()  # the training may end (at step `steps` at the earliest)
        final = job.expect_same_ending("final step", [f"replica {replica}" for replica in range(REPLICAS)])
    print(f"=== every replica finished with the same parameters: {final}")


def _step_of(text: str) -> int:
    """The step of a line ``step N  loss ...`` (committed) or ``quorum [...] at step N: ...``, else -1."""
    if text.startswith("quorum "):
        return number_after("step", text.partition(" at ")[2].replace(":", " "))
    return number_after("step", text) if "  loss " in text else -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds of simulated compute per step")
    parser.add_argument("--done", type=Path, help="a file that ends the training once every replica trains")
    args = parser.parse_args()
    if "GANG_FT_STORE" in os.environ:
        train(args.steps, args.pace, args.done)
    else:
        run_local_job(steps=args.steps, pace=args.pace)


if __name__ == "__main__":
    main()
