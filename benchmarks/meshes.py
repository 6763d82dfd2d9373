"""Setting up parallelism on 8 ranks: gangs vs ``init_device_mesh``, ``to_device_mesh``, and one FSDP2 step.

Run under torchrun with 8 processes (``python -m benchmarks.run`` does it). Measures, interleaved:

* ``create_parallel_gangs`` + ``create_fsdp_gangs`` (impl ``gang``) against ``init_device_mesh``
  (impl ``torch``) for the grid pp=2, dp=2, tp=2 (op ``create_groups``);
* ``to_device_mesh`` of the gangs (impl ``gang``, op ``to_device_mesh``);
* one FSDP2 + tensor parallel training step of ``gang_mesh.parity`` on the ``("dp", "tp")``
  mesh from the gangs (impl ``gang-mesh``) and on the native mesh (impl ``native-mesh``, op ``fsdp_step``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn import functional

from gang import Gang, Gangs, ProcessGroupGang, create_fsdp_gangs, create_parallel_gangs
from gang.bench.metrics import Row, make_row, median, paired_ratio
from gang_mesh import to_device_mesh
from gang_mesh.parity import ModelConfig, TinyTransformer, batch_for, data_parallel_index, parallelize

GRID = (("pp", 2), ("dp", 2), ("tp", 2))


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _slowest(times: dict[str, list[float]]) -> dict[str, list[float]]:
    names = list(times)
    local = torch.tensor([times[name] for name in names], dtype=torch.float64)
    dist.all_reduce(local, dist.ReduceOp.MAX)
    return {name: local[i].tolist() for i, name in enumerate(names)}


def _close_sub_gangs(gangs: Gangs, root: Gang) -> None:
    for gang in {id(g): g for g in (gangs.dp, gangs.rdp, gangs.sdp, gangs.tp, gangs.pp)}.values():
        if gang is not root:
            gang.close()


def _destroy_mesh_groups(mesh: DeviceMesh) -> None:
    for name in mesh.mesh_dim_names or ():
        group = mesh.get_group(name)
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def bench_creation(root: ProcessGroupGang, reps: int) -> list[Row]:
    """Time building every group of the pp x dp x tp grid with gangs and with ``init_device_mesh``, interleaved."""
    names = tuple(name for name, _ in GRID)
    shape = tuple(size for _, size in GRID)
    times: dict[str, list[float]] = {"gang": [], "torch": []}
    mesh_times: list[float] = []
    for rep in range(reps + 1):  # the first round is a warm-up
        order = ("gang", "torch") if rep % 2 == 0 else ("torch", "gang")
        for impl in order:
            if impl == "gang":
                elapsed, result = _timed(lambda: create_fsdp_gangs(create_parallel_gangs(root, tp_size=2, pp_size=2)))
                assert isinstance(result, Gangs)
                gangs: Gangs = result
                mesh_elapsed, _ = _timed(partial(to_device_mesh, gangs, ("dp", "tp")))
                if rep:
                    mesh_times.append(mesh_elapsed)
                _close_sub_gangs(gangs, root)
            else:
                elapsed, mesh = _timed(lambda: init_device_mesh("cpu", shape, mesh_dim_names=names))
                assert isinstance(mesh, DeviceMesh)
                _destroy_mesh_groups(mesh)
            if rep:
                times[impl].append(elapsed)
    slow = _slowest({**times, "to_device_mesh": mesh_times})
    n = root.size
    return [
        make_row("gang", "create_groups", 0, n, median(slow["gang"]), iters=reps),
        make_row("torch", "create_groups", 0, n, median(slow["torch"]), iters=reps),
        make_row("gang", "to_device_mesh", 0, n, median(slow["to_device_mesh"]), iters=reps),
    ]


def bench_fsdp_step(root: ProcessGroupGang, steps: int) -> list[Row]:
    """Time one FSDP2 + TP training step on a ``("dp", "tp")`` mesh from gangs and on the native one, interleaved."""
    gangs = create_fsdp_gangs(create_parallel_gangs(root, tp_size=2, pp_size=2))
    ours = to_device_mesh(gangs, ("dp", "tp"))
    native = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))["dp", "tp"]
    config = ModelConfig(dim=64, hidden=256, layers=2, seq=32)
    models = {}
    for name, mesh in (("gang-mesh", ours), ("native-mesh", native)):
        torch.manual_seed(0)
        model = parallelize(TinyTransformer(config), mesh)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), mesh)

    def step_of(name: str, step: int) -> Callable[[], object]:
        model, optimizer, mesh = models[name]
        replica, _ = data_parallel_index(mesh)
        tokens = batch_for(step, replica, 4, config)

        def step_fn() -> object:
            logits = model(tokens[:, :-1])
            loss = functional.cross_entropy(logits.reshape(-1, config.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
            return loss.item()

        return step_fn

    times: dict[str, list[float]] = {"gang-mesh": [], "native-mesh": []}
    for step in range(steps + 2):  # two warm-up steps
        order = ("gang-mesh", "native-mesh") if step % 2 == 0 else ("native-mesh", "gang-mesh")
        for name in order:
            elapsed, _ = _timed(step_of(name, step))
            if step >= 2:
                times[name].append(elapsed)
    slow = _slowest(times)
    _close_sub_gangs(gangs, root)
    # Both meshes train the same model on the same data; pair the steps that ran back to back.
    paired = paired_ratio(slow["gang-mesh"], slow["native-mesh"])
    return [
        make_row("gang-mesh", "fsdp_step", 0, root.size, median(slow["gang-mesh"]), iters=steps, paired_ratio=paired),
        make_row("native-mesh", "fsdp_step", 0, root.size, median(slow["native-mesh"]), iters=steps),
    ]


def main(argv: list[str] | None = None) -> None:
    """Run the set-up benchmarks on this torchrun rank; rank 0 prints progress and writes ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    root = ProcessGroupGang.create_default_process_group(torch.device("cpu"))
    rows = bench_creation(root, 10 if args.quick else 30)
    if root.rank == 0:
        for row in rows:
            print(f"# {row['op']:>16} {row['impl']:>12} {row['time_us'] / 1e3:10.2f} ms", flush=True)
    step_rows = bench_fsdp_step(root, 12 if args.quick else 40)
    rows += step_rows
    if root.rank == 0:
        for row in step_rows:
            print(f"# {row['op']:>16} {row['impl']:>12} {row['time_us'] / 1e3:10.2f} ms", flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    root.close()


if __name__ == "__main__":
    main(sys.argv[1:])
