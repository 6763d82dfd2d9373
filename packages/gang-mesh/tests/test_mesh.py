"""to_device_mesh, fsdp_mesh and from_device_mesh on real gloo processes."""

from __future__ import annotations

import mesh_workers as w
import pytest

from gang.testing import World

FULL_8 = list(range(8))


def check_lines(results: list[dict[str, object]]) -> None:
    """On every rank, each mesh line through the rank is the gang, and the groups are the gangs' own."""
    for rank, result in enumerate(results):
        assert result["lines"] == result["members"], rank
        same_group = result["same_group"]
        assert isinstance(same_group, list)
        assert all(same_group), rank
        assert result["local_ranks"] == result["gang_ranks"], rank
        assert result["type"] == "cpu"


# -- to_device_mesh / fsdp_mesh -------------------------------------------------------------------


def test_fsdp_mesh_is_1d_sdp_without_replication(world4: World) -> None:
    results = world4.run(w.fsdp_mesh_of, None)
    for result in results:
        assert result == {"mesh": [0, 1, 2, 3], "names": ("sdp",), "type": "cpu", "same_group": [True]}


def test_fsdp_mesh_is_2d_for_hsdp(world4: World) -> None:
    results = world4.run(w.fsdp_mesh_of, 2)
    for result in results:
        assert result == {
            "mesh": [[0, 1], [2, 3]],
            "names": ("rdp", "sdp"),
            "type": "cpu",
            "same_group": [True, True],
        }


def test_fsdp_mesh_needs_a_sharding_gang(world4: World) -> None:
    # intra_node_size=1: sdp has size 1 (no process group), rdp = dp.
    for kind, message in world4.run(w.fsdp_mesh_error, 1):
        assert kind == "ValueError"
        assert "`gangs.sdp` must have a process group" in message


def test_1d_root_mesh(world4: World) -> None:
    results = world4.run(w.mesh_of, ("root",))
    check_lines(results)
    assert all(r["mesh"] == [0, 1, 2, 3] and r["names"] == ("root",) for r in results)


def test_2d_dp_tp(world8: World) -> None:
    results = world8.run(w.mesh_of, ("dp", "tp"), 2)
    check_lines(results)
    for result in results:
        assert result["mesh"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert result["names"] == ("dp", "tp")


def test_2d_tp_dp_transposed(world8: World) -> None:
    results = world8.run(w.mesh_of, ("tp", "dp"), 2)
    check_lines(results)
    for result in results:
        assert result["mesh"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_3d_rdp_sdp_tp(world8: World) -> None:
    results = world8.run(w.mesh_of, ("rdp", "sdp", "tp"), 2, 1, 2)
    check_lines(results)
    for result in results:
        assert result["mesh"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    # Rank 5: tp [4,5], dp [1,3,5,7] split into sdp [5,7] and rdp [1,5].
    assert results[5]["members"] == [(1, 5), (5, 7), (4, 5)]


def test_3d_pp_dp_tp(world8: World) -> None:
    results = world8.run(w.mesh_of, ("pp", "dp", "tp"), 2, 2)
    check_lines(results)
    for result in results:
        assert result["mesh"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_pipeline_stages_get_their_own_mesh(world8: World) -> None:
    results = world8.run(w.mesh_of, ("dp", "tp"), 2, 2)
    check_lines(results)
    for rank, result in enumerate(results):
        expected = [[0, 1], [2, 3]] if rank < 4 else [[4, 5], [6, 7]]
        assert result["mesh"] == expected, rank


def test_1d_pp_mesh(world8: World) -> None:
    results = world8.run(w.mesh_of, ("pp",), 2, 2)
    check_lines(results)
    for rank, result in enumerate(results):
        assert result["mesh"] == [rank % 4, rank % 4 + 4]


# -- to_device_mesh errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dims", "kind", "fragments"),
    [
        ((("dp", "sdp"),), "ValueError", ["`dims[0]`", "overlap"]),
        ((("dp", "ep"),), "ValueError", ["`dims[0]`", "`ep` alone"]),
        (("ep", "dp"), "ValueError", ["grid", "'ep'", "'dp'"]),
        (("bogus",), "ValueError", ["`dims`", "'bogus'"]),
        ((("tp", 2),), "TypeError", ["`dims`", "('tp', 2)"]),
        (("dp", "tp", "dp"), "ValueError", ["`dims`", "repeat", "['dp']"]),
        ((), "ValueError", ["`dims`", "empty"]),
        ("sdp", "TypeError", ["`dims`", "'sdp'"]),
        (("sdp", 1), "TypeError", ["`dims`", "1"]),
        (("root", "sdp"), "ValueError", ["grid", "('root', 'sdp')"]),
    ],
)
def test_to_device_mesh_errors(world4: World, dims: object, kind: str, fragments: list[str]) -> None:
    for result in world4.run(w.to_mesh_error, dims):
        assert result[0] == kind
        for fragment in fragments:
            assert fragment in result[1]


def test_size_one_dimensions(world4: World) -> None:
    # HSDP configured down to FSDP: rdp has size 1 and is a size-1 dimension, as in
    # init_device_mesh((1, 4)); its group holds the process alone on the `fake` backend.
    for rank, report in enumerate(world4.run(w.size_one_dims)):
        assert report["hsdp"] == {"mesh": [[0, 1, 2, 3]], "names": ("rdp", "sdp"), "type": "cpu"}
        assert report["hsdp_groups"] == [True, True]
        assert report["hsdp_local"] == [0, rank]
        assert report["wide"]["mesh"] == [[[[0, 1, 2, 3]]]]
        assert report["wide"]["names"] == ("pp", "rdp", "cp_tp", "sdp")
        assert report["wide_alone"] == [True, True, True]
        assert report["one_group"]
        assert report["dtensor_local"] and report["dtensor_full"]
        everyone = (0, 1, 2, 3)
        expected = {"root": everyone, "dp": everyone, "rdp": 1, "sdp": everyone, "cp": 1, "tp": 1, "pp": 1}
        expected |= {"ep": 1, "edp": everyone, "etp": 1}
        assert report["back"] == expected
        assert report["again"] == report["hsdp"]
        assert report["again_alone"]
        assert report["titan"] == expected
        assert report["titan_again"]["mesh"] == [[[0], [1], [2], [3]]]
        assert report["titan_again"]["names"] == ("rdp", "sdp", "tp")
        assert report["sums"] == {role: 6.0 if value == everyone else float(rank) for role, value in expected.items()}


def test_non_grid_dp_rdp_is_rejected_on_every_rank(world4: World) -> None:
    results = world4.run(w.to_mesh_error, ("dp", "rdp"), 1, 1, 2)
    assert len({r for r in results}) == 1  # The same verdict everywhere.
    kind, message = results[0]
    assert kind == "ValueError"
    assert "`dims` must name gangs that form a grid" in message
    assert "('dp', 'rdp')" in message


def test_overlapping_gangs_are_rejected(world8: World) -> None:
    # sdp [0,2] and dp [0,2,4,6] overlap: not a grid.
    kind, message = world8.run(w.to_mesh_error, ("sdp", "dp"), 2, 1, 2)[0]
    assert kind == "ValueError"
    assert "grid" in message


def test_gangs_must_be_gangs(world4: World) -> None:
    kind, message = world4.run(w.to_mesh_bad_gangs)[0]
    assert kind == "TypeError"
    assert "`gangs` must be a `Gangs`" in message


def test_arguments_are_checked_before_communicating(world4: World) -> None:
    # Only rank 0 calls with bad dims; had it communicated, its collective would pair with the
    # others' all-reduce and the sum would be wrong (or the ranks would stall).
    results = world4.run(w.to_mesh_error_alone, ("bogus",))
    assert results[0] == ("ValueError", 10.0)
    assert results[1:] == [("no error", 10.0)] * 3


# -- from_device_mesh ------------------------------------------------------------------------------


def test_from_torchtitan_names(world8: World) -> None:
    results = world8.run(w.from_init_mesh, (2, 2, 2), ("dp_replicate", "dp_shard", "tp"), None)
    for rank, report in enumerate(results):
        tp = ((rank // 2) * 2, (rank // 2) * 2 + 1)
        dp = tuple(r for r in FULL_8 if r % 2 == rank % 2)
        assert report["root"] == tuple(FULL_8)
        assert report["tp"] == tp
        assert report["dp"] == dp
        assert report["rdp"] == tuple(r for r in dp if (r // 2) % 2 == (rank // 2) % 2)
        assert report["sdp"] == tuple(r for r in dp if r // 4 == rank // 4)
        assert report["pp"] == 1
        assert report["same_group"] == [True, True, True]
        assert report["sums"]["dp"] == sum(dp)
        assert report["sums"]["root"] == sum(FULL_8)


def test_from_mesh_with_names_mapping(world4: World) -> None:
    names = {"replicate": "rdp", "shard": "sdp"}
    results = world4.run(w.from_init_mesh, (2, 2), ("replicate", "shard"), names)
    for rank, report in enumerate(results):
        assert report["rdp"] == (rank % 2, rank % 2 + 2)
        assert report["sdp"] == ((rank // 2) * 2, (rank // 2) * 2 + 1)
        assert report["dp"] == (0, 1, 2, 3)
        assert report["dp_is_root"]  # dp spans the mesh: no new group.
        assert report["tp"] == 1
        assert report["same_group"] == [True, True]


def test_from_1d_dp_mesh(world4: World) -> None:
    results = world4.run(w.from_init_mesh, (4,), ("dp",), None)
    for report in results:
        assert report["dp"] == report["root"] == (0, 1, 2, 3)
        assert report["rdp_is_dp"]
        assert report["sdp"] == 1
        assert report["tp"] == report["pp"] == 1


def test_from_pp_dp_tp_mesh(world8: World) -> None:
    results = world8.run(w.from_init_mesh, (2, 2, 2), ("pp", "dp", "tp"), None)
    for rank, report in enumerate(results):
        assert report["pp"] == (rank % 4, rank % 4 + 4)
        assert report["dp"] == report["rdp"]
        assert report["sdp"] == 1


def test_from_sub_mesh_root_spans_only_the_sub_mesh(world8: World) -> None:
    results = world8.run(w.from_init_mesh, (2, 2, 2), ("pp", "dp", "tp"), None, ("dp", "tp"))
    for rank, report in enumerate(results):
        stage = tuple(range(4)) if rank < 4 else tuple(range(4, 8))
        assert report["root"] == stage
        assert report["sums"]["root"] == sum(stage)
        assert report["pp"] == 1


@pytest.mark.parametrize(
    ("shape", "dim_names", "names", "kind", "fragments"),
    [
        ((4,), None, None, "ValueError", ["`mesh`", "dimension names"]),
        ((2, 2), ("dp", "ep"), None, "ValueError", ["`mesh`", "'ep'", "'dp'"]),
        ((2, 2), ("tp", "etp"), None, "ValueError", ["`mesh`", "'tp' and 'etp' are the same dimension"]),
        ((2, 2), ("loss", "cp"), None, "ValueError", ["`mesh`", "'loss'", "`cp`"]),
        ((2, 2), ("a", "b"), None, "ValueError", ["`mesh`", "'a'", "be mapped by `names`"]),
        ((2, 2), ("a", "b"), {"a": "sdp", "b": "sdp"}, "ValueError", ["'a'", "'b'", "'sdp'"]),
        ((2, 2), ("dp", "dp_shard"), None, "ValueError", ["`dp`", "'sdp'"]),
        ((4,), ("x",), {"y": "dp"}, "ValueError", ["`names`", "'y' (to 'dp')", "('x',)"]),
        ((4,), ("x",), {"x": "root"}, "ValueError", ["`names`", "'x' to 'root'"]),
        ((4,), ("x",), {"x": 1}, "TypeError", ["`names`"]),
        ((4,), ("x",), ["x"], "TypeError", ["`names`"]),
        ((), None, None, "TypeError", ["`mesh`", "str"]),
    ],
)
def test_from_device_mesh_errors(
    world4: World, shape: tuple[int, ...], dim_names: object, names: object, kind: str, fragments: list[str]
) -> None:
    for result in world4.run(w.from_mesh_error, shape, dim_names, names):
        assert result[0] == kind
        for fragment in fragments:
            assert fragment in result[1]


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dims", "tp", "pp", "intra"),
    [
        (("sdp",), 1, 1, None),
        (("rdp", "sdp"), 1, 1, 2),
        (("dp", "tp"), 2, 1, 0),
        (("rdp", "sdp", "tp"), 2, 1, 2),
        (("pp", "dp", "tp"), 2, 2, 0),
        (("tp", "rdp", "sdp"), 2, 1, 2),
    ],
)
def test_round_trip_keeps_members(world8: World, dims: tuple[str, ...], tp: int, pp: int, intra: int | None) -> None:
    for result in world8.run(w.round_trip, dims, tp, pp, intra):
        assert result["after"] == result["before"]
        assert all(result["same_groups"])


# -- sub-meshes of init_device_mesh (torchtitan's layouts) --------------------------------------


@pytest.mark.parametrize(
    ("dim_names", "sub"),
    [
        (("pp", "sdp", "tp"), ("sdp", "tp")),  # one pipeline stage
        (("pp", "dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard")),  # HSDP within a stage
        (("dp", "cp", "tp"), ("dp", "tp")),  # the context parallel axis sliced out
        (("dp_shard", "cp", "tp"), ("dp_shard", "tp")),
        (("cp", "dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard")),
    ],
)
def test_sub_mesh_round_trip(world8: World, dim_names: tuple[str, ...], sub: tuple[str, ...]) -> None:
    for rank, result in enumerate(world8.run(w.sub_mesh_round_trip, (2, 2, 2), dim_names, sub)):
        assert result["mesh"] == result["sliced"], rank
        assert all(result["same_group"]), rank
        assert result["after"] == result["before"], rank
        stage = sorted(r for row in result["sliced"] for r in row)
        assert rank in stage
        assert result["before"]["root"] == tuple(stage)
        assert result["sums"]["root"] == sum(stage)


# -- groups on torch's fake backend ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dim_names", "fake"),
    [
        ((2, 2), ("dp", "tp"), "tp"),
        ((2, 1, 2), ("dp_replicate", "tp", "dp_shard"), "dp_shard"),  # next to a size-1 axis
        ((2, 2), ("dp_replicate", "dp_shard"), "dp_shard"),
    ],
)
def test_fake_backend_dimension_is_refused(
    world4: World, shape: tuple[int, ...], dim_names: tuple[str, ...], fake: str
) -> None:
    results = world4.run(w.fake_backend_error, shape, dim_names, fake)
    assert len({(kind, message) for kind, message, _ in results}) == 1  # The same error on every rank.
    kind, message, _ = results[0]
    assert kind == "ValueError"
    assert repr(fake) in message
    assert "fake" in message and "`mesh`" in message
    # With that dimension sliced out, the rest of the mesh works: its root sums its own ranks.
    assert [error for _, _, error in results] == [0.0] * 4


# -- DeviceMesh equality ignores process groups ----------------------------------------------------


def test_equal_meshes_do_not_share_dtensor_caches(world4: World) -> None:
    # torch's DeviceMesh equality ignores process groups, and DTensor's sharding-propagation cache
    # hands back the first equal mesh: a plain mesh over the gangs' groups gets `theirs` (fake
    # backend: the all-reduce computes nothing, each rank keeps its own doubled value).
    for rank, result in enumerate(world4.run(w.equal_meshes_pitfall)):
        own = 2.0 * (rank + 1)
        assert result["plain_equals_theirs"], rank
        assert result["theirs"] == (True, own), rank
        assert result["plain"] == (False, own), rank  # The pitfall: torch's behaviour, shown.
        # A mesh from to_device_mesh is equal only to meshes over the same groups.
        assert not result["ours_equals_theirs"], rank
        assert result["ours_equals_ours_again"], rank
        assert result["ours"] == (True, result["expected"]), rank


# -- context and expert parallel, flattened dimensions ---------------------------------------------


def test_cp_ep_and_flattened_meshes(world8: World) -> None:
    # hybrid: cp=2, ep=4, rdp=2, sdp=2 (rank = rdp * 4 + sdp * 2 + cp); sharded: tp=2, cp=2, sdp=dp=2.
    for rank, result in enumerate(world8.run(w.cp_ep_meshes)):
        for key in ("rdp_sdp_cp", "dp_cp", "dp_cp_flat", "edp_ep", "dp_cp_tp", "no_layout"):
            assert all(result[key]["lines"]), (rank, key)
            assert all(result[key]["groups"]), (rank, key)
        assert result["rdp_sdp_cp"]["mesh"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert result["rdp_sdp_cp"]["names"] == ("rdp", "sdp_cp")
        assert result["dp_cp"]["mesh"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert result["dp_cp_flat"]["names"] == ("cp_dp",)
        assert result["dp_cp_flat"]["mesh"] == FULL_8  # grid order, whatever order the roles are named in
        assert result["flat_is_root"]
        # ep: blocks of 4 of the (dp, cp) ranks; edp: equal positions in those blocks.
        assert result["edp_ep"]["mesh"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert result["members"]["ep"] == ((0, 1, 2, 3) if rank < 4 else (4, 5, 6, 7))
        assert result["members"]["edp"] == (rank % 4, rank % 4 + 4)
        assert result["dp_cp_tp"]["mesh"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        # fsdp_mesh shards over sdp x cp: HSDP ("rdp", "sdp_cp"), or 1-D "sdp_cp" (tp stays out).
        assert result["fsdp_hybrid"]["mesh"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert result["fsdp_hybrid"]["names"] == ("rdp", "sdp_cp")
        assert result["fsdp_sharded"]["names"] == ("sdp_cp",)
        assert result["fsdp_sharded"]["mesh"] == [r for r in FULL_8 if r % 2 == rank % 2]
        # Without a layout (gangs from a mesh), the same mesh, found by gathering coordinates.
        assert result["no_layout"]["mesh"] == result["rdp_sdp_cp"]["mesh"]
        for role in ("root", "dp", "rdp", "sdp", "cp", "tp", "pp"):
            assert result["no_layout_members"][role] == result["members"][role], (rank, role)


def test_no_layout_gangs_that_are_not_a_grid_fail_on_every_rank(world4: World) -> None:
    results = world4.run(w.no_layout_not_a_grid)
    assert {kind for kind, _ in results} == {"ValueError"}
    culprits = {message.split(" do not")[0] for _, message in results}
    assert len(culprits) == 1  # every rank names the same culprit
    assert "`dims` must name gangs that form a grid" in results[0][1]
    assert any("the line along 'dp'" in message for _, message in results)  # on the rank that found it


# Which mesh dimensions each role spans on torchtitan 0.3's meshes (ParallelDims.build_mesh).
def test_expert_tensor_parallel_meshes(world8: World) -> None:
    for rank, report in enumerate(world8.run(w.etp_meshes)):
        # tp 2, ep 4, etp 1: ep gangs are blocks of 4 (two tp gangs), edp strided by 4 ...
        assert report["wide"]["mesh"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert report["wide"]["lines"] == [True, True] and report["wide"]["groups"] == [True, True]
        # ... the ranks and groups of torchtitan 0.3's sparse mesh of the same degrees.
        assert report["titan_ranks"] and report["titan_groups"] == [True, True]
        block, offset = tuple(range(rank - rank % 4, rank - rank % 4 + 4)), (rank % 4, rank % 4 + 4)
        assert report["titan_back"] == {"ep": block, "edp": offset, "etp": 1}
        assert "'tp' and 'ep' split the same ranks" in report["wide_tp_refused"]
        # tp 4, ep 2, etp 2: rank = (edp * 2 + ep) * 2 + etp.
        assert report["split"]["mesh"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        assert report["split"]["lines"] == [True] * 3 and report["split"]["groups"] == [True] * 3
        e, x, y = rank // 4, rank // 2 % 2, rank % 2
        assert report["split_members"] == {
            "ep": (4 * e + y, 4 * e + 2 + y),
            "edp": (2 * x + y, 4 + 2 * x + y),
            "etp": (rank - y, rank - y + 1),
            "tp": block,
        }
        # An (edp, ep, etp) mesh read back: etp (and tp with it) is its dimension; dp spans edp x ep.
        back = report["back"]
        assert back["etp"] == back["tp"] == (rank - y, rank - y + 1)
        assert back["ep"] == (4 * e + y, 4 * e + 2 + y) and back["edp"] == (2 * x + y, 4 + 2 * x + y)
        assert back["dp"] == back["sdp"] == (y, 2 + y, 4 + y, 6 + y) and back["rdp"] == back["cp"] == 1
        assert report["again"]


TITAN_SPANS = {
    "dataloading": {"dp": ("batch",), "rdp": ("batch",), "cp": ("cp",), "tp": ("tp",), "pp": ("pp",),
                    "edp": ("batch", "cp"), "etp": ("tp",)},
    "loss": {"dp": ("loss_mesh",), "rdp": ("loss_mesh",), "edp": ("loss_mesh",)},
    "dense": {"dp": ("dp_replicate", "dp_shard"), "rdp": ("dp_replicate",), "sdp": ("dp_shard",), "cp": ("cp",),
              "tp": ("tp",), "pp": ("pp",), "edp": ("dp_replicate", "dp_shard", "cp"), "etp": ("tp",)},
    "fwdbwd": {"dp": ("dp",), "rdp": ("dp",), "cp": ("cp",), "tp": ("tp",), "pp": ("pp",), "edp": ("dp", "cp"),
               "etp": ("tp",)},
    "legacy": {"dp": ("dp_replicate", "fsdp"), "rdp": ("dp_replicate",), "sdp": ("fsdp",), "tp": ("tp",),
               "pp": ("pp",), "edp": ("dp_replicate", "fsdp"), "etp": ("tp",)},
    "sparse": {"dp": ("dp_replicate", "efsdp", "ep"), "rdp": ("dp_replicate",), "sdp": ("efsdp", "ep"),
               "pp": ("pp",), "ep": ("ep",), "edp": ("dp_replicate", "efsdp")},
}  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        (1, 2, 2, 2, 1, 2),  # dp_replicate, dp_shard, cp, tp, pp, ep: efsdp = 4, disabled axes on `fake`
        (2, 2, 2, 1, 1, 2),  # HSDP with cp and ep: efsdp = 2 next to dp_replicate
    ],
)
def test_torchtitan_meshes_convert_and_round_trip(world8: World, config: tuple[int, ...]) -> None:
    # The meshes are built with torch's `_unflatten`/`_flatten` exactly as torchtitan 0.3 builds
    # them (torchtitan itself is too heavy for the test environment; test_torchtitan.py uses it
    # where it is installed).
    for rank, results in enumerate(world8.run(w.titan_layouts, config, TITAN_SPANS)):
        for name, result in results.items():
            assert result["got"] == result["expected"], (rank, name)
            assert result["sums_ok"], (rank, name)
            assert result["new_groups"] == [], (rank, name)  # converting a mesh again creates no group
            assert result["refused"].startswith("`global_ranks` must hold this process"), (rank, result["refused"])
            # A sparse mesh with dp_replicate comes back as (edp, ep): edp spans dp_replicate x efsdp,
            # and the (edp, ep) mesh no longer says which part of dp is replicated.
            folded = ["rdp", "sdp"] if name == "sparse" and config[0] > 1 else []
            # Every dimension comes back, size-1 ones (on the `fake` backend there) included.
            assert result["round_trip"] == {"same_mesh": True, "differ": folded, "names": True}, (rank, name)
