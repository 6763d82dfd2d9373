"""Wrap the process groups of a :class:`~torch.distributed.device_mesh.DeviceMesh` as :class:`~gang.Gangs`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from gang import FakeGang, Gang, Gangs, ProcessGroupGang
from gang.rendezvous import members_group
from gang.topology import MESH_ALIASES, Grid, mesh_roles, mesh_spans

ALIASES: dict[str, str] = MESH_ALIASES
"""Mesh dimension names other libraries use (torchtitan, Megatron-Core) and the role each plays
(from :data:`gang.roles.ALIASES`, through :data:`gang.topology.MESH_ALIASES`)."""


def from_device_mesh(mesh: DeviceMesh, *, names: Mapping[str, str] | None = None) -> Gangs:
    """Wrap the process groups of ``mesh`` as :class:`~gang.Gangs`.

    Dimensions named ``dp``, ``rdp``, ``sdp``, ``cp``, ``tp``, ``pp``, ``ep``, ``edp`` or ``etp``
    become that gang; the names other libraries use (:data:`ALIASES`, from :data:`gang.roles.ALIASES`) are
    understood: torchtitan's ``dp_replicate`` (``rdp``), ``dp_shard`` (``sdp``), ``efsdp``
    (``edp``), ``batch`` (``dp``) and its flattened dimensions, which count as their data
    parallel role with context parallel folded in (``fsdp`` and ``dp_shard_cp`` as ``sdp``,
    ``loss``, ``loss_mesh`` and ``dp_cp`` as ``dp``; ``cp`` then has size 1). ``names`` maps
    any other dimension name to a role. This covers every mesh of torchtitan's ``ParallelDims``,
    dense and sparse. The returned gangs are:

    * ``root``: the group of a 1-D mesh (or of the one dimension that spans the whole mesh when
      the others have size 1), else the default group when the mesh spans every process,
      otherwise a new group of the mesh's processes (a sub-mesh: one pipeline stage, or a mesh
      with an axis sliced out);
    * ``dp``: from a ``dp`` dimension, or derived from ``rdp`` and ``sdp``: the one of them that is
      given, or a new group of the processes that share this process's position on every other
      dimension when both are; ``rdp = dp`` and a size-1 ``sdp`` when only ``dp`` is given (as
      :func:`gang.create_parallel_gangs` does). These rules are :func:`gang.topology.role_spans`;
    * ``ep``, ``edp`` and ``etp``: a mesh without expert dimensions gets a size-1 ``ep``, ``edp``
      spanning ``dp`` and ``cp``, and ``etp`` equal to ``tp``. On an expert (sparse) mesh, such as torchtitan's
      ``("pp", "dp_replicate", "efsdp", "ep")``, ``ep`` is its dimension, ``edp`` spans every
      data parallel dimension but ``ep`` (``dp_replicate`` and ``efsdp``: the processes that hold
      the same experts), and the data parallel gangs are what the mesh can say: ``dp`` spans
      ``rdp``, ``edp`` and ``ep``, ``sdp`` spans ``edp`` and ``ep``, and ``tp`` and ``etp`` are one
      dimension (an ``etp`` dimension is ``tp`` too); ``cp`` and ``sdp`` dimensions, and ``tp``
      next to ``etp``, cannot be on such a mesh;
    * every other role absent from the mesh, and every dimension of size 1: a size-1
      :class:`~gang.FakeGang`. torchtitan builds its disabled axes (size 1) on torch's ``fake``
      backend; those are fine, a ``fake`` dimension of size greater than 1 is refused.

    No group is created when the mesh or the default group has one with the same members, or an
    earlier conversion (of this mesh or any other) created one: converting a mesh again creates nothing. The
    groups it does create are made by their members alone, under names derived from the members
    (so members agree on them whatever other groups each has), and are released with the default
    group; closing the returned gangs does not destroy any group. Every process of the mesh must call it with the
    same arguments.

    :param mesh: A mesh whose dimensions have names (``init_device_mesh(...,
        mesh_dim_names=...)``, :func:`~gang_mesh.to_device_mesh`) and that holds this process.
    :param names: Maps mesh dimension names to roles, e.g. ``{"shard": "sdp"}``.
    :returns: Gangs on ``mesh.device_type`` (the current CUDA device for ``cuda``), without a layout.
    :raises TypeError: If ``mesh`` is not a ``DeviceMesh`` or ``names`` not a mapping of ``str``.
    :raises ValueError: If the mesh has no dimension names, a dimension has no role, two dimensions
        play the same role, ``dp`` comes with ``rdp`` or ``sdp``, a dimension with context
        parallel folded in comes with ``cp``, an expert role comes with ``dp``, ``sdp`` or ``cp``
        (or ``etp`` with ``tp``),
        ``names`` holds a key that is not a dimension or a value that is not a role, this process
        is not in the mesh, or a dimension of size greater than 1 has its group on torch's
        ``fake`` backend (which computes nothing).
    """
    roles = _check_mesh(mesh, names)
    spans = mesh_spans(roles, mesh.mesh_dim_names or ())
    device = _mesh_device(mesh)
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
            # Made by its members alone, once: converting this mesh (or another that needs the
            # same members) again gets the same group (see `gang.rendezvous.members_group`).
            wrapped[key] = ProcessGroupGang.from_process_group(members_group(key, "gang_mesh"), device)
        return wrapped[key]

    # The mesh's own groups first, so the roles of its axes get exactly those groups. Axes of size
    # 1 (torchtitan builds its disabled ones on the `fake` backend) make size-1 gangs.
    for axis in range(mesh.ndim):
        if mesh.size(axis) > 1:
            wrap(mesh.get_group(axis))
    size_one = FakeGang(device)

    def gang_of(span: tuple[str, ...]) -> Gang:
        span = tuple(name for name in span if grid.shape[roles.index(name)] > 1)
        if not span:
            return size_one
        if len(span) == 1:
            return wrap(mesh.get_group(roles.index(span[0])))
        return group_of([ranks[p] for p in grid.group_of(here, *span)])

    return Gangs(**{role: gang_of(span) for role, span in spans.items()}, layout=None)


def _check_mesh(mesh: DeviceMesh, names: Mapping[str, str] | None) -> list[str]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"`mesh` must be a `DeviceMesh`, but is of type `{type(mesh).__name__}` instead.")
    dim_names = mesh.mesh_dim_names
    if dim_names is None:
        raise ValueError(
            "`mesh` must have dimension names (pass `mesh_dim_names` when creating it), but has none instead."
        )
    roles = mesh_roles(dim_names, names)
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"`mesh` must hold this process (rank {dist.get_rank()}), but is {mesh.mesh.tolist()} instead."
        )
    for axis, name in enumerate(dim_names):
        if mesh.size(axis) > 1 and dist.get_backend(mesh.get_group(axis)) == "fake":
            raise ValueError(
                f"`mesh` dimension {name!r} must have a process group that communicates, but its group is on "
                f"torch's `fake` backend with {mesh.size(axis)} ranks instead (its collectives would silently compute "
                "nothing; only size-1 dimensions may be `fake`)."
            )
    return roles


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
