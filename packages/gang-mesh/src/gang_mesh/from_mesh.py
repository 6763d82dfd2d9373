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
from gang.roles import DENSE_ROLES
from gang.topology import Grid, role_spans

MESH_ROLES = DENSE_ROLES
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

    * ``root``: the group of a 1-D mesh (or of the one dimension that spans the whole mesh when
      the others have size 1), else the default group when the mesh spans every process,
      otherwise a new group of the mesh's processes (a sub-mesh: one pipeline stage, or a mesh
      with an axis sliced out);
    * ``dp``: from a ``dp`` dimension, or derived from ``rdp`` and ``sdp``: the one of them that is
      given, or a new group of the processes that share this process's position on every other
      dimension when both are; ``rdp = dp`` and a size-1 ``sdp`` when only ``dp`` is given (as
      :func:`gang.create_parallel_gangs` does). These rules are
      :func:`gang.topology.role_spans`;
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
        dimension or a value that is not a role, this process is not in the mesh, or a dimension's
        group is on torch's ``fake`` backend (which computes nothing).
    """
    roles = _check_mesh(mesh, names)
    spans = _role_spans(mesh, roles)
    device = _mesh_device(mesh)
    layout = (tuple(roles), tuple(mesh.mesh.shape), *mesh.mesh.flatten().tolist())
    signature = "gang_mesh/" + _digest(layout)
    call = next_call(signature)  # how often this process converted this mesh: part of the group names

    # The mesh as a grid whose dimensions are the roles of its axes; `ranks[i]` is at grid rank i.
    grid = Grid(tuple(zip(roles, (int(size) for size in mesh.mesh.shape), strict=True)))
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    here = ranks.index(dist.get_rank())

    # Every mesh group becomes a gang; equal member lists share one gang.
    wrapped: dict[tuple[int, ...], Gang] = {}

    def wrap(pg: ProcessGroup) -> Gang:
        members = tuple(dist.get_process_group_ranks(pg))
        if members not in wrapped:
            wrapped[members] = ProcessGroupGang.from_process_group(pg, device)
        return wrapped[members]

    def group_of(members: list[int]) -> Gang:
        key = tuple(sorted(members))
        if key not in wrapped and len(key) == dist.get_world_size():
            world = dist.group.WORLD
            if not isinstance(world, ProcessGroup):
                raise AssertionError("the default process group is not initialised")
            wrap(world)
        if key not in wrapped:
            # Named after the mesh, this call and the members, so every member agrees on the name
            # whatever other groups it has (see `gang.rendezvous.new_named_group`).
            pg = new_named_group(list(key), f"{signature}/{call}/{_digest(key)}", None)
            if not isinstance(pg, ProcessGroup):  # Cannot happen: this process is a member.
                raise AssertionError(f"rank {dist.get_rank()} is not in the new group {list(key)}")
            wrapped[key] = ProcessGroupGang.from_process_group(pg, device)
        return wrapped[key]

    # The mesh's own groups first, so the roles of its axes get exactly those groups.
    for axis in range(mesh.ndim):
        wrap(mesh.get_group(axis))
    size_one = FakeGang(device)

    def gang_of(span: tuple[str, ...]) -> Gang:
        if not span:
            return size_one
        if len(span) == 1:
            return wrap(mesh.get_group(roles.index(span[0])))
        return group_of([ranks[p] for p in grid.group_of(here, *span)])

    return Gangs(**{role: gang_of(span) for role, span in spans.items()}, layout=None)


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
                f"`names` must only map dimensions of `mesh` {tuple(dim_names)}, but maps {key!r} (to {value!r}) "
                "instead."
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
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"`mesh` must hold this process (rank {dist.get_rank()}), but is {mesh.mesh.tolist()} instead."
        )
    for axis, name in enumerate(dim_names):
        if dist.get_backend(mesh.get_group(axis)) == "fake":
            raise ValueError(
                f"`mesh` dimension {name!r} must have a process group that communicates, but its group is on "
                "torch's `fake` backend instead (its collectives would silently compute nothing)."
            )
    return roles


def _role_spans(mesh: DeviceMesh, roles: list[str]) -> dict[str, tuple[str, ...]]:
    """Which axes, by role, make up each gang; the data parallel rules are `gang.topology.role_spans`'."""
    try:
        return role_spans(roles)
    except ValueError as ex:
        raise ValueError(
            f"`mesh` must have dimensions whose roles fit together, but its dimensions {mesh.mesh_dim_names} "
            f"play {tuple(roles)} instead: {ex}"
        ) from None


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
