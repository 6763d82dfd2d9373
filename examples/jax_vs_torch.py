"""Run every collective on a torch gang and on a JAX gang with the same inputs, and compare.

Under torchrun (``torchrun --standalone --nproc-per-node 4 examples/jax_vs_torch.py``) each
process builds a gloo :class:`~gang.ProcessGroupGang` and a :class:`~gang_jax.JaxGang`, runs the
collectives on both, and rank 0 prints a table: whether the results are equal and how long each
framework took (median of a few repetitions, after a warm-up that compiles the JAX collectives).
Run with plain ``python`` it starts 4 local processes itself.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor

from gang import Gang, ProcessGroupGang, ReduceOperation
from gang.bench.collectives import without_gloo_notice
from gang.testing import launch
from gang_jax import JaxGang

REPEATS = 5
NUMEL = 1 << 16


def _cases(rank: int, size: int) -> dict[str, Callable[[Gang], list[Tensor]]]:
    """Each case runs one collective on a gang and returns the tensors it produced."""
    base = (torch.arange(NUMEL, dtype=torch.float32) % 13) + rank

    def all_reduce(op: ReduceOperation) -> Callable[[Gang], list[Tensor]]:
        def run(g: Gang) -> list[Tensor]:
            t = base.clone()
            g.all_reduce(t, op)
            return [t]

        return run

    def all_gather(g: Gang) -> list[Tensor]:
        out = torch.empty(size, NUMEL)
        g.all_gather(out, base)
        return [out]

    def reduce_scatter(g: Gang) -> list[Tensor]:
        out = torch.empty(NUMEL // size)
        g.reduce_scatter(out, base.reshape(size, -1), ReduceOperation.SUM)
        return [out]

    def all_to_all(g: Gang) -> list[Tensor]:
        out = torch.empty(size, NUMEL // size)
        g.all_to_all(out, base.reshape(size, -1))
        return [out]

    def broadcast(g: Gang) -> list[Tensor]:
        t = base.clone()
        g.broadcast(t, source_rank=size - 1)
        return [t]

    def int64_sum(g: Gang) -> list[Tensor]:
        t = torch.full((NUMEL,), 2**40 + rank, dtype=torch.int64)
        g.all_reduce(t, ReduceOperation.SUM)
        return [t]

    cases = {f"all_reduce {op.name}": all_reduce(op) for op in ReduceOperation}
    cases.update(
        {
            "all_reduce SUM int64": int64_sum,
            "all_gather": all_gather,
            "reduce_scatter SUM": reduce_scatter,
            "all_to_all": all_to_all,
            "broadcast": broadcast,
        }
    )
    return cases


def _time(g: Gang, fn: Callable[[Gang], list[Tensor]]) -> tuple[list[Tensor], float]:
    result = fn(g)  # warm-up (JAX compiles here)
    times = []
    for _ in range(REPEATS):
        g.barrier()
        start = time.perf_counter()
        result = fn(g)
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def compare() -> list[tuple[str, bool, float, float]]:
    """Run every case on both gangs in this process; return (name, equal, torch s, JAX s) rows."""
    torch_gang = ProcessGroupGang.create_default_process_group(torch.device("cpu"))
    jax_gang = JaxGang.create_default()
    rows = []
    try:
        with without_gloo_notice():  # JAX's collectives connect on their first call
            jax_gang.all_reduce(torch.zeros(1), ReduceOperation.SUM)
        for name, fn in _cases(torch_gang.rank, torch_gang.size).items():
            t_out, t_time = _time(torch_gang, fn)
            j_out, j_time = _time(jax_gang, fn)
            equal = all(torch.equal(a, b) for a, b in zip(t_out, j_out, strict=True))
            # A rank whose results differ makes the row "no" everywhere.
            flag = torch.tensor([int(equal)])
            torch_gang.all_reduce(flag, ReduceOperation.MIN)
            rows.append((name, bool(flag.item()), t_time, j_time))
    finally:
        jax_gang.close()
        torch_gang.close()
    return rows


def _print_table(rows: list[tuple[str, bool, float, float]], size: int) -> None:
    print(f"{size} processes, {NUMEL} elements per rank, median of {REPEATS} runs")
    print(f"{'collective':<24} {'torch == JAX':>12} {'torch (ms)':>11} {'JAX (ms)':>9}")
    for name, equal, t, j in rows:
        print(f"{name:<24} {'yes' if equal else 'NO':>12} {t * 1e3:>11.3f} {j * 1e3:>9.3f}")


def _worker() -> tuple[int, int, list[tuple[str, bool, float, float]]]:
    rows = compare()
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), rows


def main() -> int:
    """Compare the frameworks (under torchrun, or on 4 local processes started here); 0 if all equal."""
    if "RANK" in os.environ:
        rank, size, rows = _worker()
        if rank == 0:
            _print_table(rows, size)
    else:
        rank, size, rows = launch(_worker, 4)[0]
        _print_table(rows, size)
    return 0 if all(equal for _, equal, _, _ in rows) else 1


if __name__ == "__main__":
    if "RANK" not in os.environ:
        # The local processes unpickle `_worker` by module name: make this file importable.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        sys.exit(importlib.import_module("jax_vs_torch").main())
    sys.exit(main())
