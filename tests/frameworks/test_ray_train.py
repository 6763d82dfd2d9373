"""A gang inside Ray Train's ``TorchTrainer``: the framework initialises torch's default group, the gang adopts it.

Runs in ``nox -s ray`` (which installs ``ray[train]``), skipped where Ray is not installed. A local
Ray cluster on loopback (every Ray process and the workers' ``MASTER_ADDR`` on 127.0.0.1) runs two
CPU workers; inside the train function ``create_default_gang()`` wraps the group Ray made, runs
collectives, splits it with ``create_parallel_gangs``/``create_fsdp_gangs``, hands ``gang_mesh.fsdp_mesh``
to FSDP2 for one step, and closes, leaving Ray's group to Ray.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gang
from gang import ReduceOperation

# Ray reads this when imported: its single-machine mode (Windows' and macOS's default) takes
# 127.0.0.1 as the node's address instead of the machine's outward one, so the Ray processes and
# the workers' MASTER_ADDR (torch's rendezvous) stay on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
train = pytest.importorskip("ray.train")
ray_torch = pytest.importorskip("ray.train.torch")

WORKERS = 2


def train_function(config: dict[str, Any]) -> None:
    """What each Ray worker runs: build a gang over Ray's group, use it, report what it saw."""
    from torch.distributed.fsdp import fully_shard

    from gang_mesh import fsdp_mesh

    framework_group = dist.group.WORLD if dist.is_initialized() else None
    root = gang.create_default_gang()
    assert isinstance(root, gang.ProcessGroupGang), root
    t = torch.tensor([float(root.rank + 1)])
    root.all_reduce(t, ReduceOperation.SUM)
    gathered = torch.empty(root.size, 1)
    root.all_gather(gathered, torch.tensor([float(root.rank)]))

    gangs = gang.create_fsdp_gangs(gang.create_parallel_gangs(root))
    mesh = fsdp_mesh(gangs)
    # One FSDP2 step over the mesh: the gradient of sum(w . x_r) is the mean of the ranks' inputs.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    fully_shard(model, mesh=mesh)
    x = torch.full((1, 4), float(root.rank + 1))
    model(x).sum().backward()
    grad = model.weight.grad.full_tensor()  # type: ignore[union-attr]

    seen = {
        "rank": root.rank,
        "size": root.size,
        "adopted": root.as_process_group() is framework_group,
        "master_addr": os.environ.get("MASTER_ADDR"),
        "sum": t.item(),
        "gathered": gathered.flatten().tolist(),
        "dp": gangs.dp.size,
        "sdp": gangs.sdp.size,
        "mesh": (tuple(mesh.mesh_dim_names or ()), mesh.size()),
        "grad": grad.flatten().tolist(),
    }
    everyone = gang.all_gather_objects(root, seen)
    root.close()
    # Ray's group outlives the gang (Ray destroys it); rank 0 writes what every rank saw.
    if seen["rank"] == 0:
        report = {"everyone": everyone, "initialised_after_close": dist.is_initialized()}
        Path(config["out"]).write_text(json.dumps(report))


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A local Ray cluster on loopback whose files (sessions, results) live in a temporary folder."""
    root = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as patch:
        # Given a token, Ray does not write one under the home directory on its first start.
        patch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(
            _node_ip_address="127.0.0.1",
            num_cpus=WORKERS + 1,
            include_dashboard=False,
            _temp_dir=str(root / "tmp"),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        )
        try:
            yield root
        finally:
            ray.shutdown()


def test_a_gang_inside_torch_trainer(local_cluster: Path) -> None:
    out = local_cluster / "seen.json"
    trainer = ray_torch.TorchTrainer(
        train_function,
        train_loop_config={"out": str(out)},
        scaling_config=train.ScalingConfig(num_workers=WORKERS, use_gpu=False),
        torch_config=ray_torch.TorchConfig(backend="gloo"),
        run_config=train.RunConfig(name="gang", storage_path=str(local_cluster / "results")),
    )
    trainer.fit()
    report = json.loads(out.read_text())
    assert report["initialised_after_close"] is True
    everyone = report["everyone"]
    assert [seen["rank"] for seen in everyone] == list(range(WORKERS))
    mean_input = sum(range(1, WORKERS + 1)) / WORKERS
    for seen in everyone:
        assert seen["master_addr"] == "127.0.0.1", seen  # Ray kept on loopback
        assert seen["adopted"] is True, seen
        assert seen["size"] == WORKERS
        assert seen["sum"] == WORKERS * (WORKERS + 1) / 2
        assert seen["gathered"] == [float(r) for r in range(WORKERS)]
        assert (seen["dp"], seen["sdp"]) == (WORKERS, WORKERS)
        assert seen["mesh"] == [["sdp"], WORKERS]  # through JSON
        assert seen["grad"] == [mean_input] * 4
