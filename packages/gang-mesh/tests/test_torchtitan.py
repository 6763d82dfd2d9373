"""torchtitan's own ``ParallelDims`` meshes convert without ``names=`` and round-trip.

torchtitan is not in bare ``nox``'s environment (its install pulls in ``datasets``, ``wandb``,
``tensorboard`` and more), where this file is skipped; ``test_mesh.py`` builds the same meshes
with torch's own calls. ``nox -s titan`` installs torchtitan 0.3.0 (pinned in
``constraints.txt``) and runs this file with ``GANG_REQUIRE_TORCHTITAN=1``, which turns a missing
torchtitan into a failure instead of a skip. Every mesh of its three ``spmd_backend`` choices is
checked, with experts within and across the tensor parallel ranks, all in one shared world of
eight processes: converting a mesh a second time must create no process group. Its sparse mesh
(experts across the tensor parallel ranks) has the ``ep`` and ``edp`` gangs of
``create_parallel_gangs(..., etp_size=1)``.
"""

from __future__ import annotations

import importlib
import os

import mesh_workers as w
import pytest
from test_mesh import TITAN_SPANS

from gang.testing import World

if os.environ.get("GANG_REQUIRE_TORCHTITAN") == "1":
    importlib.import_module("torchtitan.distributed.parallel_dims")  # `nox -s titan`: fails, never skips
else:
    pytest.importorskip("torchtitan.distributed.parallel_dims")


# (dp_replicate, dp_shard, cp, tp, pp, ep): with ep = 8 the experts span the tp ranks too.
CONFIGS = [(1, 2, 2, 2, 1, 2), (2, 2, 2, 1, 1, 2), (1, 2, 1, 2, 2, 1), (1, 2, 1, 4, 1, 8), (2, 1, 1, 4, 1, 2)]


@pytest.mark.parametrize("backend", ["spmd_types", "full_dtensor", "partial_dtensor"])
@pytest.mark.parametrize("config", CONFIGS)
def test_parallel_dims_meshes(world8: World, config: tuple[int, ...], backend: str) -> None:
    for rank, report in enumerate(world8.run(w.torchtitan_layouts, config, TITAN_SPANS, backend)):
        for name, result in report.items():
            if name == "etp_1":  # create_parallel_gangs(..., etp_size=1) has the sparse mesh's ep and edp
                assert result == {"ep": True, "edp": True, "etp": 1}, rank
                continue
            if isinstance(result, str):  # the unused sparse mesh without expert parallel
                assert "'efsdp'" in result and "`fake` backend" in result, (rank, name)
                continue
            if name.startswith("1-D"):
                assert result, (rank, name)
                continue
            assert result["got"] == result["expected"], (rank, name)
            assert result["sums_ok"], (rank, name)
            assert result["new_groups"] == [], (rank, name)  # converting a mesh again creates no group
            folded = ["rdp", "sdp"] if "sparse" in name and config[0] > 1 else []
            assert result["round_trip"] == {"same_mesh": True, "differ": folded, "names": True}, (rank, name)
