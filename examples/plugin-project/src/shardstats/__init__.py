"""Statistics of data sharded over the ranks of a gang.

Each rank holds a part of the data; every function returns the statistic of the whole data set on
every rank. The same code runs on a :class:`gang.FakeGang` (one process) and on real gangs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from gang import Gang, ReduceOperation

__all__ = ["global_mean", "global_min_max", "histogram", "shard"]

T = TypeVar("T")


def shard(gang: Gang, items: Sequence[T]) -> list[T]:
    """Return this rank's contiguous part of ``items`` (the first ranks get one more when it does not divide)."""
    base, extra = divmod(len(items), gang.size)
    start = gang.rank * base + min(gang.rank, extra)
    return list(items[start : start + base + (gang.rank < extra)])


def global_mean(gang: Gang, values: torch.Tensor) -> float:
    """Return the mean of the values of every rank (ranks may hold different numbers of values).

    :raises ValueError: If no rank holds a value.
    """
    totals = torch.tensor([float(values.sum()), float(values.numel())], dtype=torch.float64)
    gang.all_reduce(totals, ReduceOperation.SUM)
    if totals[1] == 0:
        raise ValueError("`values` must hold at least one value on some rank, but is empty on every rank.")
    return float(totals[0] / totals[1])


def global_min_max(gang: Gang, values: torch.Tensor) -> tuple[float, float]:
    """Return the smallest and largest value over every rank (each rank must hold at least one value)."""
    lo = values.min().reshape(1).to(torch.float64)
    hi = values.max().reshape(1).to(torch.float64)
    gang.all_reduce(lo, ReduceOperation.MIN)
    gang.all_reduce(hi, ReduceOperation.MAX)
    return float(lo), float(hi)


def histogram(gang: Gang, values: torch.Tensor, bins: int, low: float, high: float) -> torch.Tensor:
    """Return the ``bins``-bin histogram over ``[low, high]`` of the values of every rank (int64 counts)."""
    counts = torch.histc(values.to(torch.float64), bins=bins, min=low, max=high).to(torch.int64)
    gang.all_reduce(counts, ReduceOperation.SUM)
    return counts
