"""HSDP across fault-tolerant replicas: the per-step cost against a static mesh, and recovery times.

``python -m benchmarks.ft_hsdp [--quick] [--out results.json]`` (``nox -s bench`` runs it) starts
local processes itself, gloo on CPU: 2 replicas of 2 processes. Each step of the MLP runs its
forward and backward, sleeps for the rest of a step of 50 or 10 ms (the compute of a larger model,
without competing for this machine's cores), and takes an SGD step.

* **Per-step cost** (ops ``hsdp_step_50ms`` and ``hsdp_step_10ms``): impl ``static`` is one
  ``torchrun`` of 4 processes with FSDP2's own HSDP on ``init_device_mesh`` (``(replicate,
  shard) = (2, 2)``); impl ``gang.ft`` is the coordination store and one ``torchrun`` of 2
  processes per replica, ``fully_shard`` on ``gang_mesh.fsdp_mesh`` plus
  ``ReplicaGang.replicate_fsdp``, each step inside ``with gang.step():`` with ``should_commit()``.
  A process reports the median of its step times after a warm-up; a row holds the slowest
  process's. ``ratio`` is ``gang.ft`` over ``static``.
* **Recovery** (ops ``hsdp_kill_to_commit`` and ``hsdp_restart_to_commit``, 50 ms step):
  process 1 of replica 1 is ``SIGKILL``\\ ed; the time from the signal to replica 0's next
  committed step is measured; then replica 1 is started again, and the time from its launch to
  its first committed step (after healing shard by shard) is measured.

torchft 0.2 is not compared here (see ``docs/ft-process-group.rst``). A worker process
(``python -m benchmarks.ft_hsdp static|ft ...``) runs under ``torchrun``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Mapping
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _ft_launch import LocalJob, matching

REPLICAS, PROCESSES, WIDTH, BATCH = 2, 2, 256, 32


def _model(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)))
    for layer in [*model, model]:
        fully_shard(layer, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(model: nn.Module, step: int, rank: int) -> Tensor:
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step * 1000 + rank))
    loss: Tensor = model(x).square().mean()
    loss.backward()  # type: ignore[no-untyped-call]
    return loss


def _pace(started: float, step_s: float) -> None:
    time.sleep(max(0.0, step_s - (time.perf_counter() - started)))


def worker(args: argparse.Namespace) -> None:
    """One process: ``static`` (a member of the 4-process HSDP world) or ``ft`` (a process of a replica)."""
    step_s, times = args.step_ms / 1000, []
    rank = int(os.environ["RANK"])
    if args.mode == "static":
        from torch.distributed.device_mesh import init_device_mesh

        torch.distributed.init_process_group("gloo")
        model, optimizer = _model(init_device_mesh("cpu", (REPLICAS, PROCESSES), mesh_dim_names=("rdp", "sdp")))
        for step in range(args.steps):
            started = time.perf_counter()
            optimizer.zero_grad()
            _step(model, step, rank)
            _pace(started, step_s)
            optimizer.step()
            times.append(time.perf_counter() - started)
        torch.distributed.destroy_process_group()
    else:
        from gang import create_default_gang, create_fsdp_gangs, create_parallel_gangs
        from gang.ft import ReplicaGang
        from gang_mesh import fsdp_mesh

        mesh = fsdp_mesh(create_fsdp_gangs(create_parallel_gangs(create_default_gang(torch.device("cpu")))))
        model, optimizer = _model(mesh)

        def shards() -> dict[str, Tensor]:
            return {n: p.to_local().detach() for n, p in model.named_parameters() if isinstance(p, DTensor)}

        def load(state: Mapping[str, Any]) -> None:
            with torch.no_grad():
                for name, shard in shards().items():
                    shard.copy_(state[name])

        gang = ReplicaGang.join(state_dict=shards, load_state_dict=load, timeout=timedelta(seconds=10))
        gang.replicate_fsdp(model)
        replica = int(os.environ["GANG_FT_REPLICA_ID"])
        while gang.step_number < args.steps:
            started = time.perf_counter()
            with gang.step():
                optimizer.zero_grad()
                _step(model, gang.step_number, replica * PROCESSES + rank)
                _pace(started, step_s)
                if gang.should_commit():
                    optimizer.step()
                    print(f"commit {gang.step_number} {time.time():.6f} {gang.size}", flush=True)
            times.append(time.perf_counter() - started)
        gang.close()
    warm = times[len(times) // 4 :]
    print(f"median {statistics.median(warm):.6f}", flush=True)


def _torchrun(nproc: int, args: list[str]) -> list[str]:
    return [
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "benchmarks.ft_hsdp",
        *args,
    ]


def _medians(job: LocalJob, names: list[str], count: int) -> float:
    found = [float(job.expect(matching("median "), 600).text.split()[1]) for _ in range(count)]
    for name in names:
        if job.wait(name, 120) != 0:
            raise RuntimeError(f"{name} failed")
    return max(found)


def per_step(step_ms: int, steps: int) -> dict[str, float]:
    """The slowest process's median step time, in seconds, for ``static`` and ``gang.ft``."""
    result = {}
    with LocalJob(echo=False) as job:
        job.start("static", _torchrun(REPLICAS * PROCESSES, ["static", f"--steps={steps}", f"--step-ms={step_ms}"]))
        result["static"] = _medians(job, ["static"], REPLICAS * PROCESSES)
    with LocalJob(echo=False) as job:
        store = job.start_store()
        names = [f"replica {r}" for r in range(REPLICAS)]
        for r, name in enumerate(names):
            env = {"GANG_FT_STORE": store, "GANG_FT_REPLICA_ID": str(r)}
            job.start(name, _torchrun(PROCESSES, ["ft", f"--steps={steps}", f"--step-ms={step_ms}"]), env)
        result["gang.ft"] = _medians(job, names, REPLICAS * PROCESSES)
    return result


def recovery(steps: int) -> dict[str, float]:
    """Seconds from SIGKILL to the survivor's next commit, and from a restart to its first commit."""
    with LocalJob(echo=False) as job:
        store = job.start_store()

        def start(r: int) -> float:
            env = {"GANG_FT_STORE": store, "GANG_FT_REPLICA_ID": str(r), "BENCH_PRINT_PID": "1"}
            return job.start(f"replica {r}", _torchrun(PROCESSES, ["ft", f"--steps={steps}", "--step-ms=50"]), env)

        def commit(r: int, after: float) -> float:
            def match(line: Any) -> bool:
                words = line.text.split()
                return line.name == f"replica {r}" and words[:1] == ["commit"] and float(words[2]) > after

            return float(job.expect(match, 600).text.split()[2])

        def pids(name: str) -> list[int]:
            return [int(text.split()[1]) for text in job.output(name) if text.startswith("pid ")]

        try:
            for r in range(REPLICAS):
                start(r)
            commit(0, time.time() + 3)  # a few steps in
            killed = time.time()
            os.kill(pids("replica 1")[-1], signal.SIGKILL)
            kill_to_commit = commit(0, killed) - killed
            job.wait("replica 1", 120)
            launched = start(1)
            restart_to_commit = commit(1, launched) - launched
        finally:
            for pid in [p for r in range(REPLICAS) for p in pids(f"replica {r}")]:  # torchrun's workers
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return {"kill_to_commit": kill_to_commit, "restart_to_commit": restart_to_commit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", nargs="?", choices=["static", "ft"])
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--step-ms", type=int, default=50)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args, _ = parser.parse_known_args()
    if args.mode is not None:
        if os.environ.get("BENCH_PRINT_PID"):
            print(f"pid {os.getpid()}", flush=True)
        worker(args)
        return
    steps = 40 if args.quick else 120
    rows: list[dict[str, Any]] = []
    for step_ms in (50, 10):
        times = per_step(step_ms, steps)
        ratio = times["gang.ft"] / times["static"]
        for impl, t in times.items():
            rows.append({"op": f"hsdp_step_{step_ms}ms", "impl": impl, "seconds": t})
        print(
            f"hsdp_step_{step_ms}ms  static {times['static'] * 1e3:.1f} ms  gang.ft {times['gang.ft'] * 1e3:.1f} ms  "
            f"ratio {ratio:.3f}"
        )
    for op, seconds in recovery(10_000).items():
        rows.append({"op": f"hsdp_{op}", "impl": "gang.ft", "seconds": seconds})
        print(f"hsdp_{op}  {seconds:.2f} s")
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.out is not None:
        out = args.out.with_name(f"{args.out.stem}_ft_hsdp.json")
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
