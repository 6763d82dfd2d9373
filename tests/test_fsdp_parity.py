"""FSDP2, HSDP and FSDP2 + tensor parallel give bit-identical losses on gang meshes and init meshes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from gang.testing import World

ROOT = Path(__file__).resolve().parent.parent
# The workers import the model and the worker functions by module name; children inherit sys.path.
for folder in (ROOT / "examples", Path(__file__).resolve().parent):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import parity_workers as pw  # noqa: E402

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


def test_fsdp_tp_dp_tp(world4: World) -> None:
    check(world4.run(pw.parity, ("dp", "tp"), 2, None, STEPS), ("dp", "tp"))


def test_hsdp_tp_3d(world8: World) -> None:
    check(world8.run(pw.parity, ("rdp", "sdp", "tp"), 2, 2, STEPS), ("rdp", "sdp", "tp"))
