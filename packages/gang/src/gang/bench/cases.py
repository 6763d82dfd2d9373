"""What every measurement of :mod:`gang.bench` is made of: a :class:`Case` (a timed call and how to
check its result) and the :func:`reference` pattern of each collective's input and expected result.

:mod:`gang.bench.collectives` and :mod:`gang.bench.traffic` both build on this module, and
:mod:`gang.bench.collectives` times the cases of :mod:`gang.bench.traffic` too, so these building
blocks live here, below both (no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gang.bench.metrics import OPS

Call = Callable[[], object]
"""A timed call: no arguments, its result ignored."""

OVERLAP_BUCKETS = 8
"""The gradient buckets of the ``overlap`` measurement (:mod:`gang.bench.traffic`)."""


def _pattern(seed: Tensor | int, k: Tensor) -> Tensor:
    """A value below 127 for every ``seed`` and element index ``k``."""
    return (seed + k) % 127


def reference(op: str, rank: int, size: int, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Return ``(input, expected)`` of ``op`` on ``rank`` of a gang of ``size`` for a full buffer of ``numel`` elements.

    Both are CPU tensors in the gang's layout: ``input`` is what the rank sends (``[numel]`` for
    ``all_reduce`` and ``broadcast``, ``[chunk]`` for ``all_gather``, ``[size, chunk]`` for
    ``reduce_scatter`` and ``all_to_all``, where ``chunk = numel // size``) and ``expected`` what
    its result must be after a ``SUM`` reduction, or a broadcast from rank 0. Reduced inputs are
    zeros and ones (so sums stay exact), and rank 0's rows of a ``reduce_scatter`` a pattern below
    61 that differs from row to row; moved data is ``(7 * source + 3 * target + index) % 127``, so
    a row from the wrong rank differs.
    """
    chunk = numel if op in ("all_reduce", "broadcast") else numel // size
    k = torch.arange(chunk, dtype=torch.int64)
    rows = torch.arange(size, dtype=torch.int64).unsqueeze(1)
    if op == "all_reduce":
        inp, out = (rank + k) % 2, torch.where((k % 2) == 0, size // 2, (size + 1) // 2)
    elif op == "reduce_scatter":
        # Rank 0 sends a pattern that tells the rows apart, the others zeros and ones.
        inp = (7 * rows + k) % 61 if rank == 0 else (rank + rows + k) % 2
        odd = torch.where(((rank + k) % 2) == 0, size // 2, (size + 1) // 2 - 1)  # ones from ranks 1..size-1
        out = (7 * rank + k) % 61 + odd
    elif op == "all_gather":
        inp, out = _pattern(7 * rank, k), _pattern(7 * rows, k)
    elif op == "all_to_all":
        inp, out = _pattern(7 * rank + 3 * rows, k), _pattern(7 * rows + 3 * rank, k)
    elif op == "broadcast":
        inp, out = _pattern(7 * rank, k), _pattern(0, k)
    else:
        raise ValueError(f"`op` must be one of {OPS}, but is {op!r} instead.")
    return inp.to(dtype), out.to(dtype)


def count_wrong(result: Tensor, expected: Tensor) -> int:
    """Return how many elements of ``result`` differ from ``expected`` (a different shape: all of them)."""
    if result.shape != expected.shape:
        return expected.numel()
    return int((result.cpu() != expected).sum())


class Case:
    """One implementation's call of one collective on buffers made once, and how to check it.

    :param run: The call that is timed.
    :param reset: Refill the inputs with the pattern of :func:`reference` (before the checked call).
    :param result: This rank's result of the last call, as a CPU tensor in the layout of ``expected``.
    :param expected: What ``result`` must be.
    """

    def __init__(self, run: Call, reset: Callable[[], None], result: Callable[[], Tensor], expected: Tensor) -> None:
        self.run = run
        self.reset = reset
        self.result = result
        self.expected = expected

    def __call__(self) -> object:
        """Run the call."""
        return self.run()

    def check(self, corrupt: bool = False) -> int:
        """Refill the inputs, run once and return the number of wrong elements of this rank's result.

        :param corrupt: Add one to the first element of the result first (the test-only seam of
            :data:`gang.bench.collectives.CORRUPT_VARIABLE`).
        """
        self.reset()
        self.run()
        got = self.result()
        if corrupt and got.numel() > 0:
            got = got.clone()
            got.view(-1)[0] += 1
        return count_wrong(got, self.expected)
