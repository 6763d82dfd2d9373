"""gang_jax.to_jax_mesh and from_jax_mesh on 8 real processes (torch gloo and JAX side by side).

One layout, both frameworks: the JAX mesh of a layout holds, axis by axis, the processes the torch
mesh holds, whether the gangs are torch gangs or JaxGang gangs; the gangs of a JAX mesh (made by
hand or by ``to_jax_mesh``) sum over the processes of each axis slice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax_mesh_workers as jw
import numpy as np
import pytest

from gang.testing import World, free_port


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with World(8, env={"OMP_NUM_THREADS": "1"}) as w:
        yield w
        if w.alive:
            w.run(jw.close)


CASES: list[tuple[tuple[int, int, int | None], tuple[Any, ...]]] = [
    ((2, 1, 2), ("rdp", "sdp", "tp")),  # HSDP x tensor parallel: the layout of the MLP example
    ((2, 1, 2), ("tp", "sdp", "rdp")),  # the same gangs, axes in another order
    ((2, 1, 2), ("rdp", ("sdp", "tp"))),  # a flattened axis, named "sdp_tp"
    ((2, 2, None), ("pp", "dp", "tp")),
    ((2, 2, None), ("dp", "tp")),  # one pipeline stage: a sub-mesh of its 4 processes
    ((1, 1, None), ("rdp", "sdp", "tp")),  # size-1 axes: rdp and tp
]


def test_one_layout_in_both_frameworks(world: World) -> None:
    for rank, reports in enumerate(world.run(jw.meshes, CASES)):
        for (_, dims), report in zip(CASES, reports, strict=True):
            names = tuple(d if isinstance(d, str) else "_".join(d) for d in dims)
            assert report["names"] == names
            # The same processes in the same places as the torch mesh, for torch and JaxGang gangs.
            assert report["from_torch_gangs"] == report["torch_mesh"], (rank, dims)
            assert report["from_jax_gangs"] == report["torch_mesh"], (rank, dims)
            assert report["same_devices"], (rank, dims)
            if "back_members" not in report:
                continue
            # Round trip: the JAX mesh's gangs have the torch gangs' members (size-1 gangs too).
            torch_members, back = report["torch_members"], report["back_members"]
            if "pp" not in names:  # root spans the mesh: one pipeline stage of the torch root's processes
                torch_members["root"] = tuple(sorted(np.ravel(report["torch_mesh"]).tolist()))
            for role in ("root", *names):
                assert back[role] == torch_members[role], (rank, dims, role)
            assert report["back_kinds"] in (["FakeGang", "JaxGang"], ["JaxGang"]), (rank, dims)
            for role, value in back.items():
                expected = float(sum(value)) if isinstance(value, tuple) else float(rank)
                assert report["back_sums"][role] == expected, (rank, dims, role)
            assert report["again"], (rank, dims)


def _span(mesh: list[Any], rank: int, names: tuple[str, ...], *axes: str) -> tuple[int, ...]:
    """The processes of a mesh of processes that share ``rank``'s coordinates off ``axes``, in mesh order."""
    array = np.array(mesh)
    where = np.argwhere(array == rank)[0]
    index = tuple(slice(None) if name in axes else int(i) for name, i in zip(names, where, strict=True))
    return tuple(array[index].reshape(-1).tolist())


def test_hand_made_mesh(world: World) -> None:
    # jax.make_mesh((2, 2, 2), ("rdp", "sdp", "tp")): each gang sums over its axis slice's processes.
    names = ("rdp", "sdp", "tp")
    for rank, report in enumerate(world.run(jw.hand_made, (2, 2, 2), names, None)):
        for role in names:
            line = _span(report["mesh"], rank, names, role)
            assert report["members"][role] == line, (rank, role)
            assert report["sums"][role] == sum(line)
        dp = _span(report["mesh"], rank, names, "rdp", "sdp")
        assert report["members"]["dp"] == dp and report["sums"]["dp"] == sum(dp)
        assert report["sums"]["root"] == 28.0 and report["sums"]["pp"] == rank
        assert report["flattened"] == _span(report["mesh"], rank, names, "sdp", "tp")


@pytest.mark.parametrize(
    ("names", "mapping", "roles"),
    [
        (("dp_replicate", "dp_shard", "tp"), None, ("rdp", "sdp", "tp")),  # torchtitan's dense mesh
        (("pp", "dp_shard_cp", "tp"), None, ("pp", "sdp", "tp")),  # its flattened name: sdp, cp folded in
        (("replica", "shard", "model"), {"replica": "rdp", "shard": "sdp", "model": "tp"}, ("rdp", "sdp", "tp")),
    ],
)
def test_names_map_as_from_device_mesh(
    world: World, names: tuple[str, ...], mapping: dict[str, str] | None, roles: tuple[str, ...]
) -> None:
    for rank, report in enumerate(world.run(jw.hand_made, (2, 2, 2), names, mapping)):
        for name, role in zip(names, roles, strict=True):
            assert report["members"][role] == _span(report["mesh"], rank, names, name), (rank, name)
        assert report["members"]["cp"] == 1


def test_errors_before_any_communication(world: World) -> None:
    results = world.run(jw.errors)
    for r in results:  # the same verdicts on every rank (the one that names this process aside)
        assert {k: v for k, v in r.items() if k != "not in the mesh"} == {
            k: v for k, v in results[0].items() if k != "not in the mesh"
        }
    r = results[0]
    assert r["unknown"].startswith("ValueError: `dims` must contain only names of `Gangs` fields")
    assert "repeat" in r["repeated"] and r["repeated"].startswith("ValueError")
    assert "form a grid" in r["not a grid"]
    assert r["empty"] == "ValueError: `dims` must name at least one gang, but is empty instead."
    assert r["a str"].startswith("TypeError: `dims` must be a sequence")
    assert r["not gangs"].startswith("TypeError: `gangs` must be a `Gangs`")
    assert r["no layout"].startswith("ValueError: `gangs` must know their layout")
    assert r["not a mesh"].startswith("TypeError: `mesh` must be a `jax.sharding.Mesh`")
    assert r["no role"].startswith("ValueError: `mesh` dimension names must be roles") and "'data'" in r["no role"]
    assert r["bad names"].startswith("ValueError: `names` must map to roles") and "'bogus'" in r["bad names"]
    assert "both play 'sdp'" in r["two roles alike"]
    assert "fit together" in r["dp with rdp"]
    assert r["not in the mesh"].startswith("ValueError: `mesh` must hold a device of this process")
    assert r["sum"] == "8.0"


def test_to_jax_mesh_refuses_a_jax_process_index_other_than_the_torch_rank() -> None:
    # Two real processes whose JAX process indices are their torch ranks reversed: the device of
    # torch rank r is not process r's, so the mesh of torch gangs would be wrong; it is refused.
    address = f"127.0.0.1:{free_port()}"
    with World(2, env={"OMP_NUM_THREADS": "1"}) as w:
        messages = w.run(jw.index_not_rank, address)
    for rank, message in enumerate(messages):
        assert message == (
            f"This process's JAX process index must equal its torch rank, but is {1 - rank} on torch rank {rank} "
            "instead (start JAX with `JaxGang.create_default()`, which uses the torch rank)."
        )


@pytest.mark.parametrize(("pp", "mesh"), [(1, [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]), (2, [[[0, 1], [2, 3]]])])
def test_the_same_mlp_in_torch_and_jax(world: World, pp: int, mesh: list[Any]) -> None:
    # examples/torch_and_jax_mlp.py: FSDP2 + DTensor on to_device_mesh against jit + NamedSharding
    # on to_jax_mesh, 5 SGD steps from the same weights and batches. pp=1: rdp 2 x sdp 2 x tp 2 on
    # 8 processes; pp=2: each pipeline stage trains alone, rdp 1 x sdp 2 x tp 2 on 4 processes.
    for rank, report in enumerate(world.run(jw.mlp, pp)):
        if rank < 4:
            assert report["mesh"] == mesh
        assert report["layout"] == {"rdp": 2 // pp, "sdp": 2, "tp": 2}
        for dtype, tolerance in (("float32", 1e-5), ("float64", 1e-12)):
            r = report[dtype]
            assert r["param_diff"] < tolerance and r["loss_diff"] < tolerance, (rank, dtype, r)
            assert r["torch"][-1] < r["torch"][0], (rank, dtype)  # it learns
