"""Wrap the process groups of a :class:`~torch.distributed.device_mesh.DeviceMesh` as :class:`~gang.Gangs`."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from gang import FakeGang, Gang, Gangs, ProcessGroupGang
from gang.rendezvous import new_named_group, next_call

MESH_ROLES = ("dp", "rdp", "sdp", "tp", "pp")
"""The gang roles a mesh dimension can play."""

ALIASES: dict[str, str] = {"dp_replicate": "rdp", "dp_shard": "sdp"}
"""Mesh dimension names other libraries use (torchtitan) and the role each plays."""


def _digest(value: object) -> str:
    return hashlib.sha1(repr(value).encode(), usedforsecurity=False).hexdigest()[:16]


def from_device_mesh(mesh: DeviceMesh, *, names: Mapping[str, str] | None = None) -> Gangs:
    """Wrap the process groups of ``mesh`` as :class:`~gang.Gangs`.

    Dimensions named ``dp``, ``rdp``, ``sdp``, ``tp`` or ``pp`` become that gang; torchtitan's
    ``dp_replicate`` and ``dp_shard`` become ``rdp`` and ``sdp``; ``names`` maps any other
    dimension name to one of those roles. The returned gangs are:

    * ``root``: the default group when the mesh spans every process, the group of a 1-D mesh,
      otherwise a new group of the mesh's processes;
    * ``dp``: from a ``dp`` dimension, or derived from ``rdp`` and ``sdp``: the one of them that is
      given, or a new group of the processes that share this process's position on every other
      dimension when both are; ``rdp = dp`` and a size-1 ``sdp`` when only ``dp`` is given (as
      :func:`gang.create_parallel_gangs` does);
    * every other role absent from the mesh: a size-1 :class:`~gang.FakeGang`.

    No group is created when an existing one has the same members. The groups it does create
    are made by their members alone, under names derived from the mesh (so members agree on them
    whatever other groups each has), and are released with the default group; closing the
    returned gangs does not destroy any group. Every process of the mesh must call it with the
    same arguments.

    :param mesh: A mesh whose dimensions have names (``init_device_mesh(...,
        mesh_dim_names=...)``, :func:`~gang_mesh.to_device_mesh`) and that holds this process.
    :param names: Maps mesh dimension names to roles, e.g. ``{"fsdp": "sdp"}``.
    :returns: Gangs on ``mesh.device_type`` (the current CUDA device for ``cuda``).
    :raises TypeError: If ``mesh`` is not a ``DeviceMesh`` or ``names`` not a mapping of ``str``.
    :raises ValueError: If the mesh has no dimension names, a dimension has no role, two dimensions
        play the same role, ``dp`` comes with ``rdp`` or ``sdp``, ``names`` holds a key that is not a
        dimension or a value that is not a role, or this process is not in the mesh.
    """
    roles = _check_mesh(mesh, names)
    device = _mesh_device(mesh)
    layout = (tuple(roles), tuple(mesh.mesh.shape), *mesh.mesh.flatten().tolist())
    signature = "gang_mesh/" + _digest(layout)
    call = next_call(signature)  # how often this process converted this mesh: part of the group names

    # Every mesh group becomes a gang; equal member lists share one gang.
    wrapped: dict[tuple[int, ...], Gang] = {}

    def wrap(pg: ProcessGroup) -> Gang:
        ranks = tuple(dist.get_process_group_ranks(pg))
        if ranks not in wrapped:
            wrapped[ranks] = ProcessGroupGang.from_process_group(pg, device)
        return wrapped[ranks]

    def group_of(ranks: list[int]) -> Gang:
        key = tuple(sorted(ranks))
        if key not in wrapped:
            # Named after the mesh, this call and the members, so every member agrees on the name
            # whatever other groups it has (see `gang.rendezvous.new_named_group`).
            pg = new_named_group(list(key), f"{signature}/{call}/{_digest(key)}", None)
            if not isinstance(pg, ProcessGroup):  # Cannot happen: this process is a member.
                raise AssertionError(f"rank {dist.get_rank()} is not in the new group {list(key)}")
            wrapped[key] = ProcessGroupGang.from_process_group(pg, device)
        return wrapped[key]

    by_role: dict[str, Gang] = {role: wrap(mesh.get_group(i)) for i, role in enumerate(roles)}

    all_ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if len(all_ranks) == dist.get_world_size():
        world = dist.group.WORLD
        if not isinstance(world, ProcessGroup):
            raise AssertionError("the default process group is not initialised")
        root = wrap(world)
    else:
        root = group_of(all_ranks)

    dp: Gang
    rdp: Gang
    sdp: Gang
    if "dp" in by_role:
        dp = by_role["dp"]
        rdp, sdp = dp, FakeGang(device)
    elif "rdp" in by_role and "sdp" in by_role:
        rdp, sdp = by_role["rdp"], by_role["sdp"]
        dp = group_of(_line(mesh, [roles.index("rdp"), roles.index("sdp")]))
    elif "rdp" in by_role:
        dp = rdp = by_role["rdp"]
        sdp = FakeGang(device)
    elif "sdp" in by_role:
        dp = sdp = by_role["sdp"]
        rdp = FakeGang(device)
    else:
        dp = rdp = FakeGang(device)
        sdp = FakeGang(device)
    tp = by_role.get("tp") or FakeGang(device)
    pp = by_role.get("pp") or FakeGang(device)
    return Gangs(root=root, dp=dp, rdp=rdp, sdp=sdp, tp=tp, pp=pp)


def _check_mesh(mesh: DeviceMesh, names: Mapping[str, str] | None) -> list[str]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"`mesh` must be a `DeviceMesh`, but is of type `{type(mesh).__name__}` instead.")
    if names is None:
        names = {}
    if not isinstance(names, Mapping):
        raise TypeError(f"`names` must be a mapping of mesh dimension names to roles, but is {names!r} instead.")
    for key, value in names.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"`names` must map `str` to `str`, but maps {key!r} to {value!r} instead.")
    dim_names = mesh.mesh_dim_names
    if dim_names is None:
        raise ValueError(
            "`mesh` must have dimension names (pass `mesh_dim_names` when creating it), but has none instead."
        )
    for key, value in names.items():
        if key not in dim_names:
            raise ValueError(
                f"`names` must only map dimensions of `mesh` {tuple(dim_names)}, but maps {key!r} instead."
            )
        if value not in MESH_ROLES:
            raise ValueError(f"`names` must map to roles {MESH_ROLES}, but maps {key!r} to {value!r} instead.")
    roles: list[str] = []
    for name in dim_names:
        role = names.get(name) or (name if name in MESH_ROLES else ALIASES.get(name))
        if role is None:
            raise ValueError(
                f"`mesh` dimension names must be roles {MESH_ROLES} or {tuple(ALIASES)}, or be mapped by "
                f"`names`, but {name!r} of {tuple(dim_names)} is none of these instead."
            )
        if role in roles:
            raise ValueError(
                f"`mesh` dimensions must play distinct roles, but {name!r} and "
                f"{dim_names[roles.index(role)]!r} of {tuple(dim_names)} both play {role!r} instead."
            )
        roles.append(role)
    if "dp" in roles and ("rdp" in roles or "sdp" in roles):
        raise ValueError(
            f"`mesh` must not have a `dp` dimension together with `rdp` or `sdp` (dp is their product), "
            f"but its dimensions {tuple(dim_names)} play {tuple(roles)} instead."
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"`mesh` must hold this process (rank {dist.get_rank()}), but is {mesh.mesh.tolist()}.")
    return roles


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _line(mesh: DeviceMesh, dims: list[int]) -> list[int]:
    """The ranks of ``mesh`` that share this process's position on every dimension except ``dims``."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coordinate))
    return [int(r) for r in mesh.mesh[index].flatten().tolist()]
