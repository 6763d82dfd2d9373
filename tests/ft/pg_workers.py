"""The replicas of the fault-tolerant process group tests: DDP and FSDP2 over a ``ReplicaGang``.

Run as ``python pg_workers.py ddp|fsdp LOG STEPS`` (``fsdp`` under a torchrun of 2 processes)
with ``GANG_FT_REPLICA_ID``/``GANG_FT_STORE`` set; the pause protocol and the log events are
those of ``ft_workers.py`` (``joined``, ``paused``, ``collective``, ``commit``, ``abort``,
``healed``, ``error``, ``done``), and ``commit``/``done`` carry this process's parameters (its
local shards under FSDP2, flattened).

``ddp``: one process per replica; ``DistributedDataParallel`` over ``gang.as_process_group()``
plus ``gang.replicate_ddp``, SGD with momentum (healing carries the optimizer state). Each step
it also runs ``torch.distributed`` collectives with ``group=`` the same process group object and
logs what they saw (its rank, size and identity), and it logs the error of a collective called
outside a step.

``fsdp``: each process of the replica (a torchrun of 2 processes, on one or two agents) shards
the model with ``fully_shard`` on ``gang_mesh.fsdp_mesh(gangs)`` (the replica's own 2 processes)
and calls ``gang.replicate_fsdp``; healing sends each process's local shards, and Adam's state
of them (``step``, ``exp_avg``, ``exp_avg_sq``: DTensors whose local shards travel), to the
process of equal replica rank in the healed replica. Each process logs to ``LOG.rr<replica rank>``.

:func:`reference` replays committed steps in one process without fault tolerance: the same
model, data, reduction order and optimizer, so the test compares parameters bit for bit.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ft_workers import Replica
from torch import Tensor, nn

from gang import GangError, create_default_gang, create_fsdp_gangs, create_parallel_gangs, get_rank
from gang.ft import ReplicaGang

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 16
LR, MOMENTUM, ADAM_LR = 0.05, 0.9, 0.01
FSDP_PROCS = 2
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def build_model() -> nn.Sequential:
    """The model every replica starts from."""
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def optimizer(mode: str, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum for ``ddp``; Adam for ``fsdp`` (``exp_avg`` and ``exp_avg_sq`` are DTensors)."""
    if mode == "fsdp":
        return torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def batch(replica_id: str, process: int, step: int) -> tuple[Tensor, Tensor]:
    """The batch of process ``process`` of replica ``replica_id`` in step ``step`` (the same after a restart)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{replica_id}/{process}/{step}".encode()))
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.randn(BATCH, OUT, generator=g)


def loss_of(model: nn.Module, replica_id: str, process: int, step: int) -> Tensor:
    x, y = batch(replica_id, process, step)
    loss: Tensor = ((model(x) - y) ** 2).mean()
    return loss


def ordered_mean(rows: list[Tensor]) -> Tensor:
    """The mean of ``rows`` summed in order, as ``gang.ft.replica_process_group.average`` computes it."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total.div_(len(rows))


def reference(mode: str, schedule: list[list[str]]) -> list[list[Tensor]]:
    """Replay committed steps ``1..len(schedule)`` (entry ``s - 1`` lists step ``s``'s members) in one process.

    Entry ``s - 1`` of the result holds the flat parameters after step ``s`` of each process of a
    replica (its two shards under ``fsdp``).
    """
    history: list[list[Tensor]] = []
    model = build_model()
    opt = optimizer(mode, model)
    procs = FSDP_PROCS if mode == "fsdp" else 1
    for step, members in enumerate(schedule, start=1):
        per_replica: list[list[Tensor]] = []
        for rid in members:
            grads: list[list[Tensor]] = []
            for k in range(procs):
                model.zero_grad()
                loss_of(model, rid, k, step).backward()  # type: ignore[no-untyped-call]
                grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            # FSDP2 averages the replica's processes in its reduce-scatter: (g0 + g1) / 2.
            per_replica.append([sum(gs[1:], gs[0].clone()).div_(procs) for gs in zip(*grads, strict=True)])
        for p, gs in zip(model.parameters(), zip(*per_replica, strict=True), strict=True):
            p.grad = ordered_mean(list(gs))
        opt.step()
        history.append([flat([p.detach().chunk(procs)[k] for p in model.parameters()]) for k in range(procs)])
    return history


def flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


class Worker(Replica):
    """One process of a replica: the model, its optimizer and the heal callbacks."""

    def __init__(self, mode: str, log: Path, process: int) -> None:
        super().__init__(log, process, FSDP_PROCS if mode == "fsdp" else 1, os.environ["GANG_FT_REPLICA_ID"])
        if os.environ.get("FT_GATE") == "1":
            self.pauses.add(("enter", 1))  # every process waits to begin step 1
        self.mode, self.process = mode, process
        self.model: nn.Module = build_model()
        if mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            from gang_mesh import fsdp_mesh

            root = create_default_gang(torch.device("cpu"))
            mesh = fsdp_mesh(create_fsdp_gangs(create_parallel_gangs(root)))
            for layer in self.model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.opt = optimizer(mode, self.model)

    def local(self) -> list[Tensor]:
        """This process's parameters: the local shards under FSDP2."""
        return [getattr(p, "_local_tensor", p).detach() for p in self.model.parameters()]

    def flat_params(self) -> list[float]:
        values: list[float] = flat(self.local()).tolist()
        return values

    def state_dict(self) -> Mapping[str, Any]:
        self.maybe_pause("heal", -1)
        if self.mode == "ddp":
            return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        return {"shards": [t.clone() for t in self.local()], "adam": self.adam_state()}

    def adam_state(self) -> list[list[Tensor]]:
        """Adam's state of each parameter, local shards: ``[step, exp_avg, exp_avg_sq]`` (empty before step 1)."""
        out = []
        for p in self.model.parameters():
            state = self.opt.state.get(p, {})
            if state:
                out.append([state["step"].clone(), *(state[k].to_local().clone() for k in ADAM_KEYS)])
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.mode == "ddp":
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optim"])
        else:
            from torch.distributed.tensor import DTensor

            with torch.no_grad():
                for mine, theirs in zip(self.local(), state["shards"], strict=True):
                    mine.copy_(theirs)
                adam = state["adam"] or [None] * len(self.local())  # no state before the first step
                self.opt.state.clear()
                for p, entry in zip(self.model.parameters(), adam, strict=True):
                    if entry is None:
                        continue
                    step, *moments = entry
                    assert isinstance(p, DTensor)
                    self.opt.state[p] = {
                        "step": step.clone(),
                        **{
                            k: DTensor.from_local(m.clone(), p.device_mesh, p.placements, run_check=False)
                            for k, m in zip(ADAM_KEYS, moments, strict=True)
                        },
                    }
        self.emit("healed")


def main() -> None:
    mode, log, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    process = get_rank() if mode == "fsdp" else 0  # the replica rank (its torchrun's RANK)
    if mode == "fsdp":
        log = Path(f"{log}.rr{process}")
    worker = Worker(mode, log, process)
    rid = os.environ["GANG_FT_REPLICA_ID"]
    gang = ReplicaGang.join(
        state_dict=worker.state_dict,
        load_state_dict=worker.load_state_dict,
        timeout=timedelta(seconds=float(os.environ.get("FT_TIMEOUT", "3"))),
    )
    pg = gang.as_process_group()
    model: nn.Module = worker.model
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(worker.model, process_group=pg, init_sync=False)
        gang.replicate_ddp(model)
    else:
        gang.replicate_fsdp(model)
    try:
        dist.all_reduce(torch.ones(1), group=pg)
    except Exception as ex:
        worker.emit("outside", error=f"{type(ex).__name__}: {ex}")
    worker.emit("joined")
    try:
        while gang.step_number < steps:
            worker.maybe_pause("enter", gang.step_number + 1)
            with gang.step():
                step = gang.step_number + 1
                worker.maybe_pause("collective", step)
                worker.emit("collective", step=step, members=list(gang.quorum))
                worker.opt.zero_grad()
                loss = loss_of(model, rid, worker.process, step)
                loss.backward()  # type: ignore[no-untyped-call]
                seen: dict[str, Any] = {}
                if mode == "ddp":  # torch.distributed collectives on the same group object
                    count = torch.ones(1)
                    dist.all_reduce(count, group=pg)
                    ranks = torch.zeros(pg.size(), dtype=torch.int64)
                    dist.all_gather_into_tensor(ranks, torch.tensor([pg.rank()]), group=pg)
                    scattered = torch.zeros(1, dtype=torch.int64)  # the sum of every rank's row pg.rank()
                    dist.reduce_scatter_tensor(scattered, torch.arange(pg.size(), dtype=torch.int64), group=pg)
                    exchanged = torch.zeros(pg.size(), dtype=torch.int64)  # row i from rank i
                    mine = torch.full((pg.size(),), pg.rank(), dtype=torch.int64)
                    dist.all_to_all_single(exchanged, mine, group=pg)
                    seen = {
                        "rank": pg.rank(),
                        "scattered": int(scattered),
                        "exchanged": exchanged.tolist(),
                        "size": pg.size(),
                        "world": dist.get_world_size(pg),
                        "count": int(count),
                        "ranks": ranks.tolist(),
                        "same": pg is gang.as_process_group(),
                    }
                if gang.should_commit():
                    worker.opt.step()
                    worker.emit(
                        "commit",
                        step=gang.step_number,
                        members=list(gang.quorum),
                        params=worker.flat_params(),
                        loss=loss.item(),
                        **seen,
                    )
                else:
                    worker.emit("abort", step=step, error=str(gang.errored()))
    except GangError as ex:
        worker.emit("error", error=str(ex))
        sys.stdout.flush()
        os._exit(3)
    gang.close()
    worker.emit("done", step=gang.step_number, params=worker.flat_params())
    os._exit(0)


if __name__ == "__main__":
    main()
