"""DDP and FSDP2 across replicas through ``ReplicaGang.as_process_group()``, on real processes.

Each scenario runs ``pg_workers.py`` replicas (the ``test_ft`` harness: a store process, replica
processes or torchruns, real SIGKILLs at points the replicas report), kills a process mid-step,
restarts its replica (it heals) and starts a brand-new replica, then checks after every committed
step that every process that committed it holds bit-identical parameters, equal to a
single-process replay without fault tolerance of the same data and membership schedule
(``pg_workers.reference``). A test on the gang plugin's processes checks which way FSDP2's hooks
average: once per backward pass, or at once when gradients accumulate.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_workers import reference
from test_ft import STEPS, Cluster

from gang import Gang

PG_WORKER = Path(__file__).parent / "pg_workers.py"


class PGCluster(Cluster):
    """The ``test_ft`` cluster, running ``pg_workers.py MODE`` instead of ``ft_workers.py``."""

    def __init__(self, root: Path, mode: str) -> None:
        self.mode = mode
        self.script = (str(PG_WORKER), mode)
        super().__init__(root)

    def check_steps(self) -> dict[int, list[dict[str, Any]]]:
        """Check every committed step against the replay; return each step's commit events (one per process)."""
        by_step: dict[int, dict[str, list[dict[str, Any]]]] = {}
        for logs in self.logs.values():
            for log in logs:
                process = int(log.name.rpartition(".rr")[2]) if ".rr" in log.name else 0
                for e in self.events(log):
                    if e["event"] == "commit":
                        by_step.setdefault(e["step"], {}).setdefault(str(process), []).append(e)
        assert sorted(by_step) == list(range(1, STEPS + 1)), sorted(by_step)
        schedule = [by_step[s]["0"][0]["members"] for s in range(1, STEPS + 1)]
        replay = reference(self.mode, schedule)
        for step, processes in by_step.items():
            for key, events in processes.items():
                expected = replay[step - 1][int(key)]
                for e in events:
                    assert e["members"] == schedule[step - 1], (step, key, e["members"])
                    got = torch.tensor(e["params"])
                    assert torch.equal(got, expected), f"step {step} process {key}: parameters differ from replay"
                # every replica committed the step on every one of its processes
                assert len(events) == len(schedule[step - 1]), (step, key, len(events))
        return {s: [e for es in by_step[s].values() for e in es] for s in by_step}


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Any]:
    clusters: list[PGCluster] = []

    def make(mode: str) -> PGCluster:
        clusters.append(PGCluster(tmp_path, mode))
        return clusters[-1]

    try:
        yield make
    finally:
        for c in clusters:
            c.close()
    leftovers = [p.pid for c in clusters for p in c.procs if p.poll() is None]
    assert not leftovers, leftovers


def _kill_restart_and_add(cluster: PGCluster, *, nproc: int) -> None:
    """Replica 1 is SIGKILLed inside step 3 (replica rank ``nproc - 1``); survivors 0 and 2 go on
    to step 6, where replica 1 restarted and brand-new replica 3 join them (both heal). With
    ``nproc=2``, replica 2 is launched as two torchrun agents (``--nnodes 2``)."""
    pauses = {"0": "enter:6", "1": "collective:3", "2": "enter:6"}
    for rid, pause in pauses.items():  # replica 1 pauses on its last replica rank only
        nodes = 2 if rid == "2" and nproc == 2 else 1
        cluster.start(rid, pause=pause, nproc=nproc, nnodes=nodes, pause_rank=nproc - 1 if rid == "1" else None)
    for rid in pauses:
        cluster.wait(rid, "paused", 1)
    for rid in pauses:
        cluster.release(rid, "enter", 1)
    cluster.wait("1", "paused", 3, rank=nproc - 1)
    cluster.signal("1", signal.SIGKILL, rank=nproc - 1)
    for rid in ("0", "2"):
        cluster.wait(rid, "paused", 6)
    for rid in ("1", "3"):
        cluster.start(rid, nproc=nproc)
    for rid in ("1", "3"):
        cluster.wait(rid, "paused", 1)
        cluster.release(rid, "enter", 1)
    for rid in ("0", "2"):
        cluster.release(rid, "enter", 6)
    cluster.finish({"0": 0, "1": 0, "2": 0, "3": 0})


def _check_schedule(cluster: PGCluster, commits: dict[int, list[dict[str, Any]]]) -> None:
    schedule = {s: es[0]["members"] for s, es in commits.items()}
    assert schedule[1] == schedule[2] == ["0", "1", "2"], schedule
    assert all(schedule[s] == ["0", "2"] for s in (3, 4, 5)), schedule
    assert all(schedule[s] == ["0", "1", "2", "3"] for s in range(6, STEPS + 1)), schedule
    for rid in ("1", "3"):  # every process of the two new incarnations healed before it committed
        for log in cluster.current(rid):
            events = cluster.events(log)
            healed = next(i for i, e in enumerate(events) if e["event"] == "healed")
            first = next(i for i, e in enumerate(events) if e["event"] == "commit")
            assert healed < first and events[first]["step"] == 6, (log.name, events[first])


def test_ddp_across_replicas_kill_restart_and_new_replica(make_cluster: Any) -> None:
    # Three one-process replicas train DDP(process_group=gang.as_process_group()) +
    # gang.replicate_ddp; replica 1 is killed inside step 3, restarted, and replica 3 is new.
    cluster = make_cluster("ddp")
    _kill_restart_and_add(cluster, nproc=1)
    commits = cluster.check_steps()
    _check_schedule(cluster, commits)
    # torch.distributed collectives with group= the one process group object: its rank and
    # size follow the quorum (3, then 2, then 4) and its collectives run on the live members.
    for step, events in commits.items():
        n = len(events[0]["members"])
        for e in events:
            assert e["same"] and e["size"] == e["world"] == e["count"] == n, (step, e)
            assert e["ranks"] == e["exchanged"] == list(range(n)), (step, e)
            assert e["scattered"] == n * e["rank"], (step, e)
    # Outside a step, a collective on the process group raises.
    for rid in ("0", "1", "2", "3"):
        outside = cluster.wait(rid, "outside")["error"]
        assert outside.startswith("InvalidOperationError") and "gang.step()" in outside, outside


def test_fsdp2_hsdp_across_replicas_kill_restart_and_new_replica(make_cluster: Any) -> None:
    # Three replicas of 2 processes (one torchrun each; replica 2's is two agents, --nnodes 2)
    # shard the model with fully_shard on gang_mesh.fsdp_mesh and average shards across replicas
    # through gang.replicate_fsdp. Replica rank 1 of replica 1 is killed inside step 3 (its
    # torchrun ends the replica), the replica is restarted (each process heals from the process
    # of equal replica rank: its parameter shards and Adam's sharded exp_avg/exp_avg_sq), and
    # replica 3 is new.
    cluster = make_cluster("fsdp")
    _kill_restart_and_add(cluster, nproc=2)
    _check_schedule(cluster, cluster.check_steps())


@pytest.mark.gang(world_size=2)
def test_fsdp_hooks_average_once_per_backward_and_at_once_when_gradients_accumulate(gang: Gang) -> None:
    # replicate_fsdp over the 2 processes that FSDP2 shards over (a real gang standing in for the
    # replicas): each process's gradient shards are averaged with the other process's.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import gang.ft.replica_process_group as replica_process_group
    from gang import create_fsdp_gangs, create_parallel_gangs
    from gang_mesh import fsdp_mesh

    mesh = fsdp_mesh(create_fsdp_gangs(create_parallel_gangs(gang)))
    models = []
    for _ in range(2):  # the same model with the hooks, and without as the reference
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        models.append(model)
    hooked, plain = models
    sizes: list[int] = []
    untimed = replica_process_group.average

    def counted(gang: Gang, tensor: torch.Tensor) -> None:
        sizes.append(tensor.numel())
        untimed(gang, tensor)

    def local_grads(model: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]

    def averaged(local: torch.Tensor) -> torch.Tensor:  # (rank 0's + rank 1's) / 2, as `average` sums
        rows = torch.empty(2, *local.shape)
        gang.all_gather(rows, local)
        return rows[0].clone().add_(rows[1]).div_(2)

    replica_process_group.average = counted
    try:
        replica_process_group.replicate_fsdp(gang, hooked)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(gang.rank))
        for model in models:
            model(x).square().sum().backward()
        # Fresh gradients: one exchange for the whole backward pass, of every local shard.
        assert sizes == [sum(p.to_local().numel() for p in hooked.parameters() if isinstance(p, DTensor))], sizes
        first = local_grads(hooked)
        assert torch.equal(first, averaged(local_grads(plain)))
        # A second backward pass accumulates into the gradients: each FSDP module averages at once.
        sizes.clear()
        for model in models:
            model(x * 2).square().sum().backward()
        assert sorted(sizes) == sorted([8 * 4 // 2 + 8 // 2, 2 * 8 // 2 + 2 // 2]), sizes
        second = local_grads(hooked)
        assert torch.equal(averaged(second), second), "the processes' accumulated gradients differ"
    finally:
        replica_process_group.average = untimed
