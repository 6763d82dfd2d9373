"""Functions ``test_jax_mesh.py`` runs on every rank: a torch gloo root gang and JAX in the same processes."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import torch
import torch.distributed as dist

from gang import FakeGang, Gang, Gangs, ProcessGroupGang, ReduceOperation, create_fsdp_gangs, create_parallel_gangs
from gang.roles import ROLES
from gang.topology import MeshDim
from gang_jax import JaxGang, from_jax_mesh, to_jax_mesh
from gang_mesh import from_device_mesh, to_device_mesh

_JAX: JaxGang | None = None
_GANGS: dict[tuple[str, int, int, int | None], Gangs] = {}


def jax_root() -> JaxGang:
    """This process's JaxGang of every process (JAX process index = torch rank), created once."""
    global _JAX
    if _JAX is None:
        _JAX = JaxGang.create_default()
    return _JAX


def layout_gangs(root: Gang, kind: str, tp: int, pp: int, intra: int | None) -> Gangs:
    """The factories' gangs of a layout on the torch root (``kind == "torch"``) or the JaxGang root, kept."""
    key = (kind, tp, pp, intra)
    if key not in _GANGS:
        base = root if kind == "torch" else jax_root()
        _GANGS[key] = create_fsdp_gangs(create_parallel_gangs(base, tp_size=tp, pp_size=pp), intra)
    return _GANGS[key]


def processes(mesh: jax.sharding.Mesh) -> list[Any]:
    """The JAX process index of each device of ``mesh``, as nested lists."""
    found: list[Any] = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices).tolist()
    return found


def members(gang: Gang) -> tuple[int, ...] | int:
    """The global ranks (JAX process indices) of a gang's members, or the size of a size-1 gang."""
    if isinstance(gang, ProcessGroupGang):
        return gang.global_ranks
    if isinstance(gang, JaxGang):
        return gang.members
    assert isinstance(gang, FakeGang) and gang.size == 1, gang
    return 1


def sums(gangs: Gangs) -> dict[str, float]:
    """The sum of the global ranks over each role's gang (one all-reduce per distinct gang)."""
    done: dict[int, float] = {}
    result = {}
    for role in ROLES:
        gang = getattr(gangs, role)
        if id(gang) not in done:
            value = torch.tensor([float(dist.get_rank())])
            gang.all_reduce(value, ReduceOperation.SUM)
            done[id(gang)] = value.item()
        result[role] = done[id(gang)]
    return result


def meshes(root: Gang, cases: Sequence[tuple[tuple[int, int, int | None], Sequence[MeshDim]]]) -> list[dict[str, Any]]:
    """For each ``((tp, pp, intra), dims)``: the JAX meshes of torch and JaxGang gangs next to the torch mesh.

    Then the round trip: the gangs of the JAX mesh (their members, their collectives) and the JAX
    mesh of those gangs again.
    """
    reports = []
    for (tp, pp, intra), dims in cases:
        torch_gangs = layout_gangs(root, "torch", tp, pp, intra)
        jax_gangs = layout_gangs(root, "jax", tp, pp, intra)
        mesh = to_jax_mesh(torch_gangs, dims)
        report: dict[str, Any] = {
            "names": mesh.axis_names,
            "torch_mesh": to_device_mesh(torch_gangs, dims).mesh.tolist(),
            "from_torch_gangs": processes(mesh),
            "from_jax_gangs": processes(to_jax_mesh(jax_gangs, dims)),
            "same_devices": to_jax_mesh(jax_gangs, dims).devices.tolist() == mesh.devices.tolist(),
            "torch_members": {role: members(getattr(torch_gangs, role)) for role in ROLES},
        }
        if all(isinstance(dim, str) for dim in dims):  # a flattened axis ("sdp_tp") plays no one role
            back = from_jax_mesh(mesh)
            report["back_members"] = {role: members(getattr(back, role)) for role in ROLES}
            report["back_kinds"] = sorted({type(getattr(back, role)).__name__ for role in ROLES})
            report["back_sums"] = sums(back)
            report["again"] = to_jax_mesh(back, mesh.axis_names).devices.tolist() == mesh.devices.tolist()
        reports.append(report)
    return reports


def hand_made(
    root: Gang, shape: tuple[int, ...], axis_names: tuple[str, ...], names: Mapping[str, str] | None
) -> dict[str, Any]:
    """``from_jax_mesh`` of ``jax.make_mesh(shape, axis_names)``: members and sums of every role."""
    jax_root()
    mesh = jax.make_mesh(shape, axis_names)
    gangs = from_jax_mesh(mesh, names=names)
    return {
        "mesh": processes(mesh),
        "members": {role: members(getattr(gangs, role)) for role in ROLES},
        "sums": sums(gangs),
        "flattened": members(gangs.flatten(*[role for role in ("sdp", "tp") if getattr(gangs, role).size > 1])),
    }


def errors(root: Gang) -> dict[str, str]:
    """The error each bad call raises (``"no error"`` when none), the same on every rank."""
    gangs = layout_gangs(root, "torch", 2, 1, 2)
    jax_root()
    me = jax.process_index()
    devices = jax.devices()
    calls: dict[str, Any] = {
        "unknown": lambda: to_jax_mesh(gangs, ("bogus",)),
        "repeated": lambda: to_jax_mesh(gangs, ("tp", "tp")),
        "not a grid": lambda: to_jax_mesh(gangs, ("dp", "rdp")),
        "empty": lambda: to_jax_mesh(gangs, ()),
        "a str": lambda: to_jax_mesh(gangs, "tp"),
        "not gangs": lambda: to_jax_mesh(root, ("tp",)),  # type: ignore[arg-type]
        "no layout": lambda: to_jax_mesh(from_device_mesh(to_device_mesh(gangs, ("dp", "tp"))), ("dp", "tp")),
        "not a mesh": lambda: from_jax_mesh("mesh"),  # type: ignore[arg-type]
        "no role": lambda: from_jax_mesh(jax.make_mesh((2, 4), ("data", "model"))),
        "bad names": lambda: from_jax_mesh(jax.make_mesh((2, 4), ("data", "tp")), names={"data": "bogus"}),
        "two roles alike": lambda: from_jax_mesh(jax.make_mesh((2, 4), ("dp_shard", "sdp"))),
        "dp with rdp": lambda: from_jax_mesh(jax.make_mesh((2, 4), ("dp", "rdp"))),
        "not in the mesh": lambda: from_jax_mesh(
            jax.sharding.Mesh(np.array([d for d in devices if d.process_index != me][:4]), ("tp",))
        ),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except (TypeError, ValueError) as ex:
            out[name] = f"{type(ex).__name__}: {ex}"
    # No bad call communicated: one all-reduce over every process still pairs up.
    value = torch.ones(1)
    root.all_reduce(value, ReduceOperation.SUM)
    out["sum"] = str(value.item())
    return out


def index_not_rank(root: Gang, address: str) -> str:
    """``to_jax_mesh`` of the factories' torch gangs in processes whose JAX process indices are their
    torch ranks reversed (started with ``JaxGang.create_default``'s explicit ``process_id``): the
    error it raises (``"no error"`` when none). JAX is shut down again."""
    reversed_index = root.size - 1 - root.rank
    jax_gang = JaxGang.create_default(coordinator_address=address, num_processes=root.size, process_id=reversed_index)
    try:
        assert jax.process_index() == reversed_index != dist.get_rank()
        gangs = create_parallel_gangs(root, tp_size=root.size)
        try:
            to_jax_mesh(gangs, ("tp",))
        except ValueError as ex:
            return str(ex)
        return "no error"
    finally:
        jax_gang.close()


def close(root: Gang) -> None:
    """Close the kept gangs and the JAX runtime."""
    global _JAX
    for gangs in _GANGS.values():
        if not isinstance(gangs.root, ProcessGroupGang):
            gangs.close()
    _GANGS.clear()
    if _JAX is not None:
        _JAX.close()
        _JAX = None


def mlp(root: Gang, pp: int) -> dict[str, Any]:
    """``examples/torch_and_jax_mlp.py``'s comparison on this world: ``rdp`` x ``sdp`` 2 x ``tp`` 2 per pipeline stage.

    With ``pp=2`` each stage of 4 processes trains on its own sub-meshes (``rdp`` of size 1).
    """
    examples = str(Path(__file__).resolve().parents[3] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import torch_and_jax_mlp as example

    jax_root()
    example._quiet()
    gangs = create_fsdp_gangs(create_parallel_gangs(root, tp_size=2, pp_size=pp), 2)
    report: dict[str, Any] = example.compare(gangs)
    report["mesh"] = processes(to_jax_mesh(gangs, example.DIMS))
    return report
