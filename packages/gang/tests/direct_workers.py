"""Functions that run on the worker processes of ``test_process_group_direct.py`` (imported there by name)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gang import Gang, ReduceOperation


def complex_values(rank: int, n: int) -> torch.Tensor:
    """``n`` complex64 values of ``rank``: ``k + rank - 2(k + rank)i``."""
    real = torch.arange(n, dtype=torch.float32) + rank
    return torch.complex(real, -2 * real)


def complex_collectives(g: Gang) -> dict[str, torch.Tensor]:
    """Every collective on complex64 tensors (two elements per row); the outputs by name."""
    n, rank = g.size, g.rank
    out: dict[str, torch.Tensor] = {}
    for op in (ReduceOperation.SUM, ReduceOperation.MEAN):
        t = complex_values(rank, 2)
        g.all_reduce(t, op)
        out[f"all_reduce {op.name}"] = t
    gathered = torch.empty(n, 2, dtype=torch.complex64)
    g.all_gather(gathered, complex_values(rank, 2))
    out["all_gather"] = gathered
    rows = [torch.empty(2, dtype=torch.complex64) for _ in range(n)]
    g.all_gather_to_list(rows, complex_values(rank, 2))
    out["all_gather_to_list"] = torch.stack(rows)
    scattered = torch.empty(2, dtype=torch.complex64)
    g.reduce_scatter(scattered, complex_values(rank, 2 * n).view(n, 2), ReduceOperation.SUM)
    out["reduce_scatter"] = scattered
    exchanged = torch.empty(n, 2, dtype=torch.complex64)
    g.all_to_all(exchanged, complex_values(rank, 2 * n).view(n, 2))
    out["all_to_all"] = exchanged
    t = complex_values(rank, 2)
    g.broadcast(t, source_rank=n - 1)
    out["broadcast"] = t
    return out


class Recorder(TorchFunctionMode):
    """A torch function mode that records the name of every function it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def seen_by_a_mode(g: Gang) -> tuple[list[str], float]:
    """All-reduce under a torch function mode; return the names it saw and the result."""
    t = torch.ones(1)
    with Recorder() as mode:
        g.all_reduce(t, ReduceOperation.SUM)
    return mode.seen, float(t.item())
