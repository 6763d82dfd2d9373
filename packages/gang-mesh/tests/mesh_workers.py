"""Functions the tests run on every rank of a :class:`gang.testing.World` (imported by name there)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gang import Gang, Gangs, ProcessGroupGang, ReduceOperation, create_fsdp_gangs, create_parallel_gangs
from gang.rendezvous import members_group
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


def equal_meshes_pitfall(root: Gang) -> dict[str, Any]:
    """A DTensor op on a mesh right after the same op on an *equal* mesh over other groups.

    ``theirs`` is an ``init_device_mesh`` mesh (as torchtitan builds) whose ``tp`` groups are on
    torch's ``fake`` backend, so a collective that lands on them computes nothing and shows it.
    ``plain`` is a plain ``DeviceMesh`` over the gangs' groups (what ``to_device_mesh`` returned
    before it guarded against this); ``ours`` is ``to_device_mesh``'s. Each runs: a ``Partial``
    DTensor doubled (a cached sharding propagation) and then reduced to ``Replicate`` (an
    all-reduce over the output's mesh).
    """
    import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
    from torch.distributed.tensor import DTensor, Partial, Replicate

    gangs = make_gangs(root, tp=2, intra=0)
    theirs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={"tp": "fake"})
    groups = [gangs.dp.as_process_group(), gangs.tp.as_process_group()]
    plain = DeviceMesh.from_group(groups, "cpu", mesh=theirs.mesh, mesh_dim_names=("dp", "tp"))
    ours = to_device_mesh(gangs, ("dp", "tp"))

    def doubled_sum(mesh: DeviceMesh) -> tuple[bool, float]:
        # A shape no other test uses: the cache entry is this function's own.
        local = torch.full((7, 3), float(dist.get_rank() + 1), dtype=torch.float64)
        doubled = DTensor.from_local(local, mesh, [Partial()]) * 2
        assert isinstance(doubled, DTensor)
        total = doubled.redistribute(mesh, [Replicate()]).to_local()
        return doubled.device_mesh is mesh, float(total[0, 0].item())

    return {
        "plain_equals_theirs": plain == theirs and plain["tp"] == theirs["tp"],
        "ours_equals_theirs": ours == theirs or ours["tp"] == theirs["tp"] or theirs["tp"] == ours["tp"],
        "ours_equals_ours_again": ours == to_device_mesh(gangs, ("dp", "tp")),
        "theirs": doubled_sum(theirs["tp"]),  # First: fills the cache.
        "plain": doubled_sum(plain["tp"]),
        "ours": doubled_sum(ours["tp"]),
        "expected": 2.0 * sum(r + 1 for r in members_of(gangs.tp)),
    }


def members_of(gang: Gang) -> tuple[int, ...]:
    """Global ranks of a gang with a process group."""
    assert isinstance(gang, ProcessGroupGang)
    return gang.global_ranks


# -- context and expert parallel -------------------------------------------------------------------


def _mesh_report(gangs: Gangs, dims: Sequence[Any]) -> dict[str, Any]:
    """``to_device_mesh(gangs, dims)``: its ranks, names, and whether each line and group is the gang's."""
    mesh = to_device_mesh(gangs, dims)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    lines_ok, groups_ok = [], []
    for i, dim in enumerate(dims):
        gang = gangs.flatten(*dim) if isinstance(dim, tuple) else getattr(gangs, dim)
        index = tuple(slice(None) if j == i else c for j, c in enumerate(coordinate))
        lines_ok.append(tuple(mesh.mesh[index].tolist()) == members(gang) and mesh.get_local_rank(i) == gang.rank)
        groups_ok.append(mesh.get_group(i) is gang.as_process_group())
    return {"mesh": mesh.mesh.tolist(), "names": mesh.mesh_dim_names, "lines": lines_ok, "groups": groups_ok}


def cp_ep_meshes(root: Gang) -> dict[str, Any]:
    """Meshes of gangs with context and expert parallel, with and without a layout, and ``fsdp_mesh``."""
    # 8 ranks, cp=2, ep=4, HSDP rdp=2 x sdp=2: rank = rdp * 4 + sdp * 2 + cp.
    hybrid = create_fsdp_gangs(create_parallel_gangs(root, cp_size=2, ep_size=4), 2)
    # 8 ranks, tp=2, cp=2, fully sharded sdp=dp=2: rank = sdp * 4 + cp * 2 + tp.
    sharded = create_fsdp_gangs(create_parallel_gangs(root, tp_size=2, cp_size=2), None)
    report = {
        "rdp_sdp_cp": _mesh_report(hybrid, ("rdp", ("sdp", "cp"))),
        "dp_cp": _mesh_report(hybrid, ("dp", "cp")),
        "dp_cp_flat": _mesh_report(hybrid, (("cp", "dp"),)),
        "edp_ep": _mesh_report(hybrid, ("edp", "ep")),
        "dp_cp_tp": _mesh_report(sharded, ("dp", "cp", "tp")),
        "fsdp_hybrid": describe(fsdp_mesh(hybrid)),
        "fsdp_sharded": describe(fsdp_mesh(sharded)),
        "flat_is_root": to_device_mesh(hybrid, (("dp", "cp"),)).get_group(0) is root.as_process_group(),
    }
    # The same gangs without a layout (from a mesh): found by gathering coordinates.
    back = from_device_mesh(to_device_mesh(hybrid, ("rdp", "sdp", "cp")))
    assert back.layout is None
    report["no_layout"] = _mesh_report(back, ("rdp", ("sdp", "cp")))
    report["no_layout_members"] = {role: members(getattr(back, role)) for role in ROLES}
    report["members"] = {role: members(getattr(hybrid, role)) for role in ROLES}
    return report


def etp_meshes(root: Gang) -> dict[str, Any]:
    """Expert tensor parallel through the mesh bridge, on 8 ranks.

    ``wide`` (tp 2, ep 4, etp 1: the experts span the tp ranks) against torchtitan 0.3's sparse
    mesh of the same degrees (which always lets ``ep`` span ``tp``); ``split`` (tp 4, ep 2, etp 2)
    as an ``("edp", "ep", "etp")`` mesh; an ``("edp", "ep", "etp")`` mesh of ``init_device_mesh``
    read back (``tp`` is its ``etp`` dimension: the mesh cannot tell them apart) and built again.
    """
    wide = create_parallel_gangs(root, tp_size=2, ep_size=4, etp_size=1)
    titan = titan_meshes(1, 4, 1, 2, 1, 4)["sparse"]  # dp_replicate, dp_shard, cp, tp, pp, ep
    ours = to_device_mesh(wide, ("edp", "ep"))
    split = create_parallel_gangs(root, tp_size=4, ep_size=2, etp_size=2)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("edp", "ep", "etp"))
    back = from_device_mesh(mesh)
    return {
        "wide": _mesh_report(wide, ("edp", "ep")),
        "titan_ranks": ours.mesh.reshape(-1).tolist() == titan.mesh.reshape(-1).tolist(),
        "titan_groups": [
            members(wide.ep) == tuple(dist.get_process_group_ranks(titan.get_group("ep"))),
            members(wide.edp) == tuple(dist.get_process_group_ranks(titan.get_group("efsdp"))),
        ],
        "titan_back": {role: members(getattr(from_device_mesh(titan), role)) for role in ("ep", "edp", "etp")},
        "wide_tp_refused": _error_of(lambda: to_device_mesh(wide, ("edp", "ep", "tp"))),
        "split": _mesh_report(split, ("edp", "ep", "etp")),
        "split_members": {role: members(getattr(split, role)) for role in ("ep", "edp", "etp", "tp")},
        "back": {role: members(getattr(back, role)) for role in ROLES},
        "again": to_device_mesh(back, ("edp", "ep", "etp")).mesh.tolist() == mesh.mesh.tolist(),
    }


def no_layout_not_a_grid(root: Gang) -> tuple[str, str]:
    """``to_device_mesh`` of gangs without a layout whose ``dp`` gangs do not form a grid with ``tp``.

    With ``tp`` ``[0, 1] [2, 3]`` and ``dp`` ``[0, 3] [1, 2]`` the coordinates place every rank
    once in a full 2 x 2 array, but the line along ``dp`` through rank 0 is ``[0, 2]``, not its gang.
    """
    base = from_device_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    odd = root.split([[0, 3], [1, 2]])
    assert odd is not None
    gangs = Gangs(
        root=base.root, dp=odd, rdp=odd, sdp=base.sdp, tp=base.tp, pp=base.pp, cp=base.cp, ep=base.ep, edp=odd
    )
    try:
        to_device_mesh(gangs, ("dp", "tp"))
    except ValueError as ex:
        return "ValueError", str(ex)
    return "no error", ""


# -- torchtitan's ParallelDims meshes, built as it builds them ----------------------------------


# The dimension names of the global meshes torchtitan 0.3's ``ParallelDims.build_mesh`` builds
# (``dense`` under ``spmd_backend="full_dtensor"`` and ``"spmd_types"``, ``fwdbwd`` the dense mesh
# of ``"spmd_types"``'s forward and backward, ``legacy`` the dense mesh of ``"partial_dtensor"``).
TITAN_DIMS = {
    "dataloading": ("pp", "batch", "cp", "tp"),
    "loss": ("loss_mesh",),
    "dense": ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    "fwdbwd": ("pp", "dp", "cp", "tp"),
    "legacy": ("pp", "dp_replicate", "fsdp", "tp"),
    "sparse": ("pp", "dp_replicate", "efsdp", "ep"),
}


def titan_meshes(dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int, ep: int) -> dict[str, DeviceMesh]:
    """The global meshes torchtitan 0.3's ``ParallelDims.build_mesh`` builds (:data:`TITAN_DIMS`), by torch's calls.

    Unflattened from a 1-D world mesh, each disabled axis (size 1, and ``efsdp`` without expert
    parallel) on torch's ``fake`` backend, as torchtitan does; ``loss_mesh`` flattened from
    ``batch`` and ``cp``.
    """
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    always = {"fsdp", "dp_shard"} | ({"efsdp"} if ep > 1 else set())

    def unflatten(names: tuple[str, ...], sizes: tuple[int, ...]) -> DeviceMesh:
        disabled = [
            name
            for name, size in zip(names, sizes, strict=True)
            if (size == 1 and name not in always) or (name == "efsdp" and ep == 1)
        ]
        fake: dict[str, Any] = dict.fromkeys(disabled, "fake")
        return world._unflatten(0, sizes, names, backend_override=fake)

    batch = dp_replicate * dp_shard
    sizes = {
        "dataloading": (pp, batch, cp, tp),
        "dense": (pp, dp_replicate, dp_shard, cp, tp),
        "fwdbwd": (pp, batch, cp, tp),
        "legacy": (pp, dp_replicate, dp_shard * cp, tp),
        "sparse": (pp, dp_replicate, dp_shard * cp * tp // ep, ep),
    }
    meshes = {name: unflatten(TITAN_DIMS[name], size) for name, size in sizes.items()}
    meshes["loss"] = meshes["dataloading"]["batch", "cp"]._flatten(TITAN_DIMS["loss"][0])
    return {name: meshes[name] for name in TITAN_DIMS}


def _line(mesh: DeviceMesh, axes: Sequence[str]) -> tuple[int, ...] | int:
    """The ranks of ``mesh`` that share this rank's coordinates off ``axes``, ``axes`` flattened in mesh order."""
    names = list(mesh.mesh_dim_names or ())
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    index = tuple(slice(None) if name in axes else c for name, c in zip(names, coordinate, strict=True))
    ranks = tuple(int(r) for r in mesh.mesh[index].reshape(-1).tolist())
    return ranks if len(ranks) > 1 else 1


def check_titan_mesh(mesh: DeviceMesh, spans: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """Convert ``mesh`` without ``names=``, compare every role with ``spans``, sum over every gang, round-trip.

    ``spans[role]`` lists the mesh dimensions the role's gang spans (absent: a size-1 gang). The
    round trip builds the mesh of every dimension, size-1 ones included, back from the gangs (by
    their roles; ``dp_replicate`` left out next to ``efsdp``, which spans it as ``edp``) and
    converts it again. ``new_groups`` lists the roles whose gang a second conversion of ``mesh``
    puts on another process group than the first (a new communicator each time).
    """
    gangs = from_device_mesh(mesh)
    twice = from_device_mesh(mesh)
    new_groups = [
        role
        for role in ROLES
        if isinstance(getattr(gangs, role), ProcessGroupGang)
        and getattr(twice, role).as_process_group() is not getattr(gangs, role).as_process_group()
    ]
    got = {role: members(getattr(gangs, role)) for role in ROLES}
    names = mesh.mesh_dim_names or ()
    expected = {role: _line(mesh, names if role == "root" else spans.get(role, ())) for role in ROLES}
    sums_ok = from_mesh_report(gangs)["sums"] == {
        role: float(sum(value)) if isinstance(value, tuple) else float(dist.get_rank()) for role, value in got.items()
    }
    roles = [_role_of(name) for name in names]
    dims = [role for role in roles if not (role == "rdp" and "edp" in roles)]
    again = to_device_mesh(gangs, dims)
    round_trip = {
        # Flattened: on a sparse mesh with `dp_replicate`, `edp` spans it and `efsdp` (one dimension).
        "same_mesh": again.mesh.reshape(-1).tolist() == mesh.mesh.reshape(-1).tolist(),
        "differ": [role for role in ROLES if members(getattr(from_device_mesh(again), role)) != got[role]],
        "names": again.mesh_dim_names == tuple(dims),
    }
    # A group of members that leave this process out is refused before any communication.
    others = [rank for rank in range(dist.get_world_size()) if rank != dist.get_rank()]
    try:
        members_group(others, "gang_mesh/refused")
        refused = ""
    except ValueError as ex:
        refused = str(ex)
    return {
        "got": got,
        "expected": expected,
        "sums_ok": sums_ok,
        "round_trip": round_trip,
        "new_groups": new_groups,
        "refused": refused,
    }


def _role_of(name: str) -> str:
    return ALIASES.get(name, name)


def titan_layouts(root: Gang, config: tuple[int, int, int, int, int, int], spans: Mapping[str, Any]) -> dict[str, Any]:
    """Every mesh of :func:`titan_meshes` for ``config``, checked by :func:`check_titan_mesh`."""
    meshes = titan_meshes(*config)
    return {name: check_titan_mesh(mesh, spans[name]) for name, mesh in meshes.items()}


def torchtitan_layouts(
    root: Gang, config: tuple[int, int, int, int, int, int], spans: Mapping[str, Any], backend: str = "spmd_types"
) -> Any:
    """torchtitan's own ``ParallelDims`` meshes (where torchtitan is installed), each checked.

    ``backend`` is torchtitan's ``spmd_backend`` (``"spmd_types"``, ``"full_dtensor"`` or
    ``"partial_dtensor"``), which decides the names of its dense mesh.

    Every global mesh is checked by :func:`check_titan_mesh` with the spans of the mirror mesh
    whose dimension names hold its own (:data:`TITAN_DIMS`); every 1-D mesh converts without ``names=``, its
    role's gang is the mesh's group and it round-trips.
    """
    import importlib

    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    # Not a static import: torchtitan is optional (and untyped).
    parallel_dims: Any = importlib.import_module("torchtitan.distributed.parallel_dims")
    parallel_dims.device_type = "cpu"  # torchtitan assumes CUDA when it finds no accelerator
    dp_replicate, dp_shard, cp, tp, pp, ep = config
    dims = parallel_dims.ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        cp=cp,
        tp=tp,
        pp=pp,
        ep=ep,
        world_size=dist.get_world_size(),
        spmd_backend=backend,
    )
    dims.build_mesh()
    report: dict[str, Any] = {}
    for name, mesh in dims._global_meshes.items():
        if ep == 1 and "efsdp" in (mesh.mesh_dim_names or ()):
            # Without expert parallel torchtitan builds `efsdp` (size dp_shard * cp * tp) on the
            # `fake` backend and never uses it: refused, as every `fake` dimension of size > 1.
            report[name] = _error_of(partial(from_device_mesh, mesh))
            continue
        mirror = next(m for m, names in TITAN_DIMS.items() if set(mesh.mesh_dim_names or ()) <= set(names))
        report[name] = check_titan_mesh(mesh, spans[mirror])
    for name, mesh in dims._single_axis_meshes.items():
        if ep == 1 and name == "efsdp":
            continue
        gangs = from_device_mesh(mesh)
        dim_name = (mesh.mesh_dim_names or ("",))[0]
        role = _role_of(dim_name)
        ok = True
        if mesh.size() > 1:
            ok = getattr(gangs, role).as_process_group() is mesh.get_group(0)
            ok = ok and to_device_mesh(gangs, (role,)).mesh.tolist() == mesh.mesh.tolist()
        report[f"1-D {name}"] = ok
    if ep > 1 and backend == "spmd_types":
        # torchtitan's experts always span the tensor parallel ranks: our etp_size=1 layout.
        ours = create_fsdp_gangs(
            create_parallel_gangs(root, tp_size=tp, pp_size=pp, cp_size=cp, ep_size=ep, etp_size=1), dp_shard
        )
        sparse = dims._global_meshes["sparse"]
        report["etp_1"] = {
            "ep": members(ours.ep) == _line(sparse, ("ep",)),
            "edp": members(ours.edp) == _line(sparse, ("dp_replicate", "efsdp")),
            "etp": ours.etp.size,
        }
    return report


def _error_of(call: Callable[[], object]) -> str:
    """The message of the ``ValueError`` that ``call`` raises (``""`` when it raises none)."""
    try:
        call()
    except ValueError as ex:
        return str(ex)
    return ""


# -- size-1 dimensions -------------------------------------------------------------------------------


def _alone(mesh: DeviceMesh, name: str) -> bool:
    """Whether the mesh's group along ``name`` holds this process alone, on torch's ``fake`` backend (on
    the default backend before torch 2.13, whose ``fake`` backend leaves some collectives' outputs untouched)."""
    group = mesh.get_group(name)
    backend = "fake" if torch.torch_version.TorchVersion(torch.__version__) >= "2.13" else dist.get_backend()
    return dist.get_process_group_ranks(group) == [dist.get_rank()] and dist.get_backend(group) == backend


def size_one_dims(root: Gang) -> dict[str, Any]:
    """Meshes with size-1 dimensions (``rdp`` of size 1: HSDP configured down to FSDP), and their round trips.

    Also a DTensor sharded over the size-1 and the real dimension, gathered back; and an
    ``init_device_mesh((1, N))`` mesh with torchtitan's names through ``from_device_mesh`` and back.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gangs = make_gangs(root)  # rdp of size 1, sdp = dp = root
    me = dist.get_rank()
    report: dict[str, Any] = {}
    mesh = to_device_mesh(gangs, ("rdp", "sdp"))
    report["hsdp"] = describe(mesh)
    report["hsdp_groups"] = [_alone(mesh, "rdp"), mesh.get_group("sdp") is gangs.sdp.as_process_group()]
    report["hsdp_local"] = [mesh.get_local_rank("rdp"), mesh.get_local_rank("sdp")]
    # Size-1 and flattened size-1 dimensions anywhere; the group of this process alone is made once.
    wide = to_device_mesh(gangs, ("pp", "rdp", ("cp", "tp"), "sdp"))
    report["wide"] = describe(wide)
    report["wide_alone"] = [_alone(wide, name) for name in ("pp", "rdp", "cp_tp")]
    report["one_group"] = wide.get_group("pp") is mesh.get_group("rdp")
    # DTensor on the size-1 dimension: a tensor sharded along both dimensions comes back whole.
    full = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    dt = distribute_tensor(full, mesh, [Shard(1), Shard(0)])
    report["dtensor_local"] = dt.to_local().tolist() == full[2 * me : 2 * me + 2].tolist()
    report["dtensor_full"] = dt.redistribute(mesh, [Replicate(), Replicate()]).to_local().tolist() == full.tolist()
    # Round trips: gangs of the mesh (size-1 dimensions become size-1 gangs), back to the same mesh.
    back = from_device_mesh(mesh)
    report["back"] = {role: members(getattr(back, role)) for role in ROLES}
    again = to_device_mesh(back, ("rdp", "sdp"))  # no layout: found by communicating
    report["again"] = describe(again)
    report["again_alone"] = _alone(again, "rdp")
    titan = init_device_mesh("cpu", (1, dist.get_world_size(), 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    from_titan = from_device_mesh(titan)
    report["titan"] = {role: members(getattr(from_titan, role)) for role in ROLES}
    report["titan_again"] = describe(to_device_mesh(from_titan, ("rdp", "sdp", "tp")))
    report["sums"] = from_mesh_report(from_titan)["sums"]
    return report
