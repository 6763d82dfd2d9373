"""Small-message cost of :class:`~gang.ProcessGroupGang`: paired per-iteration ratios to raw torch.

Run under torchrun, on the CPU (gloo)::

    torchrun --standalone --nproc-per-node 2 -m benchmarks.small_messages [--iters 2000] [--out rows.json] [--breakdown]

For every collective at 4 bytes (one float32 per rank and row) the raw ``torch.distributed``
call and the gang's public call are timed interleaved: the order rotates every iteration and
every call starts after a barrier, so both calls of one iteration see the same load on the
machine. The table shows, per collective, the median time of the slowest rank, the median main
thread CPU time on rank 0 (``time.thread_time``) and the median of the per-iteration ratios
``gang / torch`` with its quartiles. ``--out`` writes the table's rows as JSON (rows as in
``gang.bench.metrics.make_row``: impls ``torch`` and ``gang``, with ``cpu_us`` and, on the gang's
rows, ``paired_ratio``, ``q1`` and ``q3``).

``--breakdown`` times ``all_reduce`` one layer at a time instead, from the process group's own
method up to the gang's public call, each as a ratio to ``dist.all_reduce``:

* ``c10d``: ``pg.allreduce([t], opts).wait()`` with options built once;
* ``c10d+opts``: the same with the options built on every call;
* ``dist(pg)``: ``dist.all_reduce(t, SUM, group=pg)``; ``dist``: ``dist.all_reduce(t, SUM)``;
* ``gang._all_reduce`` (no argument checks) and ``gang.all_reduce`` (the public call);
* ``dist(pg)+Nus``: ``dist(pg)`` after ``N`` microseconds of busy waiting, a yardstick of how much
  a microsecond of work before the collective adds to its time;
* ``dist(pg) AVG`` and ``gang MEAN``: the mean instead of the sum.

It also prints, for each layer, the same calls run back to back without the barrier in between
(``hot``): the difference between the two shows how much more the same Python work costs right
after a barrier, when the process has just been woken up, than in a tight loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions

from gang import ProcessGroupGang, ReduceOperation
from gang.bench.collectives import TorchImpls, numel_for
from gang.bench.metrics import OPS as BENCH_OPS
from gang.bench.metrics import Row, make_row

Call = Callable[[], object]

OPS = ("all_reduce", "all_gather", "all_gather_to_list", "reduce_scatter", "all_to_all", "broadcast", "barrier")
"""The collectives of the table, each at 4 bytes per rank and row."""


def collective_cases(gang: ProcessGroupGang, op: str) -> dict[str, Call]:
    """Return the ``torch`` and ``gang`` callables of ``op`` with one float32 per rank (and per row).

    The five collectives of :mod:`gang.bench.collectives` are its own cases at 4 bytes per rank;
    ``all_gather_to_list`` and ``barrier`` are added here.
    """
    if op in BENCH_OPS:
        return dict(TorchImpls(gang).cases(op, numel_for(4, gang.size, op)))
    if op == "all_gather_to_list":
        t_raw, t_gang = torch.zeros(1, device=gang.device), torch.zeros(1, device=gang.device)
        raw = [torch.zeros(1, device=gang.device) for _ in range(gang.size)]
        ours = [torch.zeros(1, device=gang.device) for _ in range(gang.size)]
        return {
            "torch": lambda: dist.all_gather(raw, t_raw),
            "gang": lambda: gang.all_gather_to_list(ours, t_gang),
        }
    if op == "barrier":
        return {"torch": lambda: dist.barrier(), "gang": gang.barrier}
    raise ValueError(f"`op` must be one of {OPS}, but is {op!r} instead.")


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def breakdown_cases(gang: ProcessGroupGang) -> dict[str, Call]:
    """Return the layered ``all_reduce`` callables of ``--breakdown`` (see the module docstring)."""
    pg = gang.as_process_group()
    total = dist.ReduceOp.SUM
    tensors = [torch.zeros(1, device=gang.device) for _ in range(11)]

    def fresh_opts() -> AllreduceOptions:
        o = AllreduceOptions()
        o.reduceOp = dist.ReduceOp(total)
        o.asyncOp = False
        return o

    opts = fresh_opts()

    def after(seconds: float, t: torch.Tensor) -> Call:
        def call() -> None:
            _busy_wait(seconds)
            dist.all_reduce(t, total, group=pg)

        return call

    t = tensors
    return {
        "dist": lambda: dist.all_reduce(t[0], total),
        "dist(pg)": lambda: dist.all_reduce(t[1], total, group=pg),
        "c10d": lambda: pg.allreduce([t[2]], opts).wait(),
        "c10d+opts": lambda: pg.allreduce([t[3]], fresh_opts()).wait(),
        "gang._all_reduce": lambda: gang._all_reduce(t[4], ReduceOperation.SUM, False),
        "gang.all_reduce": lambda: gang.all_reduce(t[5], ReduceOperation.SUM),
        "dist(pg)+1us": after(1e-6, t[6]),
        "dist(pg)+3us": after(3e-6, t[7]),
        "dist(pg)+10us": after(10e-6, t[8]),
        "dist(pg) AVG": lambda: dist.all_reduce(t[9], dist.ReduceOp.AVG, group=pg),
        "gang MEAN": lambda: gang.all_reduce(t[10], ReduceOperation.MEAN),
    }


@dataclass
class Timings:
    """Per implementation and iteration: the slowest rank's wall time and this rank's CPU time (seconds)."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def time_paired(calls: dict[str, Call], warmup: int, iters: int, *, barrier: bool = True) -> Timings:
    """Time every callable ``iters`` times in rotating order after ``warmup`` untimed rounds.

    With ``barrier`` every call starts after a barrier (as in :mod:`gang.bench.collectives`);
    without, each callable runs ``iters`` times back to back in a tight loop (the *hot* cost).
    The wall times are reduced with MAX over the ranks after the loop.
    """
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    wall = torch.zeros(len(names), iters, dtype=torch.float64)
    cpu = torch.zeros(len(names), iters, dtype=torch.float64)
    clock, cpu_clock = time.perf_counter, time.thread_time
    dist.barrier()
    if barrier:
        for it in range(iters):
            for k in range(len(names)):
                index = (k + it) % len(names)
                call = calls[names[index]]
                dist.barrier()
                c0, w0 = cpu_clock(), clock()
                call()
                w1, c1 = clock(), cpu_clock()
                wall[index, it], cpu[index, it] = w1 - w0, c1 - c0
    else:
        for index, name in enumerate(names):
            call = calls[name]
            dist.barrier()
            for it in range(iters):
                c0, w0 = cpu_clock(), clock()
                call()
                w1, c1 = clock(), cpu_clock()
                wall[index, it], cpu[index, it] = w1 - w0, c1 - c0
    dist.all_reduce(wall, dist.ReduceOp.MAX)
    return Timings(
        wall={name: wall[i].tolist() for i, name in enumerate(names)},
        cpu={name: cpu[i].tolist() for i, name in enumerate(names)},
    )


def quantile(values: list[float], q: float) -> float:
    """Return the ``q`` quantile of ``values`` (linear interpolation between the closest ranks)."""
    data = sorted(values)
    pos = q * (len(data) - 1)
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def ratio_cells(ours: list[float], base: list[float]) -> str:
    """Return ``median [q1, q3]`` of the per-iteration ratios ``ours[i] / base[i]``."""
    ratios = [a / b for a, b in zip(ours, base, strict=True)]
    return f"{quantile(ratios, 0.5):6.3f} [{quantile(ratios, 0.25):.3f}, {quantile(ratios, 0.75):.3f}]"


def us(values: list[float]) -> str:
    """Return the median of ``values`` (seconds) in microseconds."""
    return f"{quantile(values, 0.5) * 1e6:9.1f}"


def load() -> str:
    """Return the 1, 5 and 15 minute load averages of the machine."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def paired_parser(doc: str, ops: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options every paired small-message benchmark takes: ``--iters``, ``--warmup`` and ``--ops``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000, help="timed iterations per operation")
    parser.add_argument("--warmup", type=int, default=50, help="untimed iterations first")
    parser.add_argument("--ops", nargs="*", default=list(ops), choices=ops)
    return parser


def cpu_gang() -> tuple[ProcessGroupGang, Callable[[str], None]]:
    """This torchrun rank's gloo gang (torch on one thread) and a ``say`` that prints on rank 0."""
    torch.set_num_threads(1)
    gang = ProcessGroupGang.create_default_process_group(torch.device("cpu"))

    def say(text: str) -> None:
        if gang.rank == 0:
            print(text, flush=True)

    return gang, say


def main(argv: list[str] | None = None) -> None:
    """Run the small-message table (or ``--breakdown``) on this torchrun rank; rank 0 prints."""
    parser = paired_parser(__doc__ or "", OPS)
    parser.add_argument("--breakdown", action="store_true", help="time all_reduce one layer at a time")
    parser.add_argument("--out", type=Path, default=None, help="write the table's rows here as JSON")
    args = parser.parse_args(argv)
    gang, say = cpu_gang()

    say(f"# 4-byte collectives on {gang.size} gloo ranks, {args.iters} iterations; {load()}")
    if args.breakdown:
        cases = breakdown_cases(gang)
        cold = time_paired(cases, args.warmup, args.iters)
        hot = time_paired(cases, args.warmup, args.iters, barrier=False)
        say(
            f"{'all_reduce layer':>18} | {'after a barrier: us':>19} {'cpu us':>7} {'ratio to dist [q1, q3]':>24}"
            f" | {'hot: us':>9} {'cpu us':>7} {'ratio to dist':>13}"
        )
        for name in cases:
            say(
                f"{name:>18} | {us(cold.wall[name]):>19} {us(cold.cpu[name]):>7} "
                f"{ratio_cells(cold.wall[name], cold.wall['dist']):>24} | {us(hot.wall[name])} "
                f"{us(hot.cpu[name]):>7} {quantile(hot.wall[name], 0.5) / quantile(hot.wall['dist'], 0.5):13.3f}"
            )
    else:
        say(
            f"{'collective':>18} | {'torch us':>9} {'gang us':>9} | {'cpu torch':>9} {'cpu gang':>9} | "
            f"{'gang/torch [q1, q3]':>22}"
        )
        rows: list[Row] = []
        for op in args.ops:
            timings = time_paired(collective_cases(gang, op), args.warmup, args.iters)
            wall, cpu = timings.wall, timings.cpu
            say(
                f"{op:>18} | {us(wall['torch'])} {us(wall['gang'])} | {us(cpu['torch'])} {us(cpu['gang'])} | "
                f"{ratio_cells(wall['gang'], wall['torch']):>22}"
            )
            ratios = [a / b for a, b in zip(wall["gang"], wall["torch"], strict=True)]
            paired = {"paired_ratio": quantile(ratios, 0.5), "q1": quantile(ratios, 0.25), "q3": quantile(ratios, 0.75)}
            for impl, extra in (("torch", {}), ("gang", paired)):
                median_s, cpu_us = quantile(wall[impl], 0.5), quantile(cpu[impl], 0.5) * 1e6
                rows.append(make_row(impl, op, 4, gang.size, median_s, bandwidth=False, cpu_us=cpu_us, **extra))
        if args.out is not None and gang.rank == 0:
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
    say(f"# done; {load()}")
    gang.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
