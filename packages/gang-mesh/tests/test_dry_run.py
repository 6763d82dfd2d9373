"""The mesh bridge in a dry run at 131,072 ranks (torch's ``fake`` backend, in this one process)."""

from __future__ import annotations

import numpy as np
import pytest

from gang import Gangs, NotSupportedError, create_fsdp_gangs, create_parallel_gangs
from gang.roles import ROLES
from gang.testing import dry_run
from gang_mesh import fsdp_mesh, to_device_mesh

WORLD = 131_072
RANK = 70_001  # pp 4, dp 279 (rdp 4, sdp 23 with nodes of 64), cp 0, tp 1
TP, PP, CP, EP, NODE = 8, 8, 2, 16, 64
DP = WORLD // (TP * PP * CP)


def test_meshes_come_from_the_layout_at_131072_ranks() -> None:
    pp, t = RANK // (DP * CP * TP), RANK % TP
    c = RANK // TP % CP
    d = RANK // (CP * TP) % DP
    with dry_run(WORLD, rank=RANK) as root:
        gangs = create_fsdp_gangs(create_parallel_gangs(root, tp_size=TP, pp_size=PP, cp_size=CP, ep_size=EP), NODE)

        # fsdp_mesh: ("rdp", "sdp_cp"), rank = ((pp * DP + rdp * NODE + sdp) * CP + cp) * TP + tp.
        mesh = fsdp_mesh(gangs)
        assert mesh.mesh_dim_names == ("rdp", "sdp_cp")
        r, s = np.meshgrid(np.arange(DP // NODE), np.arange(NODE * CP), indexing="ij")
        expected = ((pp * DP + r * NODE + s // CP) * CP + s % CP) * TP + t
        assert np.array_equal(mesh.mesh.numpy(), expected)
        assert mesh.mesh[d // NODE, d % NODE * CP + c] == RANK
        assert mesh.get_group("rdp") is gangs.rdp.as_process_group()
        assert mesh.get_group("sdp_cp") is gangs.flatten("sdp", "cp").as_process_group()

        # Experts: blocks of EP of one (pp, tp) position's (dp, cp) ranks, cp fastest.
        mesh = to_device_mesh(gangs, ("edp", "ep", "tp"))
        e, x, u = np.meshgrid(np.arange(DP * CP // EP), np.arange(EP), np.arange(TP), indexing="ij")
        assert np.array_equal(mesh.mesh.numpy(), (pp * DP * CP + e * EP + x) * TP + u)
        assert [mesh.get_group(i) for i in range(3)] == [
            gangs.edp.as_process_group(),
            gangs.ep.as_process_group(),
            gangs.tp.as_process_group(),
        ]

        # Expert tensor parallel: the experts' grid re-factors one stage's dp x cp x tp ranks as
        # edp x ep x etp, etp fastest; with etp 1 the ep gangs span the tp ranks too.
        stage = DP * CP * TP
        for etp in (1, 2):
            experts = create_parallel_gangs(root, tp_size=TP, pp_size=PP, cp_size=CP, ep_size=EP, etp_size=etp)
            mesh = to_device_mesh(experts, ("edp", "ep", "etp"))
            e, x, y = np.meshgrid(np.arange(stage // (EP * etp)), np.arange(EP), np.arange(etp), indexing="ij")
            assert np.array_equal(mesh.mesh.numpy(), pp * stage + (e * EP + x) * etp + y)
            assert mesh.get_group("ep") is experts.ep.as_process_group()
            assert (experts.ep.size, experts.edp.size, experts.etp.size) == (EP, stage // (EP * etp), etp)

        # A size-1 dimension (rdp when fully sharded): its group holds this process alone.
        single = create_fsdp_gangs(gangs)
        one = to_device_mesh(single, ("rdp", "sdp"))
        assert one.shape == (1, DP)
        assert one.get_group("rdp").size() == 1 and one.get_group("sdp") is single.sdp.as_process_group()

        # Gangs of unknown layout would need the peers' coordinates: refused, not guessed.
        back = Gangs(**{role: getattr(gangs, role) for role in ROLES})
        assert back.layout is None
        with pytest.raises(NotSupportedError, match="dry run"):
            to_device_mesh(back, ("dp", "tp"))
