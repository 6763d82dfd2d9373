"""The factories on a JaxGang root: cp, ep and flattened gangs over jax.distributed (4 real processes)."""

from __future__ import annotations

from typing import Any

import jax_workers as jw
from roles_workers import check_reports

from gang.testing import World

CONFIGS: list[dict[str, Any]] = [
    dict(tp=1, pp=1, cp=2, ep=2),  # ep is the cp gang, edp the dp gang
    dict(tp=1, pp=1, cp=1, ep=2, intra=2),  # ep gangs of their own; hybrid sharding
]


def test_factories_on_a_jax_gang_root() -> None:
    with World(4, init_gang=False) as world:
        reports = world.run(jw.factory_layouts, CONFIGS)
    check_reports(reports, CONFIGS)
    ep = {tuple(reports[r][1]["ep"]["members"]) for r in range(4)}
    assert ep == {(0, 1), (2, 3)} and reports[0][1]["ep"]["kind"] == "JaxGang"
