"""Sub-gangs and factory layouts on real gloo processes, membership proven by gathering global ranks."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
from core_workers import numpy_ranks_and_cpu0, parallel_layout, split_group_stand_in, sub_gang_members

from gang import FakeGang, GangError, create_fsdp_gangs, create_parallel_gangs
from gang.testing import World
from gang.topology import Grid, parallel_grid, role_spans, sharded_grid


def test_create_gang_members_and_nested_sub_gangs(worlds: Callable[[int], World]) -> None:
    # Sub-gang [1, 2, 3] of 4 ranks, then ranks [0, 2] of *that* gang: global ranks 1 and 3.
    results = worlds(4).run(sub_gang_members, [3, 1, 2], [0, 2])
    assert results[0] == {"sub": None, "rank": None}
    for global_rank in (1, 2, 3):
        got = results[global_rank]
        assert got["sub"] == [1, 2, 3]
        assert got["rank"] == global_rank - 1
        # The sub-gang inherits the root's timeout, and the backend really uses it.
        assert got["sub_timeout"] == timedelta(seconds=60)
        assert got["sub_backend_timeout"] == timedelta(seconds=60)
    assert results[1]["nested"] == [1, 3] and results[1]["nested_rank"] == 0
    assert results[3]["nested"] == [1, 3] and results[3]["nested_rank"] == 1
    assert results[2]["nested"] is None
    assert results[1]["timeout"] == timedelta(seconds=60)


def _expected_layout(world: int, tp: int, pp: int, intra: int | None, fsdp: bool) -> list[dict[str, list[int]]]:
    # The factories split twice (parallel_grid, then sharded_grid inside dp); the oracle lays out
    # one grid, (pp, rdp, sdp, tp) or (pp, dp, tp), and takes each role's gang from `role_spans`.
    dp = world // (tp * pp)
    if fsdp:
        sdp = dp if intra is None else intra
        grid = Grid((("pp", pp), ("rdp", dp // sdp), ("sdp", sdp), ("tp", tp)))
    else:
        grid = Grid((("pp", pp), ("dp", dp), ("tp", tp)))
    spans = role_spans(grid.names)
    return [{role: grid.group_of(rank, *span) for role, span in spans.items()} for rank in range(world)]


LAYOUTS = [
    (4, 1, 1, None, False),
    (4, 2, 1, None, True),
    (4, 1, 2, 1, True),
    (4, 1, 1, 2, True),
    (8, 2, 1, None, False),
    (8, 2, 2, None, False),
    (8, 2, 2, None, True),
    (8, 2, 1, 2, True),
    (8, 1, 2, 2, True),
    (8, 1, 1, 4, True),
    (8, 4, 2, 1, True),
    (8, 8, 1, None, True),
]


@pytest.mark.parametrize(("world", "tp", "pp", "intra", "fsdp"), LAYOUTS)
def test_factory_layout(
    world: int, tp: int, pp: int, intra: int | None, fsdp: bool, worlds: Callable[[int], World]
) -> None:
    results = worlds(world).run(parallel_layout, tp, pp, intra, fsdp)
    expected = _expected_layout(world, tp, pp, intra, fsdp)
    for rank, (got, want) in enumerate(zip(results, expected, strict=True)):
        for role, members in want.items():
            info = got[role]
            if len(members) == 1:
                assert info["kind"] == "FakeGang", (rank, role)  # no needless process group
                assert info["members"] == [rank]
            else:
                assert info["members"] == members, (rank, role, info["members"], members)
            assert info["size"] == len(members)
            assert info["rank"] == members.index(rank)
            assert info["is_root"] == (role == "root" or len(members) == world)


def test_spec_examples_of_the_layout() -> None:
    # The SPEC's worked examples, checked on the pure topology the factories use (dp is the grid's
    # rdp x sdp axes, with sdp of size 1).
    grid = parallel_grid(8, tp_size=2)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("rdp", "sdp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    grid = parallel_grid(8, tp_size=2, pp_size=2)
    assert grid.groups("rdp", "sdp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    hsdp = sharded_grid(8, 4)
    assert hsdp.groups("sdp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hsdp.groups("rdp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(("tp", "pp"), [(3, 1), (1, 3), (0, 1), (4, 4), (16, 1)])
def test_sizes_that_do_not_divide_are_rejected(tp: int, pp: int) -> None:
    with pytest.raises(ValueError, match="size"):
        create_parallel_gangs(FakeGang(torch.device("cpu"), size=8), tp_size=tp, pp_size=pp)


def test_fsdp_size_that_does_not_divide_is_rejected() -> None:
    gangs = create_parallel_gangs(FakeGang(torch.device("cpu"), size=8), tp_size=2)
    with pytest.raises(ValueError, match="`intra_node_size` must be a factor"):
        create_fsdp_gangs(gangs, intra_node_size=3)
    with pytest.raises(TypeError, match="`gangs` must be a `Gangs`"):
        create_fsdp_gangs(gangs.root)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", range(8))
def test_factories_on_fake_gangs_agree_with_topology(rank: int) -> None:
    gangs = create_fsdp_gangs(create_parallel_gangs(FakeGang(torch.device("cpu"), rank=rank, size=8), tp_size=2), 2)
    grid = parallel_grid(8, tp_size=2)
    assert (gangs.tp.rank, gangs.tp.size) == (grid.group_of(rank, "tp").index(rank), 2)
    assert (gangs.dp.rank, gangs.dp.size) == (grid.group_of(rank, "rdp", "sdp").index(rank), 4)
    assert (gangs.sdp.size, gangs.rdp.size) == (2, 2)
    assert gangs.sdp.rank == gangs.dp.rank % 2
    assert gangs.rdp.rank == gangs.dp.rank // 2


def test_split_plan_gives_split_group_the_parent_groups_own_ranks() -> None:
    # `dist.split_group` (the NCCL path) takes ranks of the *parent* group. A sub-gang of a
    # sub-gang: global ranks [1, 3, 5, 7], split into its ranks [[0, 1], [2, 3]].
    from gang.process_group_gang import plan_split

    plan = plan_split((1, 3, 5, 7), 2, [[0, 1], [2, 3]])
    assert plan.parent_groups == [[0, 1], [2, 3]]
    assert plan.group_index == 1
    assert plan.members == [5, 7]  # what the named-group path (gloo) creates its group from
    outsider = plan_split((2, 4, 6), 0, [[1, 2]])
    assert (outsider.parent_groups, outsider.group_index, outsider.members) == ([[1, 2]], None, [])


def test_real_gang_on_cpu0_with_numpy_ranks(worlds: Callable[[int], World]) -> None:
    for rank, got in enumerate(worlds(2).run(numpy_ranks_and_cpu0)):
        assert got == {"device": "cpu", "broadcast": [1.0, 1.0], "sub": [0, 1]}, rank


@pytest.mark.parametrize("own_group", [False, True], ids=["shared gloo backend", "split_group"])
def test_nested_create_gang_on_the_cuda_split_path(worlds: Callable[[int], World], own_group: bool) -> None:
    # The CUDA split path (torch's `split_group`) forced onto gloo (see `split_group_stand_in`). A
    # backend serving both `cpu` and `cuda` was split twice by torch on one store prefix, and members
    # waited in `split_group` for good: such a gang now makes named groups; a group whose one backend
    # serves its device is split by torch, non-members taking part.
    if own_group and torch.torch_version.TorchVersion(torch.__version__) < "2.13":
        # torch 2.11's own split_group cannot split this stand-in (it looks for a CUDA backend): the
        # gang must say so as a GangError naming the call, not hang or fail otherwise.
        with World(4) as world, pytest.raises(GangError, match=r"`create_gang` failed on rank .* device type cuda"):
            world.run(split_group_stand_in, own_group)
        return
    if own_group:  # a fresh world: `dist.new_group` names groups from each process's group history
        with World(4) as world:
            results = world.run(split_group_stand_in, own_group)
    else:
        results = worlds(4).run(split_group_stand_in, own_group)
    assert results[0] == {"a": None}
    for rank in (1, 2, 3):
        assert results[rank]["a"] == [1, 2, 3]
        assert results[rank]["a_split"] is own_group
    assert results[1]["b"] == results[2]["b"] == [1, 2]
    assert results[3]["b"] is None
    assert results[1]["b_split"] is results[2]["b_split"] is own_group
