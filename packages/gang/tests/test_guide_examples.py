"""The examples of the fairseq2 "What is a Gang?" guide, ported to our imports, on real processes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from core_workers import (
    guide_fsdp_and_hsdp,
    guide_gang_vs_device_mesh,
    guide_gang_vs_process_group,
    guide_some_distributed_function,
    guide_tensor_parallel_setup,
)

from gang import FakeGang, Gangs, create_fake_gangs, get_default_device, get_world_size, maybe_get_current_gangs
from gang.testing import World


def test_tensor_parallel_setup(worlds: Callable[[int], World]) -> None:
    results = worlds(8).run(guide_tensor_parallel_setup)
    for rank, got in enumerate(results):
        assert got == {"root": (8, rank), "tp": (rank, 8), "sum": 8.0}


def test_gang_vs_process_group(worlds: Callable[[int], World]) -> None:
    for raw, via_gang in worlds(4).run(guide_gang_vs_process_group):
        assert raw == via_gang == 10.0


def test_gang_vs_device_mesh(worlds: Callable[[int], World]) -> None:
    results = worlds(8).run(guide_gang_vs_device_mesh)
    for rank, got in enumerate(results):
        assert got["dp"] == 2.0 and got["tp"] == 4.0
        assert got["tp_members"] == [4 * (rank // 4) + i for i in range(4)]
        assert got["dp_members"] == [rank % 4, rank % 4 + 4]


def test_fsdp_and_hsdp(worlds: Callable[[int], World]) -> None:
    results = worlds(8).run(guide_fsdp_and_hsdp)
    for rank, got in enumerate(results):
        assert got["fsdp_sdp_is_dp"] and got["fsdp_rdp_size"] == 1 and got["fsdp_rdp_fake"] == "FakeGang"
        # The guide's comment: intra-node [d0..d3], [d4..d7]; inter-node [d0, d4], [d1, d5], ...
        assert got["hsdp_sdp"] == list(range(4 * (rank // 4), 4 * (rank // 4) + 4))
        assert got["hsdp_rdp"] == [rank % 4, rank % 4 + 4]


def test_simulated_environment(worlds: Callable[[int], World]) -> None:
    # "Running in a simulated environment": one process, a FakeGang, the same function.
    device = get_default_device()
    world_size = get_world_size()
    assert world_size == 1
    gang = FakeGang(device)
    assert guide_some_distributed_function(gang) == 1.0
    assert guide_some_distributed_function(FakeGang(torch.device("cpu"), rank=3, size=8)) == 8.0
    assert worlds(2).run(guide_some_distributed_function) == [2.0, 2.0]


def test_current_gangs_in_nested_functions() -> None:
    # "Set and retrieve current thread-local gangs"
    gangs: Gangs = create_fake_gangs(torch.device("cpu"))
    with gangs:
        current_gangs = maybe_get_current_gangs()
        assert current_gangs is gangs
    current_gangs = maybe_get_current_gangs()
    assert current_gangs is None


def test_create_sub_gang_example() -> None:
    # "Creating a sub-gang with specific processes": ranks 0, 2, 4 of an 8-process gang.
    for rank in range(8):
        sub_gang = FakeGang(torch.device("cpu"), rank=rank, size=8).create_gang([0, 2, 4])
        if rank in (0, 2, 4):
            assert sub_gang is not None and (sub_gang.rank, sub_gang.size) == ([0, 2, 4].index(rank), 3)
        else:
            assert sub_gang is None
