"""HSDP across fault-tolerant replicas: the per-step cost against a static mesh and torchft, and recovery times.

``python -m benchmarks.ft_hsdp [--quick] [--out results.json] [--torchft-python PATH]`` (``nox -s
bench`` runs it) starts local processes itself, gloo on CPU: 2 replicas of 2 processes. Each step of
the MLP (each layer a ``fully_shard`` unit; :data:`SHAPES`: 2 layers of 256 for the 50 ms step, 1
of 64 for the 10 ms step) runs its forward and backward, sleeps for the rest of the step (the
compute of a larger model, without competing for this machine's cores), and takes an optimizer
step. FSDP2's own collectives alone take longer than 10 ms here, so the "10 ms" step is the
shortest this machine runs, without a sleep.

* **Per-step cost** (ops ``hsdp_step_50ms`` and ``hsdp_step_10ms``): one ``torchrun`` of 4
  processes holds two copies of the model and trains them in interleaved rounds (the order
  alternates every round). Impl ``static`` is FSDP2's own HSDP on ``init_device_mesh`` (``(rdp,
  sdp) = (2, 2)``); impl ``gang.ft`` is ``fully_shard`` on the replica's 1-D ``sdp`` mesh plus
  ``ReplicaGang.replicate_fsdp``, processes ``2r`` and ``2r + 1`` joining as replica ``r``, each
  step inside ``with gang.step():`` with ``should_commit()``. With ``--torchft-python`` (or
  ``TORCHFT_PYTHON``; a separate virtual environment with ``torch==2.13.0 torchft==0.2.0 numpy``,
  torchft is never a dependency of gang), the same run under that interpreter gives impl
  ``torchft``: the same 1-D ``fully_shard`` with FSDP2's all-reduce hook calling torchft's
  ``Manager.allreduce(...).wait()`` (a ``Manager`` per process, one Lighthouse), each step between
  ``start_quorum()`` and ``should_commit()``, and its own ``static`` rows (``static@torchft``).
  A step's time is the slowest process's; ``ratio`` is the ratio of the medians, ``paired_ratio``
  the median over rounds of each round's ratio of medians. ``phases_ms`` breaks the median step
  into its parts, measured on each process (the medians of the slowest process's phases): entering
  the step (the quorum), forward and backward without the cross-replica average, the average
  (the all-reduce hook; torchft's includes the wait for its quorum, formed on a thread of its
  own), the pacing sleep, the commit vote, the optimizer step and leaving the step.
  ``--repeat N`` measures each step length N times, the
  implementations alternating in order (gang.ft first, then torchft first, ...), and prints the
  median of each implementation's ratios and paired ratios over the N runs with the load average
  of each run: the one command to compare on a quiet machine is ``python -m benchmarks.ft_hsdp
  --hsdp-skip recovery --repeat 3 --torchft-python PATH``. ``--no-update`` is a diagnostic: no
  implementation takes its optimizer step (ops ``hsdp_step_50ms_no_update`` and
  ``hsdp_step_10ms_no_update``), which shows the cost of the commit vote alone, without the
  optimizer steps that the vote's decision sets off on every process at once.
* **Recovery** (ops ``hsdp_kill_to_commit`` and ``hsdp_restart_to_commit``, 50 ms step): one
  ``torchrun`` of 2 processes per replica (gang.ft: ``fully_shard`` on ``gang_mesh.fsdp_mesh``
  of the replica's own gangs). One process of replica 1 is ``SIGKILL``\\ ed (its torchrun ends
  the replica); the time from the signal to replica 0's next committed step without it is
  measured (torchft may still commit the step in flight: its vote is within a replica); then
  replica 1 is started again, and the time from its launch to its first committed step (after
  healing shard by shard) is measured, with the moments its processes had imported torch
  (``hsdp_restart_to_imported``) and had sharded the model and joined
  (``hsdp_restart_to_joined``); 4 cycles (2 with ``--quick``), the median reported. gang.ft runs
  with a 10 s ``timeout`` and a ``heartbeat_timeout`` of
  :data:`benchmarks.ft.RECOVERY_TIMEOUT_S`; torchft with a Lighthouse join and heartbeat timeout
  of the same and Manager timeouts of :data:`benchmarks.ft_torchft.MANAGER_TIMEOUT_S`, as in
  ``benchmarks/ft.py``.

A worker (``python -m benchmarks.ft_hsdp overhead|recovery --impl gang|torchft ...``) runs under
``torchrun``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from benchmarks.ft import RECOVERY_TIMEOUT_S, check_torchft_python, torchft_env
from benchmarks.ft_torchft import MANAGER_TIMEOUT_S

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _ft_launch import Line, LocalJob, wait_for_port

from gang.bench.metrics import Row, make_row
from gang.testing import free_port

REPLICAS, PROCESSES, BATCH = 2, 2, 32
SHAPES = {50: (2, 256), 10: (1, 64)}
"""The MLP of each step (ms): (layers, width). FSDP2's own collectives take about 11 ms per layer
here (4 processes on 2 cores), so the 50 ms step holds 2 layers of 256 with time to spare, and the
10 ms step the smallest model, 1 layer of 64: the shortest HSDP step this machine runs (12 to 20 ms
of FSDP2's collectives alone, so that step has no pacing sleep)."""
_COMMIT = re.compile(r"commit (\d+) ([\d.]+) (\d+)")
_PID = re.compile(r"pid (\d+)")
_STAGE = re.compile(r"stage (\w+) ([\d.]+)")
GANG_TIMEOUT = timedelta(seconds=10)
"""gang.ft's ``timeout`` in every measurement here (collectives, heal, vote)."""
PHASES = ("enter", "compute", "average", "sleep", "commit", "update", "exit")
"""The parts of a step that ``phases_ms`` reports (see the module's docstring)."""


# --------------------------------------------------------------------------------------------------
# The model and one step
# --------------------------------------------------------------------------------------------------


_SHARDED: weakref.WeakKeyDictionary[nn.Module, dict[str, DTensor]] = weakref.WeakKeyDictionary()
"""Each model's sharded parameters, taken when it was sharded: FSDP2 swaps a module's parameters for
unsharded tensors between its forward and its backward, and torchft reads ``state_dict`` from its
quorum thread while the next step's forward runs."""


def _model(mesh: Any, layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)))
    for layer in [*model, model]:
        fully_shard(layer, mesh=mesh)
    _SHARDED[model] = {n: p for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _shards(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.to_local().detach() for n, p in _SHARDED[model].items()}


def _loader(model: nn.Module) -> Callable[[Mapping[str, Any]], None]:
    def load(state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for name, shard in _shards(model).items():
                shard.copy_(state[name])

    return load


class _Clock:
    """Splits one step into :data:`PHASES` (seconds since the last mark, per phase)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> float:
        self.phases = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()
        return self._last

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] += now - self._last
        self._last = now


def _averaging(clock: _Clock, average: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
    """An all-reduce hook that runs ``average`` and books its time on ``clock`` (out of ``compute``)."""

    def hook(output: Tensor) -> None:
        clock.mark("compute")
        average(output)
        clock.mark("average")

    return hook


def _compute(model: nn.Module, step: int, rank: int) -> Tensor:
    width = next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(step * 1000 + rank))
    loss: Tensor = model(x).square().mean()
    loss.backward()  # type: ignore[no-untyped-call]
    return loss


def _pace(clock: _Clock, started: float, step_s: float) -> None:
    time.sleep(max(0.0, step_s - (time.perf_counter() - started)))
    clock.mark("sleep")


Step = Callable[[_Clock, int, float], bool]
"""One training step: ``(clock, data index, step seconds) -> committed``."""


def _static_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, update: bool) -> Step:
    def step(clock: _Clock, index: int, step_s: float) -> bool:
        started = clock.start()
        optimizer.zero_grad()
        _compute(model, index, rank)
        clock.mark("compute")
        _pace(clock, started, step_s)
        if update:
            optimizer.step()
            clock.mark("update")
        return True

    return step


def _gang_step(model: nn.Module, optimizer: torch.optim.Optimizer, gang: Any, rank: int, update: bool) -> Step:
    def step(clock: _Clock, index: int, step_s: float) -> bool:
        started = clock.start()
        with gang.step():
            clock.mark("enter")
            optimizer.zero_grad()
            _compute(model, index, rank)
            clock.mark("compute")
            _pace(clock, started, step_s)
            committed = bool(gang.should_commit())
            clock.mark("commit")
            if committed and update:
                optimizer.step()
                clock.mark("update")
        clock.mark("exit")
        return committed

    return step


def _torchft_step(model: nn.Module, optimizer: torch.optim.Optimizer, manager: Any, rank: int, update: bool) -> Step:
    def step(clock: _Clock, index: int, step_s: float) -> bool:
        started = clock.start()
        manager.start_quorum()
        clock.mark("enter")
        optimizer.zero_grad()
        _compute(model, index, rank)
        clock.mark("compute")
        _pace(clock, started, step_s)
        committed = bool(manager.should_commit())
        clock.mark("commit")
        if committed and update:
            optimizer.step()
            clock.mark("update")
        return committed

    return step


# --------------------------------------------------------------------------------------------------
# Joining: gang.ft and torchft
# --------------------------------------------------------------------------------------------------


def _join_gang(
    model: nn.Module,
    clock: _Clock,
    replica: int,
    replica_rank: int,
    min_replicas: int,
    heartbeat_s: float | None = None,
) -> Any:
    """Join replica ``replica`` as its process ``replica_rank`` and hand the model's averaging to the gang."""
    from gang.ft import ReplicaGang, replica_process_group

    gang = ReplicaGang.join(
        replica_id=str(replica),
        replica_rank=replica_rank,
        replica_size=PROCESSES,
        state_dict=lambda: _shards(model),
        load_state_dict=_loader(model),
        min_replicas=min_replicas,
        timeout=GANG_TIMEOUT,
        heartbeat_timeout=timedelta(seconds=heartbeat_s) if heartbeat_s else None,
    )
    gang.replicate_fsdp(model)
    untimed = replica_process_group.average  # replicate_fsdp's hooks call it by name: time each call

    def average(gang: Any, tensor: Tensor) -> None:
        clock.mark("compute")
        untimed(gang, tensor)
        clock.mark("average")

    replica_process_group.average = average
    return gang


def _replica_store(group: dist.ProcessGroup, replica_rank: int) -> Any:
    """A ``TCPStore`` for torchft's replica group: process 0 of the replica serves it; returns it (or a client)."""
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if replica_rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, group=group, group_src=0)
    return store or TCPStore("127.0.0.1", port[0], is_master=False, wait_for_workers=False)


def _join_torchft(
    model: nn.Module,
    clock: _Clock,
    replica: int,
    replica_rank: int,
    min_replicas: int,
    lighthouse: str,
    group: dist.ProcessGroup,
) -> Any:
    """A torchft ``Manager`` for this process; FSDP2's all-reduce hook averages through it."""
    torchft: Any = importlib.import_module("torchft")
    store = _replica_store(group, replica_rank)
    timeout = timedelta(seconds=MANAGER_TIMEOUT_S)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=_loader(model),
        state_dict=lambda: _shards(model),
        min_replica_size=min_replicas,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=replica_rank,
        world_size=PROCESSES,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"hsdp_{replica}",
    )
    manager.bench_store = store  # kept alive with the manager
    hook = _averaging(clock, lambda output: manager.allreduce(output).wait())
    for m in _fsdp_modules(model):
        m.set_all_reduce_hook(hook)
    return manager


# --------------------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------------------


def worker_overhead(args: argparse.Namespace) -> None:
    """One of 4 processes: static HSDP and fault-tolerant HSDP in interleaved rounds; rank 0 prints the result."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    replica, replica_rank = divmod(rank, PROCESSES)
    mesh = init_device_mesh("cpu", (REPLICAS, PROCESSES), mesh_dim_names=("rdp", "sdp"))
    clock = _Clock()
    shape = SHAPES[args.step_ms]
    static_model, static_optimizer = _model(mesh, *shape)
    ft_model, ft_optimizer = _model(mesh["sdp"], *shape)  # the replica's own 2 processes
    closer: Callable[[], None]
    if args.impl == "gang":
        gang = _join_gang(ft_model, clock, replica, replica_rank, REPLICAS)
        ft_step = _gang_step(ft_model, ft_optimizer, gang, rank, not args.no_update)
        closer = gang.close
    else:
        group = mesh["sdp"].get_group()
        manager = _join_torchft(ft_model, clock, replica, replica_rank, REPLICAS, args.lighthouse, group)
        ft_step = _torchft_step(ft_model, ft_optimizer, manager, rank, not args.no_update)
        closer = lambda: manager.shutdown(wait=False)  # noqa: E731
    steps = {"static": _static_step(static_model, static_optimizer, rank, not args.no_update), "ft": ft_step}
    step_s, index = args.step_ms / 1000, 0
    for name in steps:  # warm-up (the first fault-tolerant step forms the first quorum)
        for _ in range(3):
            steps[name](clock, index, step_s)
            index += 1
    times: dict[str, list[list[float]]] = {"static": [], "ft": []}  # per step: total, then PHASES
    for round_ in range(args.rounds):
        for name in ("static", "ft") if round_ % 2 == 0 else ("ft", "static"):
            for _ in range(args.steps_per_round):
                if not steps[name](clock, index, step_s):
                    raise RuntimeError(f"an {args.impl} step was not committed on rank {rank}")
                index += 1
                times[name].append([sum(clock.phases.values()), *(clock.phases[p] for p in PHASES)])
    # The slowest process's time of each step, and its phases.
    local = torch.tensor(times["static"] + times["ft"], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    table = torch.stack(gathered)  # [process, step, 1 + phases]
    slowest = table[:, :, 0].argmax(0)
    rows = table[slowest, torch.arange(len(local))].tolist()
    closer()
    dist.destroy_process_group()
    if rank == 0:
        count = len(times["static"])
        print("@result " + json.dumps({"static": rows[:count], "ft": rows[count:]}), flush=True)


def worker_recovery(args: argparse.Namespace) -> None:
    """One process of a replica (a torchrun of 2): train until killed, printing each committed step."""
    print(f"pid {os.getpid()}", flush=True)
    print(f"stage imported {time.time():.6f}", flush=True)  # torch and the benchmark imported
    rank = int(os.environ["RANK"])
    replica = int(args.replica)
    clock = _Clock()
    if args.impl == "gang":
        from gang import create_default_gang, create_fsdp_gangs, create_parallel_gangs
        from gang_mesh import fsdp_mesh

        mesh = fsdp_mesh(create_fsdp_gangs(create_parallel_gangs(create_default_gang(torch.device("cpu")))))
        model, optimizer = _model(mesh, *SHAPES[50])
        gang = _join_gang(model, clock, replica, rank, 1, RECOVERY_TIMEOUT_S)
        step = _gang_step(model, optimizer, gang, replica * PROCESSES + rank, True)

        def number() -> int:
            return int(gang.step_number)

        def size() -> int:
            return int(gang.size)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (PROCESSES,), mesh_dim_names=("sdp",))
        model, optimizer = _model(mesh, *SHAPES[50])
        manager = _join_torchft(model, clock, replica, rank, 1, args.lighthouse, mesh.get_group())
        step = _torchft_step(model, optimizer, manager, replica * PROCESSES + rank, True)

        def number() -> int:
            return int(manager.current_step())

        def size() -> int:
            return int(manager.num_participants())

    print(f"stage joined {time.time():.6f}", flush=True)  # model sharded, fault tolerance joined
    while True:
        if step(clock, number(), args.step_ms / 1000):
            print(f"commit {number()} {time.time():.6f} {size()}", flush=True)


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


class _Runner:
    """Starts the torchruns and the coordinator (store or Lighthouse) of one implementation."""

    def __init__(self, impl: str, torchft_python: str | None) -> None:
        self.impl = impl
        self.python = torchft_python if impl == "torchft" else None
        self.env = torchft_env() if impl == "torchft" else {}

    def coordinator(self, job: LocalJob, min_replicas: int, timeout_s: float) -> dict[str, str]:
        """Start gang.ft's store or torchft's Lighthouse; return the environment that reaches it."""
        if self.impl == "gang":
            return {"GANG_FT_STORE": job.start_store()}
        port = free_port()
        argv = ["-m", "benchmarks.ft_torchft", "--port", str(port), "--min-replicas", str(min_replicas)]
        job.start("lighthouse", [*argv, "--timeout", str(timeout_s)], self.env, python=self.python)
        wait_for_port(port, 60)
        return {"BENCH_LIGHTHOUSE": f"http://127.0.0.1:{port}"}

    def torchrun(self, job: LocalJob, name: str, nproc: int, args: list[str], env: dict[str, str]) -> float:
        """Start ``torchrun -m benchmarks.ft_hsdp ARGS`` of ``nproc`` processes as ``name``; return its launch time."""
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        argv += ["-m", "benchmarks.ft_hsdp", *args, "--impl", self.impl]
        return job.start(name, argv, {**self.env, "OMP_NUM_THREADS": "1", **env}, python=self.python)


def _fail(job: LocalJob, error: Exception) -> RuntimeError:
    """The error with the last 40 lines of each process (torchft's ``[INFO]`` log lines left out)."""
    tails = [
        f"--- {name}:\n" + "\n".join([text for text in job.output(name) if "[INFO]" not in text][-40:])
        for name in job.names()
    ]
    return RuntimeError(f"{error}\n" + "\n".join(tails))


def _expect(job: LocalJob, match: Callable[[Line], bool], timeout: float) -> Line:
    """:meth:`LocalJob.expect` (which fails as soon as a process the job did not stop exits with an
    error); a failure or a timeout raises with the tail of every process's output."""
    try:
        return job.expect(match, timeout)
    except (TimeoutError, RuntimeError) as error:
        raise _fail(job, error) from None


def per_step(runner: _Runner, step_ms: int, rounds: int, update: bool = True) -> dict[str, list[list[float]]]:
    """Run the interleaved static and fault-tolerant rounds; return each step's slowest time and phases
    (without optimizer steps unless ``update``)."""
    with LocalJob(echo=False) as job:
        env = runner.coordinator(job, REPLICAS, MANAGER_TIMEOUT_S)
        args = ["overhead", f"--step-ms={step_ms}", f"--rounds={rounds}", *([] if update else ["--no-update"])]
        if "BENCH_LIGHTHOUSE" in env:
            args.append(f"--lighthouse={env.pop('BENCH_LIGHTHOUSE')}")
        runner.torchrun(job, "world", REPLICAS * PROCESSES, args, env)
        line = _expect(job, lambda line: line.text.startswith("@result "), 900)
        job.wait("world", 120)
    result: dict[str, list[list[float]]] = json.loads(line.text.removeprefix("@result "))
    return result


def recovery(runner: _Runner, cycles: int) -> dict[str, list[float]]:
    """Per cycle: seconds from SIGKILL to replica 0's next commit, and from a restart to replica 1's first commit."""
    samples: dict[str, list[float]] = {
        key: [] for key in ("kill_to_commit", "restart_to_commit", "restart_to_imported", "restart_to_joined")
    }
    with LocalJob(echo=False) as job:
        env = runner.coordinator(job, 1, RECOVERY_TIMEOUT_S)
        args = ["recovery", "--step-ms=50"]
        if "BENCH_LIGHTHOUSE" in env:
            args.append(f"--lighthouse={env.pop('BENCH_LIGHTHOUSE')}")

        def start(r: int) -> float:
            replica_env = {**env, "GANG_FT_REPLICA_ID": str(r)}
            return runner.torchrun(job, f"replica {r}", PROCESSES, [*args, f"--replica={r}"], replica_env)

        def commit(r: int, after: float, size: int = 0) -> float:
            """The time of replica ``r``'s first commit after ``after`` (in a quorum of ``size`` replicas, if given)."""

            def match(line: Line) -> bool:
                # the 2 processes of a torchrun share its output: a line may be two lines run together
                found = _COMMIT.fullmatch(line.text)
                return (
                    line.name == f"replica {r}"
                    and found is not None
                    and float(found[2]) > after
                    and size in (0, int(found[3]))
                )

            found = _COMMIT.fullmatch(_expect(job, match, 300).text)
            assert found is not None
            return float(found[2])

        def pids(name: str) -> list[int]:
            return [int(found[1]) for text in job.output(name) if (found := _PID.fullmatch(text))]

        try:
            for r in range(REPLICAS):
                start(r)
            for _ in range(cycles):
                commit(1, time.time() + 3)  # a few steps in, both replicas training
                job.ending("replica 1")
                killed = time.time()
                os.kill(pids("replica 1")[-1], signal.SIGKILL)  # one process: its torchrun ends the replica
                # torchft's vote is per replica: a step the dead replica took part in may still commit
                samples["kill_to_commit"].append(commit(0, killed, REPLICAS - 1) - killed)
                job.wait("replica 1", 120)
                launched = start(1)
                samples["restart_to_commit"].append(commit(1, launched) - launched)
                stages = [(m[1], float(m[2])) for text in job.output("replica 1") if (m := _STAGE.fullmatch(text))]
                for stage in ("imported", "joined"):  # the later of the replica's two processes
                    latest = max(t for name, t in stages if name == stage and t > launched)
                    samples[f"restart_to_{stage}"].append(latest - launched)
        finally:
            for pid in [p for r in range(REPLICAS) for p in pids(f"replica {r}")]:  # torchrun's workers
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return samples


def _median(values: list[float]) -> float:
    return statistics.median(values)


def step_rows(impl: str, op: str, result: dict[str, list[list[float]]], rounds: int) -> list[Row]:
    """The ``static`` and fault-tolerant rows of one per-step measurement (with the phase breakdown)."""
    static, ft = ([row[0] for row in result[k]] for k in ("static", "ft"))
    per_round = len(static) // rounds
    paired = _median(
        [
            _median(ft[r * per_round : (r + 1) * per_round]) / _median(static[r * per_round : (r + 1) * per_round])
            for r in range(rounds)
        ]
    )
    rows = []
    for name, times, key in (
        (("static" if impl == "gang.ft" else "static@torchft"), static, "static"),
        (impl, ft, "ft"),
    ):
        phases = {p: round(_median([row[1 + i] for row in result[key]]) * 1e3, 2) for i, p in enumerate(PHASES)}
        extra: dict[str, Any] = {"iters": len(times), "phases_ms": phases}
        if key == "ft":
            extra.update(ratio=_median(ft) / _median(static), paired_ratio=paired)
        rows.append(make_row(name, op, 0, REPLICAS * PROCESSES, _median(times), bandwidth=False, **extra))
    return rows


def _print_rows(rows: list[Row]) -> None:
    for row in rows:
        ratio = f"ratio {row['ratio']:.3f} (paired {row['paired_ratio']:.3f})" if "ratio" in row else ""
        phases = " ".join(f"{p} {v:.1f}" for p, v in row["phases_ms"].items() if v >= 0.05)
        print(f"{row['op']:>16} {row['impl']:>15} {row['time_us'] / 1e3:7.1f} ms {ratio:>30}  [{phases}]", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["overhead", "recovery"])
    parser.add_argument("--impl", choices=["gang", "torchft"], default="gang")
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=8)
    parser.add_argument("--step-ms", type=int, default=50, choices=sorted(SHAPES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--torchft-python",
        default=os.environ.get("TORCHFT_PYTHON") or None,
        help="interpreter of a venv with torchft 0.2 (default: $TORCHFT_PYTHON; none: no comparison)",
    )
    parser.add_argument("--hsdp-impls", nargs="*", default=["gang", "torchft"], choices=["gang", "torchft"])
    parser.add_argument("--hsdp-skip", nargs="*", default=[], choices=["overhead", "recovery"])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each per-step measurement, alternating impls")
    parser.add_argument(
        "--no-update",
        action="store_true",
        help="a diagnostic: no optimizer step in any implementation (ops *_no_update)",
    )
    args, _ = parser.parse_known_args()
    if args.mode is not None:
        (worker_overhead if args.mode == "overhead" else worker_recovery)(args)
        return
    impls = [impl for impl in args.hsdp_impls if impl == "gang" or args.torchft_python]
    if "torchft" in impls and (why := check_torchft_python(args.torchft_python)) is not None:
        print(f"# torchft left out: {why}", flush=True)
        impls.remove("torchft")
    rounds = 6 if args.quick else 12
    rows: list[Row] = []
    print(f"\n# HSDP across fault-tolerant replicas: {REPLICAS} replicas of {PROCESSES} processes, gloo", flush=True)
    for step_ms in (50, 10) if "overhead" not in args.hsdp_skip else ():
        op = f"hsdp_step_{step_ms}ms" + ("_no_update" if args.no_update else "")
        ratios: dict[str, list[tuple[float, float, float]]] = {}
        for run in range(args.repeat):
            for impl in impls if run % 2 == 0 else impls[::-1]:
                try:
                    result = per_step(_Runner(impl, args.torchft_python), step_ms, rounds, not args.no_update)
                except (RuntimeError, TimeoutError) as error:  # a coordinator that did not start (load)
                    print(f"# {impl} HSDP per-step cost ({step_ms} ms) failed: {error}", flush=True)
                    continue
                name = "gang.ft" if impl == "gang" else "torchft"
                new = step_rows(name, op, result, rounds)
                load = os.getloadavg()[0]
                for row in new:
                    row.update(run=run, load=round(load, 1))
                _print_rows(new)
                rows += new
                ratios.setdefault(name, []).append((new[1]["ratio"], new[1]["paired_ratio"], load))
        if args.repeat > 1:
            for name, found in ratios.items():
                listed = ", ".join(f"{r:.3f}/{p:.3f}@{load:.0f}" for r, p, load in found)
                print(
                    f"{op:>16} {name:>15} median ratio "
                    f"{_median([r for r, _, _ in found]):.3f} paired {_median([p for _, p, _ in found]):.3f} "
                    f"(runs ratio/paired@load: {listed})",
                    flush=True,
                )
    for impl in impls if "recovery" not in args.hsdp_skip else ():
        try:
            measured = recovery(_Runner(impl, args.torchft_python), 2 if args.quick else 4)
        except RuntimeError as error:
            print(f"# {impl} HSDP recovery failed: {error}", flush=True)
            continue
        name = "gang.ft" if impl == "gang" else "torchft"
        for op, values in measured.items():
            row = make_row(
                name, f"hsdp_{op}", 0, REPLICAS * PROCESSES, _median(values), bandwidth=False, samples=values
            )
            rows.append(row)
            listed = ", ".join(f"{v:.2f}" for v in values)
            print(f"{'hsdp_' + op:>24} {name:>8} {row['time_us'] / 1e6:.2f} s (cycles: {listed})", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.out is not None:
        out = args.out.with_name(f"{args.out.stem}_ft_hsdp.json")
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
