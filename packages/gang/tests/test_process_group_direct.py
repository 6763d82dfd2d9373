"""ProcessGroupGang's two paths: the group's own methods for plain tensors, torch's functions for the rest.

The conformance tests (``test_collectives.py``) cover the direct path on five real dtypes; these
cover what still goes through ``torch.distributed``'s functions (complex tensors, torch function
modes) on real gloo processes, and the rule that picks the path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from direct_workers import Recorder, complex_collectives, complex_values, seen_by_a_mode

from gang._torch_ops import direct as _direct
from gang.testing import World


def test_complex_tensors_take_torch_functions_and_are_right(worlds: Callable[[int], World]) -> None:
    n = 2
    results = worlds(n).run(complex_collectives)
    for rank, got in enumerate(results):
        total = torch.stack([complex_values(r, 2) for r in range(n)]).sum(0)
        want = {
            "all_reduce SUM": total,
            "all_reduce MEAN": total / n,
            "all_gather": torch.stack([complex_values(r, 2) for r in range(n)]),
            "all_gather_to_list": torch.stack([complex_values(r, 2) for r in range(n)]),
            "reduce_scatter": torch.stack([complex_values(r, 2 * n).view(n, 2)[rank] for r in range(n)]).sum(0),
            "all_to_all": torch.stack([complex_values(r, 2 * n).view(n, 2)[rank] for r in range(n)]),
            "broadcast": complex_values(n - 1, 2),
        }
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert got[name].dtype == torch.complex64, (rank, name)
            assert torch.equal(got[name], value), f"rank {rank} {name}: {got[name]} != {value}"


def test_torch_function_modes_still_see_the_collective(worlds: Callable[[int], World]) -> None:
    for seen, value in worlds(2).run(seen_by_a_mode):
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
    with Recorder():
        assert not _direct(torch.zeros(2))
