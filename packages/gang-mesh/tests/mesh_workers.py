"""Functions the tests run on every rank of a :class:`gang.testing.World` (imported by name there)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gang import Gang, Gangs, ProcessGroupGang, ReduceOperation, create_fsdp_gangs, create_parallel_gangs
from gang.roles import ROLES
from gang_mesh import ALIASES, from_device_mesh, fsdp_mesh, to_device_mesh

# Gangs of each layout are created once per worker and kept: closing sub-gangs and creating the
# same ones again fails on gloo (see the package's report about `ProcessGroupGang._close`).
_GANGS: dict[tuple[int, int, int, int | None], Gangs] = {}


def make_gangs(root: Gang, tp: int = 1, pp: int = 1, intra: int | None = None) -> Gangs:
    """Gangs of a layout; ``intra=0`` skips :func:`create_fsdp_gangs` (``rdp = dp``, size-1 ``sdp``)."""
    key = (id(root), tp, pp, intra)
    if key not in _GANGS:
        gangs = create_parallel_gangs(root, tp_size=tp, pp_size=pp)
        _GANGS[key] = gangs if intra == 0 else create_fsdp_gangs(gangs, intra)
    return _GANGS[key]


def members(gang: Gang) -> tuple[int, ...] | int:
    """Global ranks of a real gang, or the size of a gang without a process group."""
    if isinstance(gang, ProcessGroupGang):
        return gang.global_ranks
    return gang.size


def describe(mesh: DeviceMesh) -> dict[str, Any]:
    return {"mesh": mesh.mesh.tolist(), "names": mesh.mesh_dim_names, "type": mesh.device_type}


def mesh_of(root: Gang, dims: Sequence[str], tp: int = 1, pp: int = 1, intra: int | None = None) -> dict[str, Any]:
    """Build the mesh of ``dims`` and report its contents and whether each group is the gang's own."""
    gangs = make_gangs(root, tp, pp, intra)
    mesh = to_device_mesh(gangs, dims)
    result = describe(mesh)
    result["same_group"] = [mesh.get_group(name) is getattr(gangs, name).as_process_group() for name in dims]
    result["members"] = [members(getattr(gangs, name)) for name in dims]
    # Each slice through this rank is the gang, in gang rank order.
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    lines = []
    for i in range(mesh.ndim):
        index = tuple(slice(None) if j == i else c for j, c in enumerate(coordinate))
        lines.append(tuple(mesh.mesh[index].tolist()))
    result["lines"] = lines
    result["local_ranks"] = [mesh.get_local_rank(name) for name in dims]
    result["gang_ranks"] = [getattr(gangs, name).rank for name in dims]
    return result


def fsdp_mesh_of(root: Gang, intra: int | None) -> dict[str, Any]:
    gangs = make_gangs(root, intra=intra)
    mesh = fsdp_mesh(gangs)
    result = describe(mesh)
    result["same_group"] = [
        mesh.get_group(name) is getattr(gangs, name).as_process_group() for name in mesh.mesh_dim_names or ()
    ]
    return result


def to_mesh_error(root: Gang, dims: Any, tp: int = 1, pp: int = 1, intra: int | None = None) -> tuple[str, str]:
    gangs = make_gangs(root, tp, pp, intra)
    try:
        to_device_mesh(gangs, dims)
    except (ValueError, TypeError) as ex:
        return type(ex).__name__, str(ex)
    return "no error", ""


def fsdp_mesh_error(root: Gang, intra: int | None) -> tuple[str, str]:
    try:
        fsdp_mesh(make_gangs(root, intra=intra))
    except (ValueError, TypeError) as ex:
        return type(ex).__name__, str(ex)
    return "no error", ""


def to_mesh_bad_gangs(root: Gang) -> tuple[str, str]:
    try:
        to_device_mesh(root, ("dp",))  # type: ignore[arg-type]
    except TypeError as ex:
        return type(ex).__name__, str(ex)
    return "no error", ""


def to_mesh_error_alone(root: Gang, dims: Any) -> tuple[str, float]:
    """Only rank 0 calls ``to_device_mesh`` with bad arguments; then every rank runs one all-reduce.

    If the bad call had communicated, rank 0's collective would pair with the others' all-reduce.
    """
    gangs = make_gangs(root, tp=2)
    error = "no error"
    if root.rank == 0:
        try:
            to_device_mesh(gangs, dims)
        except (ValueError, TypeError) as ex:
            error = type(ex).__name__
    value = torch.tensor([float(root.rank + 1)])
    root.all_reduce(value, ReduceOperation.SUM)
    return error, float(value.item())


def from_mesh_report(gangs: Gangs) -> dict[str, Any]:
    report: dict[str, Any] = {role: members(getattr(gangs, role)) for role in ROLES}
    report["dp_is_root"] = gangs.dp is gangs.root
    report["rdp_is_dp"] = gangs.rdp is gangs.dp
    # Every real gang works: the sum of global ranks over its members.
    sums = {}
    for role in ROLES:
        gang = getattr(gangs, role)
        value = torch.tensor([float(dist.get_rank())])
        gang.all_reduce(value, ReduceOperation.SUM)
        sums[role] = value.item()
    report["sums"] = sums
    return report


def from_init_mesh(
    root: Gang, shape: tuple[int, ...], dim_names: tuple[str, ...], names: Mapping[str, str] | None, sub: Any = None
) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dim_names)
    if sub is not None:
        mesh = mesh[sub]
    gangs = from_device_mesh(mesh, names=names)
    report = from_mesh_report(gangs)
    report["same_group"] = (
        [mesh.get_group(i) is _gang_for(gangs, name, names).as_process_group() for i, name in enumerate(dim_names)]
        if sub is None
        else None
    )
    return report


def _gang_for(gangs: Gangs, name: str, names: Mapping[str, str] | None) -> Gang:
    role = (names or {}).get(name) or ALIASES.get(name, name)
    gang: Gang = getattr(gangs, role)
    return gang


def from_mesh_error(
    root: Gang, shape: tuple[int, ...], dim_names: tuple[str, ...] | None, names: Any, sub: Any = None
) -> tuple[str, str]:
    mesh: Any = init_device_mesh("cpu", shape, mesh_dim_names=dim_names) if shape else "not a mesh"
    if sub is not None:
        mesh = mesh[sub]
    try:
        from_device_mesh(mesh, names=names)
    except (ValueError, TypeError) as ex:
        return type(ex).__name__, str(ex)
    return "no error", ""


def round_trip(root: Gang, dims: Sequence[str], tp: int = 1, pp: int = 1, intra: int | None = None) -> dict[str, Any]:
    gangs = make_gangs(root, tp, pp, intra)
    back = from_device_mesh(to_device_mesh(gangs, dims))
    result = {
        "before": {role: members(getattr(gangs, role)) for role in ROLES},
        "after": {role: members(getattr(back, role)) for role in ROLES},
        "same_groups": [
            getattr(back, name).as_process_group() is getattr(gangs, name).as_process_group() for name in dims
        ],
    }
    return result


def _roles_of(dim_names: Sequence[str]) -> tuple[str, ...]:
    return tuple(ALIASES.get(name, name) for name in dim_names)


def sub_mesh_round_trip(root: Gang, shape: tuple[int, ...], dim_names: tuple[str, ...], sub: Any) -> dict[str, Any]:
    """Slice an ``init_device_mesh`` mesh, turn it into gangs, back into a mesh, and into gangs again."""
    sliced = init_device_mesh("cpu", shape, mesh_dim_names=dim_names)[sub]
    gangs = from_device_mesh(sliced)
    dims = _roles_of(sliced.mesh_dim_names or ())
    mesh = to_device_mesh(gangs, dims)
    back = from_device_mesh(mesh)
    return {
        "sliced": sliced.mesh.tolist(),
        "mesh": mesh.mesh.tolist(),
        "names": mesh.mesh_dim_names,
        "same_group": [mesh.get_group(name) is getattr(gangs, name).as_process_group() for name in dims],
        "before": {role: members(getattr(gangs, role)) for role in ROLES},
        "after": {role: members(getattr(back, role)) for role in ROLES},
        "sums": from_mesh_report(back)["sums"],
    }


def fake_backend_error(
    root: Gang, shape: tuple[int, ...], dim_names: tuple[str, ...], fake: str
) -> tuple[str, str, float]:
    """``from_device_mesh`` on a mesh whose dimension ``fake`` is on torch's ``fake`` backend.

    Returns the error, and how far the sum of global ranks over ``root`` of the gangs from the mesh
    with that dimension sliced out (which must work) is from the sum of that mesh's ranks.
    """
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dim_names, backend_override={fake: "fake"})
    assert dist.get_backend(mesh.get_group(fake)) == "fake"
    kind, message = "no error", ""
    try:
        from_device_mesh(mesh)
    except (ValueError, TypeError) as ex:
        kind, message = type(ex).__name__, str(ex)
    rest = mesh[tuple(name for name in dim_names if name != fake)]
    total = from_mesh_report(from_device_mesh(rest))["sums"]["root"]
    return kind, message, total - sum(rest.mesh.flatten().tolist())
