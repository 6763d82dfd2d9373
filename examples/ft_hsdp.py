"""HSDP across fault-tolerant replicas: FSDP2 inside each replica, :mod:`gang.ft` across them.

As a process of a replica (under the replica's own ``torchrun``, with ``GANG_FT_STORE`` and
``GANG_FT_REPLICA_ID`` set): :func:`train` shards the model with ``fully_shard`` on the
replica's own processes (``gang_mesh.fsdp_mesh``), joins the :class:`~gang.ft.ReplicaGang` and
calls :meth:`~gang.ft.ReplicaGang.replicate_fsdp`, so that each gradient shard, after FSDP2's
reduce-scatter inside the replica, is averaged over the replicas of the step's quorum. A healed
process loads the local shards (``DTensor.to_local()``) of the process of equal rank in a live
replica.

Run as is (``python examples/ft_hsdp.py``): :func:`run_local_job` starts the coordination store
and 3 replicas of 2 processes (one ``torchrun`` each), ``SIGKILL``\\ s one process of replica 2
(its torchrun ends the replica), starts replica 2 again, and checks that every replica finished
with bit-identical shards.
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
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional

from gang import ReduceOperation, create_default_gang, create_fsdp_gangs, create_parallel_gangs, get_rank
from gang.ft import ReplicaGang
from gang_mesh import fsdp_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ft_launch import LocalJob, matching
from fault_tolerance import TIMEOUT, _step_of  # the replicas' timeouts, the step number of a loss line

REPLICAS, PROCESSES = 3, 2
GLOBAL_BATCH = 48


def batch(step: int, share: int, shares: int) -> tuple[Tensor, Tensor]:
    """Return share ``share`` of ``shares`` of the global batch of ``step``."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=generator)
    y = (x @ torch.linspace(-1, 1, 8).unsqueeze(1)).tanh()
    rows = torch.arange(GLOBAL_BATCH).tensor_split(shares)[share]
    return x[rows], y[rows]


def local_shards(model: nn.Module) -> dict[str, Tensor]:
    """This process's shards of the parameters (what it sends when it heals a peer)."""
    shards = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        shards[name] = param.to_local().detach()
    return shards


def train(steps: int, pace: float, go: Path | None, done: Path | None) -> None:
    """Train until ``steps`` steps are committed, every replica is in the quorum and (with
    ``done``) that file exists on some member: the members decide it together in the step.

    With ``go``, wait for that file before joining (so that replicas whose torchruns start at
    different speeds take their first step together).
    """
    mesh = fsdp_mesh(create_fsdp_gangs(create_parallel_gangs(create_default_gang(torch.device("cpu")))))
    me = f"replica {os.environ['GANG_FT_REPLICA_ID']} rank {get_rank()}"
    _say(f"{me} pid {os.getpid()}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def load_state_dict(state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for name, shard in local_shards(model).items():
                shard.copy_(state[name])

    while go is not None and not go.exists():
        time.sleep(0.05)
    gang = ReplicaGang.join(
        state_dict=lambda: local_shards(model),
        load_state_dict=load_state_dict,
        min_replicas=2,
        timeout=TIMEOUT,
    )
    gang.replicate_fsdp(model)
    quorum: tuple[str, ...] = ()
    with gang:
        finished = False
        while not finished:
            before = gang.step_number
            with gang.step():  # forms the quorum; heals this process from its peer if it is behind
                if gang.step_number != before:
                    _say(f"{me} healed from a peer: step {before} -> {gang.step_number}")
                if gang.quorum != quorum and get_rank() == 0:
                    _say(f"{me}: quorum {list(gang.quorum)} at step {gang.step_number}")
                quorum = gang.quorum
                x, y = batch(gang.step_number, gang.rank * PROCESSES + get_rank(), gang.size * PROCESSES)
                loss = functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]  # the hook averages shards across replicas
                time.sleep(pace)  # the rest of a real model's forward and backward
                mean_loss = loss.detach().reshape(1)
                gang.all_reduce(mean_loss, ReduceOperation.MEAN)
                stop = torch.tensor([float(done is None or done.exists())])
                gang.all_reduce(stop, ReduceOperation.MAX)  # the same answer on every member
                committed = gang.should_commit()  # False on every member if any collective failed
                if committed:
                    optimizer.step()
                    finished = bool(stop) and gang.step_number >= steps and gang.size == REPLICAS
            if committed and gang.rank == 0 and get_rank() == 0:
                _say(f"step {gang.step_number:3d}  loss {mean_loss.item():.4f}  quorum {list(gang.quorum)}")
            elif not committed:
                _say(f"{me}: step {gang.step_number + 1} not committed: {gang.errored()}")
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in local_shards(model).values()))
    _say(f"final step {gang.step_number} shard {get_rank()} {digest.hexdigest()[:16]}")


def _say(text: str) -> None:
    """Print one line with one write: the processes of a torchrun share its output pipe (unbuffered
    under the launcher), and ``print`` writes the text and the newline separately."""
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()


def run_local_job(*, steps: int = 12, kill_at: int = 4, restart_at: int = 7, pace: float = 0.02) -> None:
    """Run the store and 3 replicas of 2 processes; kill one process of replica 2 ``kill_at`` steps
    after all 3 first train together (at step ``kill_at`` when they start together) and start
    replica 2 again ``restart_at`` steps after that point. Every wait is for an event (a line, a
    process's exit), and the training ends only once the restarted replica is back in a quorum of 3."""
    go, done = (Path(tempfile.mkdtemp(prefix="ft_hsdp.")) / name for name in ("go", "done"))
    pids: dict[tuple[int, int], int] = {}  # (replica, rank) -> the latest process's pid
    killed: list[int] = []
    try:
        with LocalJob() as job:
            store = job.start_store()
            args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={PROCESSES}"]
            args += [__file__, "--steps", str(steps), "--pace", str(pace), "--go", str(go), "--done", str(done)]

            def start(*replicas: int) -> None:  # the torchruns start together; wait for each process's pid
                for replica in replicas:
                    env = {"GANG_FT_STORE": store, "GANG_FT_REPLICA_ID": str(replica)}
                    job.start(f"replica {replica}", args, env)
                for _ in range(len(replicas) * PROCESSES):
                    words = job.expect(matching(r"replica \d+ rank \d+ pid")).text.split()
                    pids[int(words[1]), int(words[3])] = int(words[5])

            def reached(step: int) -> None:
                job.expect(lambda line: _step_of(line.text) >= step)

            start(*range(REPLICAS))
            go.touch()  # every replica has built its model: start together
            # All 3 train (two may have started without a slow third: min_replicas=2).
            line = job.expect(matching(r"replica 0 rank 0: quorum \['0', '1', '2'\]")).text
            everyone = int(line.rpartition(" ")[2])
            reached(everyone + kill_at)
            job.say("=== SIGKILL process 1 of replica 2 (its torchrun ends the replica)")
            job.ending("replica 2")
            os.kill(pids[2, 1], signal.SIGKILL)
            killed.append(pids[2, 0])
            job.wait("replica 2")
            job.expect(matching(r"replica 0 rank 0: quorum \['0', '1'\]"))  # the survivors go on without it
            reached(everyone + restart_at)
            job.say("=== starting replica 2 again")
            start(2)
            job.expect(matching(r"replica 2 rank 0: quorum \['0', '1', '2'\]"))  # healed, back
            done.touch()
            finals = [job.expect(matching("final step")).text for _ in range(REPLICAS * PROCESSES)]
            for replica in range(REPLICAS):
                if job.wait(f"replica {replica}") != 0:
                    raise RuntimeError(f"replica {replica} failed")
    finally:
        for pid in [*pids.values(), *killed]:  # the processes of a killed torchrun may outlive it
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if len(set(finals)) != PROCESSES:
        raise RuntimeError(f"the replicas finished differently: {finals}")
    print(f"=== every replica finished with the same shards: {sorted(set(finals))}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pace", type=float, default=0.02, help="seconds of simulated compute per step")
    parser.add_argument("--go", type=Path, help="a file to wait for before joining")
    parser.add_argument("--done", type=Path, help="a file that ends the training once every replica trains")
    args = parser.parse_args()
    if "GANG_FT_STORE" in os.environ:  # a process under a replica's torchrun
        train(args.steps, args.pace, args.go, args.done)
    else:
        run_local_job(steps=args.steps, pace=args.pace)
