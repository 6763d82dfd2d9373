"""Fault tolerance: what a :class:`gang.ft.ReplicaGang` step costs, and how fast a job recovers.

``python -m benchmarks.ft [--quick] [--out results.json] [--torchft-python PATH]`` (``nox -s bench``
runs it after the collective benchmarks) starts local processes itself: 3 replicas of 1 process
each, gloo on CPU, and the coordination store (``python -m gang.ft.store``). Two measurements:

* **Per-step cost** (op ``ft_step_50ms`` and ``ft_step_10ms``): one data-parallel training step of
  an MLP (its gradients accumulated over enough micro-batches of real matmuls that their compute
  takes about 50 or 10 ms here, as the replicas measure it before the rounds), the flattened
  gradients all-reduced (MEAN) in one call, an SGD update. The same processes run it through a
  plain :class:`gang.ProcessGroupGang` (impl ``plain``) and inside ``with gang.step():`` of a
  ``ReplicaGang`` with ``should_commit()`` (impl ``gang.ft``), in interleaved rounds (the order
  alternates every round). A step's time is that of the slowest replica; ``ratio`` is the ratio of
  the medians and ``paired_ratio`` the median over rounds of each round's ratio of medians.
* **Recovery** (ops ``ft_kill_to_commit`` and ``ft_restart_to_commit``): the replicas train with the
  50 ms step; replica 2 is ``SIGKILL``\\ ed at a random moment of a step, and the time from the
  signal to the survivors' first committed step without it is measured (the later of the two
  survivors), with gang.ft's ``timeout`` at 1 s and again at 60 s (impl ``gang.ft@60s``; both with
  the default ``heartbeat_timeout``, whose silence drops the dead replica); then replica 2 is
  started again and the time from its launch (``Popen``) to its first committed step (after
  healing from a peer) is measured, with the moments it had imported torch (``imported``), built
  its model and optimizer (``built``: torch's first optimizer imports ``torch._dynamo``, about
  1.2 s on an idle core here) and joined. Every time is a wall-clock
  timestamp taken in the process where the event happened.

With ``--torchft-python`` or ``TORCHFT_PYTHON`` (the interpreter of a separate virtual environment
with torchft 0.2 and torch 2.13; torchft is never a dependency of gang), the same model and
schedule run through torchft's ``Manager`` and Lighthouse (impl ``torchft``, with its own
``plain`` baseline rows ``plain@torchft``), with the same timeouts; see ``benchmarks/ft_torchft.py``.

A worker process (``python -m benchmarks.ft worker ...``) is one replica; the driver prints a table
and writes ``<out stem>_ft.json`` (rows as in ``gang.bench.metrics.make_row``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gang.bench.metrics import Row, make_row, median
from gang.testing import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _ft_launch import Line, LocalJob, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
REPLICAS = 3
WIDTH = 256
DEPTH = 4
MICRO_BATCH = 64
STEP_TIMEOUT_S = 5.0
"""The timeout of both fault-tolerant implementations while their per-step cost is measured."""
RECOVERY_TIMEOUT_S = 1.0
"""The timeout of both while their recovery is measured: gang.ft's ``timeout`` (and so its
``quorum_timeout``; its ``heartbeat_timeout`` is the default), torchft's Lighthouse join
and heartbeat timeouts (its Manager's own timeouts stay at 5 s, see ``benchmarks/ft_torchft.py``)."""

LONG_TIMEOUT_S = 60.0
"""gang.ft's ``timeout`` in the second recovery measurement (``heartbeat_timeout`` left at its default)."""

# --------------------------------------------------------------------------------------------------
# One replica (a worker process)
# --------------------------------------------------------------------------------------------------


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Return the benchmark's MLP (the same initial weights in every process) and its SGD optimizer."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def flat_grads(model: nn.Module, step: int, replica: int, micro_batches: int) -> Tensor:
    """Accumulate the gradients of ``micro_batches`` micro-batches of ``step`` and return them as one flat tensor."""
    generator = torch.Generator().manual_seed(step * 1000 + replica)
    model.zero_grad()
    for _ in range(micro_batches):
        x = torch.randn(MICRO_BATCH, WIDTH, generator=generator)
        loss = (model(x) - x).square().mean() / micro_batches
        loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def apply_grads(model: nn.Module, optimizer: torch.optim.Optimizer, flat: Tensor) -> None:
    """Write the reduced ``flat`` gradients back into the parameters and take the optimizer step."""
    offset = 0
    for param in model.parameters():
        assert param.grad is not None
        param.grad.copy_(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()
    optimizer.step()


class Trainer(Protocol):
    """One implementation of a data-parallel training step."""

    @property
    def step_number(self) -> int: ...

    @property
    def quorum_size(self) -> int: ...

    def train_step(self, micro_batches: int) -> bool:
        """Run one step; return whether it was committed."""
        ...

    def close(self) -> None: ...


class StateOwner:
    """The model and optimizer of one implementation, with the state-dict callbacks healing uses."""

    def __init__(self, replica: int) -> None:
        self.replica = replica
        self.model, self.optimizer = make_model()

    def state_dict(self) -> dict[str, Any]:
        """Return the state a healthy replica sends to one that heals."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the state received from a healthy replica."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class PlainTrainer(StateOwner):
    """The baseline: a data-parallel step over a plain :class:`gang.ProcessGroupGang`."""

    def __init__(self, replica: int, port: int) -> None:
        from gang import ProcessGroupGang

        super().__init__(replica)
        address = f"tcp://127.0.0.1:{port}"
        timeout = timedelta(seconds=60)
        dist.init_process_group("gloo", init_method=address, rank=replica, world_size=REPLICAS, timeout=timeout)
        self.gang = ProcessGroupGang.from_process_group(dist.group.WORLD, torch.device("cpu"))  # type: ignore[arg-type]
        self._step = 0

    @property
    def step_number(self) -> int:
        return self._step

    @property
    def quorum_size(self) -> int:
        return self.gang.size

    def train_step(self, micro_batches: int) -> bool:
        from gang import ReduceOperation

        flat = flat_grads(self.model, self._step, self.replica, micro_batches)
        self.gang.all_reduce(flat, ReduceOperation.MEAN)
        apply_grads(self.model, self.optimizer, flat)
        self._step += 1
        return True

    def slowest(self, times: list[float]) -> list[float]:
        """Return, per entry, the largest of ``times`` over the replicas."""
        local = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(local, dist.ReduceOp.MAX)
        return [float(t) for t in local.tolist()]

    def close(self) -> None:
        self.gang.close()
        dist.destroy_process_group()


class GangTrainer(StateOwner):
    """The step inside ``with gang.step():`` of a :class:`gang.ft.ReplicaGang` (joined from the environment)."""

    def __init__(self, replica: int, min_replicas: int, timeout_s: float, on_built: Callable[[], None]) -> None:
        from gang.ft import ReplicaGang

        super().__init__(replica)
        on_built()
        self.gang = ReplicaGang.join(
            device=torch.device("cpu"),
            state_dict=self.state_dict,
            load_state_dict=self.load_state_dict,
            min_replicas=min_replicas,
            timeout=timedelta(seconds=timeout_s),
        )

    @property
    def step_number(self) -> int:
        return self.gang.step_number

    @property
    def quorum_size(self) -> int:
        return self.gang.size

    def train_step(self, micro_batches: int) -> bool:
        from gang import ReduceOperation

        with self.gang.step():
            flat = flat_grads(self.model, self.gang.step_number, self.replica, micro_batches)
            self.gang.all_reduce(flat, ReduceOperation.MEAN)
            committed = self.gang.should_commit()
            if committed:
                apply_grads(self.model, self.optimizer, flat)
        return committed

    def close(self) -> None:
        self.gang.close()


def _calibrate(plain: PlainTrainer, step_ms: float) -> int:
    """Return the number of micro-batches whose compute takes about ``step_ms`` (the same on every replica).

    The time of a micro-batch is the fastest of 30 measurements, the largest over the replicas:
    on a busy machine that is closer to the cost of the compute than a median is.
    """
    flat_grads(plain.model, 0, plain.replica, 2)  # warm-up
    per_batch = []
    for _ in range(30):
        start = time.perf_counter()
        flat_grads(plain.model, 0, plain.replica, 1)
        per_batch.append(time.perf_counter() - start)
    fastest = plain.slowest([min(per_batch)])[0]
    return max(1, round(step_ms / 1e3 / fastest))


def _make_trainer(args: argparse.Namespace, min_replicas: int, on_built: Callable[[], None] = lambda: None) -> Trainer:
    """Build the model and optimizer, call ``on_built``, then join the fault-tolerant job."""
    if args.impl == "torchft":
        from benchmarks.ft_torchft import TorchftTrainer

        owner = StateOwner(args.replica)
        on_built()
        parts = _train_step_parts(owner)
        return TorchftTrainer(owner, args.replica, min_replicas, args.lighthouse, args.timeout, parts)
    return GangTrainer(args.replica, min_replicas, args.timeout, on_built)


def _train_step_parts(owner: StateOwner) -> tuple[Callable[[int, int], Tensor], Callable[[Tensor], None]]:
    """The compute and the update of a step of ``owner``'s model, for trainers defined elsewhere."""
    return (
        lambda step, micro_batches: flat_grads(owner.model, step, owner.replica, micro_batches),
        lambda flat: apply_grads(owner.model, owner.optimizer, flat),
    )


def worker_overhead(args: argparse.Namespace) -> None:
    """Time plain and fault-tolerant steps in interleaved rounds; replica 0 prints the result."""
    plain = PlainTrainer(args.replica, args.plain_port)
    ft = _make_trainer(args, REPLICAS)
    micro_batches = args.micro_batches or _calibrate(plain, args.step_ms)
    trainers: dict[str, Trainer] = {"plain": plain, "ft": ft}
    for trainer in trainers.values():  # warm-up (the first fault-tolerant step forms the first quorum)
        for _ in range(3):
            trainer.train_step(micro_batches)
    times: dict[str, list[float]] = {"plain": [], "ft": []}
    for round_ in range(args.rounds):
        for name in ("plain", "ft") if round_ % 2 == 0 else ("ft", "plain"):
            for _ in range(args.steps_per_round):
                start = time.perf_counter()
                committed = trainers[name].train_step(micro_batches)
                times[name].append(time.perf_counter() - start)
                if not committed:
                    raise RuntimeError(f"a {args.impl} step was not committed on replica {args.replica}")
    slow = plain.slowest(times["plain"] + times["ft"])
    count = len(times["plain"])
    if args.replica == 0:
        result = {"micro_batches": micro_batches, "plain": slow[:count], "ft": slow[count:]}
        print("@result " + json.dumps(result), flush=True)
    ft.close()
    plain.close()


def worker_recovery(args: argparse.Namespace) -> None:
    """Train until killed, printing a timestamped line per committed step (and the moments of its start)."""
    print(f"@imported {time.time()}", flush=True)
    trainer = _make_trainer(args, 1, lambda: print(f"@built {time.time()}", flush=True))
    print(f"@joined {time.time()}", flush=True)
    while True:
        before = trainer.step_number
        if trainer.train_step(args.micro_batches):
            print(f"@commit {trainer.step_number} {time.time()} {trainer.quorum_size} {before}", flush=True)


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def torchft_env() -> dict[str, str]:
    """The environment of a process under the torchft interpreter: gang from this checkout's sources.

    gang is not installed in torchft's virtual environment; its dependencies (numpy) must be.
    """
    paths = [str(ROOT), str(ROOT / "packages" / "gang" / "src"), str(ROOT / "packages" / "gang-mesh" / "src")]
    paths += filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))
    return {"PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


def check_torchft_python(python: str) -> str | None:
    """Return why ``python`` cannot run the torchft side (``None`` if it can): it must import torchft 0.2 and gang."""
    probe = "import torchft, gang, gang_mesh, importlib.metadata as m; print(m.version('torchft'))"
    try:
        done = subprocess.run(
            [python, "-c", probe], env={**os.environ, **torchft_env()}, capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{python} could not run: {error}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return (
            f"{python} cannot import torchft and gang ({last}); make its venv with "
            "`pip install -c constraints.txt torch==2.13.0 torchft==0.2.0 numpy`"
        )
    if not done.stdout.strip().startswith("0.2"):
        return f"{python} has torchft {done.stdout.strip()}, not 0.2"
    return None


class Runner:
    """Starts the processes of one measurement for one implementation (``gang`` or ``torchft``)."""

    def __init__(self, impl: str, torchft_python: str | None, timeout_s: float) -> None:
        self.impl = impl
        self.timeout_s = timeout_s
        self.python = torchft_python if impl == "torchft" else sys.executable
        self.module = "benchmarks.ft"
        """The module whose ``worker`` the replicas run."""
        if impl == "torchft":  # gang itself (for the plain baseline) from the sources, not installed there
            self.env = torchft_env()
        else:
            paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
            self.env = {"PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}

    def start_coordinator(self, job: LocalJob, timeout: float = 60) -> dict[str, str]:
        """Start the store (gang) or the Lighthouse (torchft); return the worker arguments/env that reach it
        (``timeout``: the longest wait for it to listen)."""
        if self.impl == "torchft":
            port = free_port()
            job.start(
                "lighthouse",
                [
                    "-m",
                    "benchmarks.ft_torchft",
                    "--port",
                    str(port),
                    "--min-replicas",
                    "2",
                    "--timeout",
                    str(self.timeout_s),
                ],
                self.env,
                python=self.python,
            )
            wait_for_port(port, timeout)
            return {"--lighthouse": f"http://127.0.0.1:{port}"}
        return {"GANG_FT_STORE": job.start_store(timeout=timeout)}

    def start_replica(self, job: LocalJob, replica: int, reach: dict[str, str], args: Sequence[str]) -> float:
        """Start replica ``replica`` (a ``worker`` process); return its launch time."""
        env = {**self.env, **{k: v for k, v in reach.items() if not k.startswith("--")}}
        env["GANG_FT_REPLICA_ID"] = str(replica)
        flags = [x for k, v in reach.items() if k.startswith("--") for x in (k, v)]
        argv = ["-m", self.module, "worker", "--impl", self.impl, "--replica", str(replica), *flags, *args]
        argv += ["--timeout", str(self.timeout_s)]
        return job.start(f"replica {replica}", argv, env, python=self.python)


def _fail(job: LocalJob, error: Exception) -> RuntimeError:
    tails = [f"--- {name}:\n" + "\n".join(job.output(name)[-30:]) for name in job.names()]
    return RuntimeError(f"{error}\n" + "\n".join(tails))


def measure_overhead(runner: Runner, step_ms: float, rounds: int, micro_batches: int) -> dict[str, Any]:
    """Run the per-step cost measurement on 3 replicas; return replica 0's result."""
    with LocalJob(echo=False) as job:
        reach = runner.start_coordinator(job)
        port = free_port()
        args = ["overhead", "--plain-port", str(port), "--step-ms", str(step_ms), "--rounds", str(rounds)]
        args += ["--micro-batches", str(micro_batches)]
        for replica in range(REPLICAS):
            runner.start_replica(job, replica, reach, args)
        try:
            line = job.expect(lambda line: line.text.startswith("@result "), 600)
        except (TimeoutError, RuntimeError) as error:
            raise _fail(job, error) from None
        result: dict[str, Any] = json.loads(line.text.removeprefix("@result "))
        for replica in range(REPLICAS):
            job.wait(f"replica {replica}", 60)
    return result


def _commit(line: Line) -> tuple[int, float, int, int] | None:
    """Parse ``@commit step time quorum_size step_before ...`` (None for any other line)."""
    if not line.text.startswith("@commit "):
        return None
    step, stamp, size, before = line.text.split()[1:5]
    return int(step), float(stamp), int(size), int(before)


def measure_recovery(runner: Runner, cycles: int, micro_batches: int) -> list[dict[str, float]]:
    """Kill replica 2 and start it again ``cycles`` times; return the times of each cycle."""
    samples: list[dict[str, float]] = []
    with LocalJob(echo=False) as job:
        reach = runner.start_coordinator(job)
        args = ["recovery", "--micro-batches", str(micro_batches)]
        for replica in range(REPLICAS):
            runner.start_replica(job, replica, reach, args)
        try:
            for _ in range(cycles):
                _steady(job, REPLICAS)
                time.sleep(random.uniform(0, 0.05))  # anywhere in a step
                killed = job.kill("replica 2")
                survivors: dict[str, float] = {}
                while len(survivors) < 2:
                    line = job.expect(lambda line: (c := _commit(line)) is not None and c[2] == 2, timeout=120)
                    survivors.setdefault(line.name, _commit(line)[1])  # type: ignore[index]
                _steady(job, 2)
                launched = runner.start_replica(job, 2, reach, args)
                first = job.expect(lambda line: line.name == "replica 2" and line.text.startswith("@commit"), 120)
                commit = _commit(first)
                assert commit is not None
                stamps = _launch_stamps(job.output("replica 2"))
                samples.append(
                    {
                        "kill_to_commit": max(survivors.values()) - killed,
                        "restart_to_commit": commit[1] - launched,
                        "restart_to_imported": stamps.get("@imported", float("nan")) - launched,
                        "restart_to_built": stamps.get("@built", float("nan")) - launched,
                        "restart_to_joined": stamps.get("@joined", float("nan")) - launched,
                        "healed_from_step": commit[3],
                        "healed_to_step": commit[0],
                    }
                )
                last = samples[-1]
                print(
                    f"# {runner.impl:>8} cycle {len(samples)}: kill -> survivors' next commit "
                    f"{last['kill_to_commit']:.2f} s, launch -> first commit {last['restart_to_commit']:.2f} s "
                    f"(imported {last['restart_to_imported']:.2f} s, model built {last['restart_to_built']:.2f} s, "
                    f"joined {last['restart_to_joined']:.2f} s, "
                    f"healed step {commit[3]} -> {commit[0]})",
                    flush=True,
                )
        except TimeoutError as error:
            raise _fail(job, error) from None
    return samples


def _launch_stamps(output: list[str]) -> dict[str, float]:
    """Return the ``@imported``, ``@built`` and ``@joined`` times of the last start of a replica."""
    last = max(i for i, text in enumerate(output) if text.startswith("@imported"))
    stamps = [text.split() for text in output[last:] if text.startswith(("@imported", "@built", "@joined"))]
    return {name: float(stamp) for name, stamp in stamps}


def _steady(job: LocalJob, size: int, steps: int = 5, timeout: float = 120) -> None:
    """Wait until every one of ``size`` replicas has committed ``steps`` steps with a quorum of ``size``
    (``timeout``: the longest wait for one of them)."""
    counts: dict[str, int] = {}
    while len([n for n in counts.values() if n >= steps]) < size:
        line = job.expect(lambda line: (c := _commit(line)) is not None and c[2] == size, timeout=timeout)
        counts[line.name] = counts.get(line.name, 0) + 1


def overhead_rows(impl: str, op: str, result: dict[str, Any], rounds: int) -> list[Row]:
    """Return the ``plain`` and fault-tolerant rows of one per-step cost measurement."""
    plain, ft = result["plain"], result["ft"]
    per_round = len(plain) // rounds
    round_ratios = [
        median(ft[r * per_round : (r + 1) * per_round]) / median(plain[r * per_round : (r + 1) * per_round])
        for r in range(rounds)
    ]
    base = "plain" if impl == "gang.ft" else "plain@torchft"
    extra: dict[str, Any] = {"iters": len(plain), "micro_batches": result["micro_batches"]}
    return [
        make_row(base, op, 0, REPLICAS, median(plain), times_ms=[round(t * 1e3, 2) for t in plain], **extra),
        make_row(
            impl,
            op,
            0,
            REPLICAS,
            median(ft),
            ratio=median(ft) / median(plain),
            paired_ratio=median(round_ratios),
            times_ms=[round(t * 1e3, 2) for t in ft],
            **extra,
        ),
    ]


def recovery_rows(impl: str, samples: list[dict[str, float]], timeout_s: float = RECOVERY_TIMEOUT_S) -> list[Row]:
    """Return the rows of the recovery measurement (median over cycles, every cycle in ``samples``)."""
    rows = []
    for key in ("kill_to_commit", "restart_to_commit"):
        values = [s[key] for s in samples]
        extra: dict[str, Any] = {"samples": values, "timeout_s": timeout_s}
        if key == "restart_to_commit":
            extra["imported_s"] = median(s["restart_to_imported"] for s in samples)
            extra["built_s"] = median(s["restart_to_built"] for s in samples)
            extra["joined_s"] = median(s["restart_to_joined"] for s in samples)
        rows.append(make_row(impl, f"ft_{key}", 0, REPLICAS, median(values), bandwidth=False, **extra))
    return rows


def row_cells(row: Row) -> tuple[str, str, str]:
    """The median time, ratio and paired ratio columns of ``row`` in a printed table."""
    ms = row["time_us"] / 1e3
    time_text = f"{ms:8.1f}ms" if ms < 1000 else f"{ms / 1e3:8.2f} s"
    ratio = f"{row['ratio']:7.3f}" if "ratio" in row else f"{'':7}"
    paired = f"{row['paired_ratio']:7.3f}" if "paired_ratio" in row else f"{'':7}"
    return time_text, ratio, paired


def table(rows: list[Row]) -> str:
    """Return the printed table of the rows."""
    lines = [f"{'op':>22} {'impl':>14} {'median':>10} {'ratio':>7} {'paired':>7}  notes"]
    for row in rows:
        time_text, ratio, paired = row_cells(row)
        notes = ""
        if "samples" in row:
            notes = "samples " + ", ".join(f"{s:.2f}" for s in row["samples"])
            if "imported_s" in row:
                stamps = (f"{name} {row[name + '_s']:.2f} s" for name in ("imported", "built", "joined"))
                notes += "; " + ", ".join(stamps)
        elif "micro_batches" in row:
            notes = f"{row['iters']} steps, {row['micro_batches']} micro-batches"
        lines.append(f"{row['op']:>22} {row['impl']:>14} {time_text} {ratio} {paired}  {notes}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the driver, or one worker (``worker`` as the first argument)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        parser = argparse.ArgumentParser()
        parser.add_argument("mode", choices=["overhead", "recovery"])
        parser.add_argument("--impl", choices=["gang", "torchft"], required=True)
        parser.add_argument("--replica", type=int, required=True)
        parser.add_argument("--lighthouse", default="")
        parser.add_argument("--plain-port", type=int, default=0)
        parser.add_argument("--step-ms", type=float, default=50)
        parser.add_argument("--rounds", type=int, default=10)
        parser.add_argument("--steps-per-round", type=int, default=8)
        parser.add_argument("--micro-batches", type=int, default=0)
        parser.add_argument("--timeout", type=float, default=STEP_TIMEOUT_S)
        args = parser.parse_args(argv[1:])
        (worker_overhead if args.mode == "overhead" else worker_recovery)(args)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and cycles")
    parser.add_argument("--out", default="results.json", help="the rows go to <stem>_ft.json next to it")
    parser.add_argument(
        "--torchft-python",
        default=os.environ.get("TORCHFT_PYTHON") or None,
        help="interpreter of a venv with torchft 0.2 installed (default: $TORCHFT_PYTHON; none: no comparison)",
    )
    parser.add_argument("--ft-skip", nargs="*", default=[], choices=["overhead", "recovery"])
    parser.add_argument("--ft-impls", nargs="*", default=["gang", "torchft"], choices=["gang", "torchft"])
    args, _ = parser.parse_known_args(argv)  # the other benchmarks' arguments pass through nox -s bench
    impls = [impl for impl in args.ft_impls if impl == "gang" or args.torchft_python]
    if "torchft" in impls and (why := check_torchft_python(args.torchft_python)) is not None:
        print(f"# torchft left out: {why}", flush=True)
        impls.remove("torchft")
    rounds, cycles = (6, 2) if args.quick else (16, 5)
    rows: list[Row] = []
    micro_batches: dict[float, int] = {}
    if "overhead" not in args.ft_skip:
        print("\n# fault tolerance: per-step cost, 3 replicas of 1 process, gloo", flush=True)
    for step_ms in (50.0, 10.0) if "overhead" not in args.ft_skip else ():
        for impl in impls:
            runner = Runner(impl, args.torchft_python, STEP_TIMEOUT_S)
            try:
                result = measure_overhead(runner, step_ms, rounds, micro_batches.get(step_ms, 0))
            except RuntimeError as error:
                print(f"# {impl} per-step cost ({step_ms:.0f} ms) failed: {error}", flush=True)
                continue
            micro_batches[step_ms] = result["micro_batches"]  # torchft runs the same compute as gang
            new = overhead_rows("gang.ft" if impl == "gang" else "torchft", f"ft_step_{step_ms:.0f}ms", result, rounds)
            print(table(new).split("\n", 1)[1], flush=True)
            rows += new
    if "recovery" not in args.ft_skip:
        print("\n# fault tolerance: recovery from a SIGKILLed replica (3 replicas, 50 ms steps)", flush=True)
        for impl in impls:
            runner = Runner(impl, args.torchft_python, RECOVERY_TIMEOUT_S)
            batches = micro_batches.get(50.0) or 20
            try:
                samples = measure_recovery(runner, cycles, batches)
            except RuntimeError as error:
                print(f"# {impl} recovery failed: {error}", flush=True)
                continue
            rows += recovery_rows("gang.ft" if impl == "gang" else "torchft", samples)
        # A long collective timeout: a SIGKILLed replica must be dropped on its heartbeat silence
        # (the default `heartbeat_timeout`), not on the collective timeout.
        try:
            samples = measure_recovery(Runner("gang", None, LONG_TIMEOUT_S), cycles, micro_batches.get(50.0) or 20)
        except RuntimeError as error:
            print(f"# gang recovery with a {LONG_TIMEOUT_S:g} s timeout failed: {error}", flush=True)
        else:
            rows += recovery_rows(f"gang.ft@{LONG_TIMEOUT_S:g}s", samples, LONG_TIMEOUT_S)
    write_rows(rows, args.out, "_ft", table(rows))


def write_rows(rows: list[Row], out_arg: str, suffix: str, printed: str) -> None:
    """Print the table ``printed`` and write ``rows`` to ``<stem of out_arg><suffix>.json``."""
    out = Path(out_arg).resolve()
    out = out.with_name(out.stem + suffix + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print("\n" + printed)
    print(f"\nwrote {out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
