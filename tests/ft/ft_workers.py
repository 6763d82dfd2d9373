"""The gang.ft test replicas: the deterministic model, its single-process reference, the worker.

The model, data and update rule are shared by the replicas and by :func:`reference`, which
replays committed steps in one process so the test can compare parameters bit for bit.

One process of one replica trains the shared model until a step count. Run as ``python ft_workers.py
LOG STEPS`` with ``GANG_FT_REPLICA_ID``/``GANG_FT_STORE`` set. It appends JSON lines to LOG:
``joined``, ``collective`` (with the step, the quorum and the replicas it left out as stalled)
before the gradient exchange, ``commit`` with the members and the parameters after every committed
step, ``abort`` with the recorded error after an uncommitted one, ``healed`` when it loaded a peer's
state, ``ft_log`` with the fields of every record of the ``gang.ft`` logger, ``error`` when the
gang raised, and ``done`` at the end. ``FT_PAUSE=<point>:<step>`` makes it
log ``paused`` at that point (``start:0`` before ``ReplicaGang.join``, ``enter`` before ``with
gang.step()``, ``collective`` inside the step, ``vote`` after its collectives, before
``should_commit()``, ``heal`` inside ``state_dict()`` while healing
another replica at that step) and wait until the file ``LOG.release.<point>.<step>`` exists (the
harness kills or stops it there). Several pauses are separated by commas; ``<point>:<step>@<k>``
pauses replica rank ``k`` only; ``fork:<step>`` is no pause: at the ``collective`` point of that
step (before its pause) the process forks a child that only sleeps, holding every socket open
(as a forked data-loader worker does), and logs ``forked`` with its ``child`` pid: a SIGKILL of
the process then closes none of its gloo connections (it forks once the process watching it
holds a connection to its death signal, which the child closes). ``FT_GATE=1`` adds
``enter:<first step>`` on every process.
``FT_STEP_SECONDS=<s>`` makes every step take at least ``s`` seconds (a sleep inside the step,
before its collectives) and logs ``enter`` before each ``with gang.step()`` (so a test of network
faults can time every step attempt).
``FT_TIMEOUT``, ``FT_QUORUM_TIMEOUT``, ``FT_HEARTBEAT_TIMEOUT`` and ``FT_MIN_REPLICAS`` set the
gang's timeouts and ``min_replicas``; ``FT_SPARES=<n>`` joins with ``SparesPolicy(n, ...)`` (of
those timeouts) instead. ``FT_SEEDED=1`` starts every replica but ``0`` from its own
random parameters (the gang's ``init_sync`` makes them adopt replica 0's). ``FT_CHECKPOINT=<dir>``
saves the parameters and ``gang.state_dict()`` after every commit to ``<dir>/<replica>.<replica
rank>.pt`` and restores them from there at start when the file exists.

Under torchrun (a replica of several processes, on one node or several) each replica rank
``k`` (torchrun's ``RANK``) trains its shard of the flat parameters: the replica's
tensor-parallel gang (``create_parallel_gangs``) gathers the full parameters, every process
computes the same gradient, and the ``ReplicaGang`` of replica rank ``k`` exchanges shard ``k`` of
it across replicas. ``FT_PAUSE_RANK`` picks the replica rank that pauses (default: all); each
replica rank logs to ``LOG.rr<k>``. ``GANG_FT_REPLICA_RANK``/``_SIZE`` (a process that claims
to be one rank of a larger replica) make a one-process run shard like that rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import zlib
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gang import (
    Gang,
    GangError,
    ReduceOperation,
    create_default_gang,
    create_parallel_gangs,
    get_rank,
    get_world_size,
)
from gang.ft import DEFAULT_HEARTBEAT_TIMEOUT, ReplicaGang, SparesPolicy

IN, OUT, BATCH = 8, 4, 16
LR = 0.05


def initial_params() -> Tensor:
    """The flat parameters (weight then bias) every replica starts from."""
    return torch.randn(IN * OUT + OUT, generator=torch.Generator().manual_seed(1234))


def batch(replica_id: str, step: int) -> tuple[Tensor, Tensor]:
    """The batch replica ``replica_id`` trains on in step ``step`` (the same after a restart)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{replica_id}/{step}".encode()))
    x = torch.randn(BATCH, IN, generator=g)
    return x, x @ torch.ones(IN, OUT) + torch.randn(BATCH, OUT, generator=g)


def gradient(params: Tensor, replica_id: str, step: int) -> Tensor:
    """The gradient of the mean squared error of ``replica_id``'s batch of ``step`` at ``params``."""
    p = params.detach().clone().requires_grad_(True)
    x, y = batch(replica_id, step)
    weight, bias = p[: IN * OUT].view(IN, OUT), p[IN * OUT :]
    loss = ((x @ weight + bias - y) ** 2).mean()
    (grad,) = torch.autograd.grad(loss, p)
    return grad


def update(params: Tensor, table: Tensor) -> Tensor:
    """One SGD step from the gathered gradients (one row per member, in rank order)."""
    return params - LR * (table.sum(0) / table.shape[0])


def reference(schedule: list[list[str]]) -> Tensor:
    """Replay committed steps ``1..len(schedule)`` in one process; entry ``s - 1`` lists step ``s``'s members."""
    params = initial_params()
    for step, members in enumerate(schedule, start=1):
        params = update(params, torch.stack([gradient(params, m, step) for m in members]))
    return params


class Replica:
    def __init__(self, log: Path, shard: int, shards: int, rid: str) -> None:
        self.log = log
        params = initial_params()
        if os.environ.get("FT_SEEDED") == "1" and rid != "0":
            params = torch.randn(params.shape, generator=torch.Generator().manual_seed(zlib.crc32(rid.encode())))
        self.params = params.chunk(shards)[shard].clone()
        pauser = os.environ.get("FT_PAUSE_RANK")
        pauses = os.environ.get("FT_PAUSE", "") if pauser is None or int(pauser) == shard else ""
        self.pauses: set[tuple[str, int]] = set()
        for entry in pauses.split(","):
            point, _, rank = entry.partition("@")  # `point:step@k`: only replica rank k pauses there
            if point and (not rank or int(rank) == shard):
                event, _, at = point.partition(":")
                self.pauses.add((event, int(at)))
        self.gang: ReplicaGang | None = None

    def emit(self, event: str, **fields: Any) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps({"event": event, "pid": os.getpid(), "t": round(time.time(), 3), **fields}) + "\n")

    def maybe_pause(self, event: str, step: int) -> None:
        if (event, step) in self.pauses:
            self.pauses.discard((event, step))
            self.emit("paused", at=event, step=step)
            release = Path(f"{self.log}.release.{event}.{step}")
            while not release.exists():
                time.sleep(0.01)

    def maybe_fork(self, step: int) -> None:
        if ("fork", step) in self.pauses:
            self.pauses.discard(("fork", step))
            # First wait until the process watching this one holds a greeted connection to its
            # death signal (made within two heartbeat periods of the quorum), so that the kill
            # this scenario prepares is seen as a death, not only as a silence (test-only look).
            assert self.gang is not None
            deadline = time.monotonic() + 60
            while self.gang._liveness.watchers == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            child = os.fork()
            if child == 0:  # holds the inherited sockets until killed
                time.sleep(3600)
                os._exit(0)
            self.emit("forked", step=step, child=child)

    def state_dict(self) -> Mapping[str, Any]:
        assert self.gang is not None
        self.maybe_pause("heal", self.gang.step_number + 1)
        return {"params": self.params}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        assert self.gang is not None
        self.params = state["params"].clone()
        self.emit("healed", behind=self.gang.step_number)


class LogEvents(logging.Handler):
    """Writes the fields of every ``gang.ft`` log record to the replica's log as ``ft_log``."""

    def __init__(self, replica: Replica) -> None:
        super().__init__()
        self.replica = replica

    def emit(self, record: logging.LogRecord) -> None:
        self.replica.emit("ft_log", ft=getattr(record, "gang_ft", {}))


def full_params(tp: Gang | None, shard: torch.Tensor) -> torch.Tensor:
    """The whole flat parameters, gathered from the replica's tensor-parallel gang."""
    if tp is None:
        return shard
    table = torch.empty(tp.size, shard.numel())
    tp.all_gather(table, shard)
    return table.view(-1)


def main() -> None:
    log, steps = Path(sys.argv[1]), int(sys.argv[2])
    shard = int(os.environ.get("GANG_FT_REPLICA_RANK", get_rank()))
    shards = int(os.environ.get("GANG_FT_REPLICA_SIZE", get_world_size()))
    tp = None
    if get_world_size() > 1:
        tp = create_parallel_gangs(create_default_gang(torch.device("cpu")), tp_size=shards).tp
    if shards > 1:
        log = Path(f"{log}.rr{shard}")
    rid = os.environ["GANG_FT_REPLICA_ID"]
    replica = Replica(log, shard, shards, rid)
    ft_logger = logging.getLogger("gang.ft")
    ft_logger.setLevel(logging.INFO)
    ft_logger.addHandler(LogEvents(replica))

    def seconds(name: str, default: str) -> timedelta | None:
        value = os.environ.get(name, default)
        return timedelta(seconds=float(value)) if value else None

    replica.maybe_pause("start", 0)
    timing: dict[str, Any] = {
        "quorum_timeout": seconds("FT_QUORUM_TIMEOUT", ""),
        "heartbeat_timeout": seconds("FT_HEARTBEAT_TIMEOUT", ""),
        "min_replicas": int(os.environ.get("FT_MIN_REPLICAS", "1")),
    }
    spares = os.environ.get("FT_SPARES")
    if spares:  # a fixed number of stepping replicas, the others spares
        beat = timing["heartbeat_timeout"] or DEFAULT_HEARTBEAT_TIMEOUT
        wait = timing["quorum_timeout"] or timedelta(seconds=float(os.environ.get("FT_TIMEOUT", "3")))
        timing = {"policy": SparesPolicy(int(spares), wait.total_seconds(), beat.total_seconds(), init_sync=True)}
    try:
        gang = ReplicaGang.join(
            state_dict=replica.state_dict,
            load_state_dict=replica.load_state_dict,
            timeout=seconds("FT_TIMEOUT", "3"),
            **timing,
        )
    except GangError as ex:
        replica.emit("error", error=str(ex))
        os._exit(3)
    replica.gang = gang
    checkpoint = os.environ.get("FT_CHECKPOINT")
    saved = Path(checkpoint or ".", f"{rid}.{shard}.pt")
    if checkpoint and saved.exists():
        restored = torch.load(saved)
        replica.params = restored["params"]
        gang.load_state_dict(restored["gang"])
    if os.environ.get("FT_GATE") == "1":
        replica.pauses.add(("enter", gang.step_number + 1))  # every process waits to begin its first step
    replica.emit("joined", step=gang.step_number)
    pace = float(os.environ.get("FT_STEP_SECONDS") or 0)
    try:
        while gang.step_number < steps:
            replica.maybe_pause("enter", gang.step_number + 1)
            if pace:
                replica.emit("enter", step=gang.step_number + 1)
            with gang.step():
                step = gang.step_number + 1
                time.sleep(pace)
                replica.maybe_fork(step)
                replica.maybe_pause("collective", step)
                quorum = gang.current_quorum
                assert quorum is not None
                replica.emit("collective", step=step, members=list(gang.quorum), stalled=list(quorum.stalled))
                grad = gradient(full_params(tp, replica.params), rid, step).chunk(shards)[shard]
                table = torch.zeros(gang.size, grad.numel())
                gang.all_gather(table, grad)
                count = torch.tensor([1], dtype=torch.int64)
                gang.all_reduce(count, ReduceOperation.SUM)
                replica.maybe_pause("vote", step)
                if gang.should_commit():
                    assert int(count) == gang.size, (int(count), gang.size)
                    replica.params = update(replica.params, table)
                    if checkpoint:
                        torch.save({"params": replica.params, "gang": gang.state_dict()}, saved)
                    replica.emit(
                        "commit", step=gang.step_number, members=list(gang.quorum), params=replica.params.tolist()
                    )
                else:
                    replica.emit("abort", step=step, error=str(gang.errored()))
    except GangError as ex:
        replica.emit("error", error=str(ex))
        sys.stdout.flush()
        os._exit(3)
    gang.close()
    replica.emit("done", step=gang.step_number, params=replica.params.tolist())
    os._exit(0)


if __name__ == "__main__":
    main()
