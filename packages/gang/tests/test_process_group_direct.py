"""ProcessGroupGang's two paths: the group's own methods for plain tensors, torch's functions for the rest.

The conformance tests (``test_collectives.py``) cover the direct path on five real dtypes; these
cover what still goes through ``torch.distributed``'s functions (complex tensors, torch function
modes) on real gloo processes, and the rule that picks the path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from gang_core_worlds import get_world
from torch.overrides import TorchFunctionMode

from gang import Gang, ReduceOperation
from gang.process_group import _direct


def _complex(rank: int, n: int) -> torch.Tensor:
    real = torch.arange(n, dtype=torch.float32) + rank
    return torch.complex(real, -2 * real)


def complex_collectives(g: Gang) -> dict[str, torch.Tensor]:
    """Every collective on complex64 tensors (two elements per row); the outputs by name."""
    n, rank = g.size, g.rank
    out: dict[str, torch.Tensor] = {}
    for op in (ReduceOperation.SUM, ReduceOperation.MEAN):
        t = _complex(rank, 2)
        g.all_reduce(t, op)
        out[f"all_reduce {op.name}"] = t
    gathered = torch.empty(n, 2, dtype=torch.complex64)
    g.all_gather(gathered, _complex(rank, 2))
    out["all_gather"] = gathered
    rows = [torch.empty(2, dtype=torch.complex64) for _ in range(n)]
    g.all_gather_to_list(rows, _complex(rank, 2))
    out["all_gather_to_list"] = torch.stack(rows)
    scattered = torch.empty(2, dtype=torch.complex64)
    g.reduce_scatter(scattered, _complex(rank, 2 * n).view(n, 2), ReduceOperation.SUM)
    out["reduce_scatter"] = scattered
    exchanged = torch.empty(n, 2, dtype=torch.complex64)
    g.all_to_all(exchanged, _complex(rank, 2 * n).view(n, 2))
    out["all_to_all"] = exchanged
    t = _complex(rank, 2)
    g.broadcast(t, source_rank=n - 1)
    out["broadcast"] = t
    return out


def test_complex_tensors_take_torch_functions_and_are_right() -> None:
    n = 2
    results = get_world(n).run(complex_collectives)
    for rank, got in enumerate(results):
        total = torch.stack([_complex(r, 2) for r in range(n)]).sum(0)
        want = {
            "all_reduce SUM": total,
            "all_reduce MEAN": total / n,
            "all_gather": torch.stack([_complex(r, 2) for r in range(n)]),
            "all_gather_to_list": torch.stack([_complex(r, 2) for r in range(n)]),
            "reduce_scatter": torch.stack([_complex(r, 2 * n).view(n, 2)[rank] for r in range(n)]).sum(0),
            "all_to_all": torch.stack([_complex(r, 2 * n).view(n, 2)[rank] for r in range(n)]),
            "broadcast": _complex(n - 1, 2),
        }
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert got[name].dtype == torch.complex64, (rank, name)
            assert torch.equal(got[name], value), f"rank {rank} {name}: {got[name]} != {value}"


class _Recorder(TorchFunctionMode):
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
    with _Recorder() as mode:
        g.all_reduce(t, ReduceOperation.SUM)
    return mode.seen, float(t.item())


def test_torch_function_modes_still_see_the_collective() -> None:
    for seen, value in get_world(2).run(seen_by_a_mode):
        assert dist.all_reduce.__name__ in seen
        assert value == 2.0


def test_the_direct_path_is_for_plain_tensors_only() -> None:
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.bool):
        assert _direct(torch.zeros(2, dtype=dtype)), dtype
    for dtype in (torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2):
        assert not _direct(torch.zeros(2, dtype=dtype)), dtype

    class Subclass(torch.Tensor):
        pass

    assert not _direct(torch.zeros(2).as_subclass(Subclass))
    with _Recorder():
        assert not _direct(torch.zeros(2))
