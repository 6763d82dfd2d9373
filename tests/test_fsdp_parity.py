"""FSDP2, HSDP and FSDP2 + tensor parallel give bit-identical losses on gang meshes and init meshes."""

from __future__ import annotations

import math

import parity_workers as pw

from gang.testing import World

STEPS = 5


def check(results: list[dict[str, object]], names: tuple[str, ...]) -> None:
    for rank, result in enumerate(results):
        assert result["names"] == names
        ours, reference = result["ours"], result["reference"]
        assert isinstance(ours, list)
        assert len(ours) == STEPS
        assert all(math.isfinite(loss) for loss in ours)
        assert ours == reference, f"rank {rank}: {ours} != {reference}"
        assert ours[-1] < ours[0], f"rank {rank} did not learn: {ours}"


def test_fsdp_1d(world4: World) -> None:
    check(world4.run(pw.parity, None, 1, None, STEPS), ("sdp",))


def test_hsdp_2d(world4: World) -> None:
    check(world4.run(pw.parity, None, 1, 2, STEPS), ("rdp", "sdp"))


def test_hsdp_configured_down_to_fsdp(world4: World) -> None:
    # rdp of size 1 is a size-1 dimension: the same losses as init_device_mesh((1, 4)).
    check(world4.run(pw.parity, ("rdp", "sdp"), 1, None, STEPS), ("rdp", "sdp"))


def test_fsdp_and_hsdp_with_context_parallel(world4: World) -> None:
    # cp=2: fsdp_mesh shards over sdp x cp, as torchtitan's dp_shard_cp; fully sharded, then HSDP
    # (rdp=2 x sdp_cp=2).
    check(world4.run(pw.parity, None, 1, None, STEPS, 2), ("sdp_cp",))
    check(world4.run(pw.parity, None, 1, 1, STEPS, 2), ("rdp", "sdp_cp"))


def test_fsdp_tp_dp_tp(world4: World) -> None:
    check(world4.run(pw.parity, ("dp", "tp"), 2, None, STEPS), ("dp", "tp"))


def test_hsdp_tp_3d(world8: World) -> None:
    check(world8.run(pw.parity, ("rdp", "sdp", "tp"), 2, 2, STEPS), ("rdp", "sdp", "tp"))
