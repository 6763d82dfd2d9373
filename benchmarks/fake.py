"""FakeGang collectives against the plain tensor operation each one simulates (one process)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from gang import FakeGang, ReduceOperation
from gang.bench.metrics import Row, make_row, median

SIZE = 4
"""The simulated gang size."""


def _cases(numel: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Return (FakeGang call, plain op) per collective on a full buffer of ``numel`` floats."""
    gang = FakeGang(torch.device("cpu"), rank=1, size=SIZE)
    chunk = max(1, numel // SIZE)
    t1, t2 = torch.zeros(numel), torch.zeros(numel)
    inp1, inp2 = torch.zeros(chunk), torch.zeros(chunk)
    rows1, rows2 = torch.zeros(SIZE, chunk), torch.zeros(SIZE, chunk)
    out1, out2 = torch.zeros(SIZE, chunk), torch.zeros(SIZE, chunk)
    red1, red2 = torch.zeros(chunk), torch.zeros(chunk)
    return {
        "all_reduce": (lambda: gang.all_reduce(t1, ReduceOperation.SUM), lambda: t2.mul_(SIZE)),
        "all_gather": (lambda: gang.all_gather(out1, inp1), lambda: out2.copy_(inp2.expand(SIZE, chunk))),
        "reduce_scatter": (
            lambda: gang.reduce_scatter(red1, rows1, ReduceOperation.SUM),
            lambda: red2.copy_(rows2[1]).mul_(SIZE),
        ),
        "all_to_all": (lambda: gang.all_to_all(out1, rows1), lambda: out2.copy_(rows2[1].expand(SIZE, chunk))),
        "broadcast": (lambda: gang.broadcast(t1, 0), lambda: None),
    }


def run(max_bytes: int, quick: bool, progress: Callable[[str], None] = print) -> list[Row]:
    """Time every FakeGang collective and its plain equivalent, interleaved, at sizes from 4 B to ``max_bytes``.

    Rows have ``impl`` ``fake`` or ``plain`` and ``world_size`` 1; ``bytes`` is the full buffer.
    """
    rows: list[Row] = []
    iters = 200 if quick else 1000
    nbytes = 4
    while nbytes <= max_bytes:
        numel = max(1, nbytes // 4)
        reps = max(5, min(iters, (iters * 4096) // max(nbytes, 4096)))
        for op, (fake, plain) in _cases(numel).items():
            times: dict[str, list[float]] = {"fake": [], "plain": []}
            for _ in range(3):
                fake()
                plain()
            for _ in range(reps):
                for name, fn in (("fake", fake), ("plain", plain)):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            pair = [
                make_row(name, op, numel * 4, 1, median(ts), bandwidth=False, iters=reps) for name, ts in times.items()
            ]
            rows.extend(pair)
            progress(
                f"{'fake ' + op:>20} {numel * 4:>10} B  fake {pair[0]['time_us']:8.2f} us  "
                f"plain {pair[1]['time_us']:8.2f} us  ratio {pair[0]['time_us'] / pair[1]['time_us']:6.2f}"
            )
        nbytes *= 16
    return rows
