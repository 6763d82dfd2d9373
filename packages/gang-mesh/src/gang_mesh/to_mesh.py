"""Build a :class:`~torch.distributed.device_mesh.DeviceMesh` from the process groups of :class:`~gang.Gangs`."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from gang import Gang, Gangs, ReduceOperation
from gang._torch_groups import as_mesh_subclass
from gang.extend import check_values_exchangeable
from gang.rendezvous import alone_group
from gang.roles import alias
from gang.topology import Grid, MeshDim, mesh_dims

Dim = MeshDim
"""An entry of ``dims``: a role, or a tuple of dense roles spanned at once (a flattened dimension)."""


def to_device_mesh(gangs: Gangs, dims: Sequence[Dim]) -> DeviceMesh:
    """Return a ``DeviceMesh`` whose dimension *i* is the gang ``gangs.<dims[i]>``.

    An entry of ``dims`` may also be a tuple of dense roles, a flattened dimension: its gang is
    ``gangs.flatten(*roles)`` and its name joins the roles with ``_`` (``("rdp", ("sdp", "cp"))``
    gives ``mesh_dim_names == ("rdp", "sdp_cp")``).

    The mesh reuses the gangs' own process groups (``mesh.get_group(name)`` *is* the gang's
    ``as_process_group()``); no communicator is created (a flattened dimension's gang is created by
    :meth:`~gang.Gangs.flatten` once and cached there). A size-1 gang is a size-1 dimension, as
    ``init_device_mesh((1, 8))`` gives and torchtitan builds every disabled axis: HSDP configured
    down to FSDP (``("rdp", "sdp")`` with an ``rdp`` of size 1) needs no special case. Its group
    holds this process alone, on torch's ``fake`` backend (for one member every collective is the
    identity, which that backend computes), made once per process without communicating: it costs
    no communicator, and :func:`~gang_mesh.from_device_mesh` turns it back into a size-1 gang.

    The mesh holds global ranks, laid out so that the slice along dimension *i* through this
    process lists the members of that gang in gang rank order. Processes outside this process's
    grid (another pipeline stage, say) get the mesh of their own grid, as a sliced
    ``init_device_mesh`` would.

    Cost: gangs made by the factories know their :attr:`~gang.Gangs.layout`, and the mesh is
    computed from it with no communication (so it works in :func:`gang.testing.dry_run`). For
    gangs of unknown layout (from :func:`~gang_mesh.from_device_mesh`, say) each process finds the
    smallest rank of its grid (one one-integer all-reduce per dimension) and gathers over
    ``gangs.root`` every process's grid and coordinates, ``len(dims) + 2`` integers per process;
    each checks the lines through itself against its gangs, and one more all-reduce makes every
    process raise the same error if the gangs do not form a grid.

    Every process of ``gangs.root`` must call it with the same ``dims``. ``gangs.root`` need not
    span every process: gangs from :func:`~gang_mesh.from_device_mesh` on a sub-mesh give back
    that sub-mesh.

    :param gangs: The gangs of this process.
    :param dims: Names of fields of :class:`~gang.Gangs` (``root``, ``dp``, ``rdp``, ``sdp``, ``cp``,
        ``tp``, ``pp``, ``ep``, ``edp``, ``etp``) or tuples of dense roles, outermost first; for example
        ``("rdp", "sdp", "tp")`` or ``("rdp", ("sdp", "cp"))``.
    :returns: A :class:`GangDeviceMesh` with those ``mesh_dim_names`` on ``gangs.root.device``'s
        type: equal only to meshes over the same process groups, so DTensor's caches never mix it up
        with another mesh of the same ranks and names (torchtitan's, say).
    :raises TypeError: If ``gangs`` is not a :class:`~gang.Gangs` or ``dims`` not a sequence of
        names and tuples of names.
    :raises ValueError: If ``dims`` is empty, names an unknown role or a name twice, flattens roles
        that overlap or are not dense, names dimensions that share a grid axis (such as
        ``("dp", "rdp")``), names a gang of size greater than 1 without a process group, or names
        gangs that do not form a grid, or if ``gangs.root`` has no torch process group.
    :raises NotSupportedError: In a dry run, for gangs of unknown layout (finding it needs values
        from the other processes).
    """
    names, per_dim = _check_dims(gangs, dims)
    # A size-1 dimension (a size-1 gang) gets a group of this process alone that costs nothing.
    dim_gangs = [
        None if _size(gangs, roles) == 1 else gangs.flatten(*roles) if len(roles) > 1 else getattr(gangs, roles[0])
        for roles in per_dim
    ]
    groups = [alone_group() if gang is None else gang.as_process_group() for gang in dim_gangs]
    layout = gangs.layout
    if layout is not None:
        root_ranks = layout.submesh(gangs.root.rank, per_dim)
        if layout.global_ranks is not None:  # one vectorised lookup, not a Python loop over the mesh
            root_ranks = np.asarray(layout.global_ranks, dtype=np.int64)[root_ranks]
        ranks = torch.from_numpy(root_ranks)
    else:
        ranks = _gathered_mesh(gangs.root, dim_gangs, groups, names)
    mesh = DeviceMesh.from_group(groups, gangs.root.device.type, mesh=ranks.to(torch.int), mesh_dim_names=names)
    return GangDeviceMesh.wrap(mesh)


def _size(gangs: Gangs, roles: tuple[str, ...]) -> int:
    return prod(getattr(gangs, name).size for name in roles)


def _gathered_mesh(
    root: Gang, dim_gangs: Sequence[Gang | None], groups: Sequence[ProcessGroup], names: tuple[str, ...]
) -> torch.Tensor:
    """The global ranks of this process's grid, from every process's coordinates (gangs without a layout).

    ``dim_gangs[i]`` is ``None`` for a size-1 dimension (coordinate 0, this process alone).
    """
    check_values_exchangeable(root, "to_device_mesh (of gangs without a layout)")
    device = root.device
    me = dist.get_rank()
    # The smallest global rank of this process's grid: the minimum along each dimension in turn.
    smallest = torch.tensor([me], dtype=torch.int64, device=device)
    for gang in dim_gangs:
        if gang is not None:
            gang.all_reduce(smallest, ReduceOperation.MIN)
    coordinates = (0 if gang is None else gang.rank for gang in dim_gangs)
    row = torch.tensor([me, int(smallest.item()), *coordinates], dtype=torch.int64)
    table = torch.empty((root.size, row.numel()), dtype=torch.int64, device=device)
    root.all_gather(table, row.to(device))
    rows = table.cpu()
    mine = rows[rows[:, 1] == int(smallest.item())].numpy()
    grid = Grid(tuple((name, 1 if gang is None else gang.size) for name, gang in zip(names, dim_gangs, strict=True)))
    problem = ""
    ranks = np.empty(grid.shape, dtype=np.int64)
    try:
        ranks = grid.place(mine[:, 2:], mine[:, 0])
    except ValueError as ex:
        problem = f"in the grid of rank {me}, {ex}"
    else:
        here = grid.rank(dict(zip(names, (int(c) for c in mine[mine[:, 0] == me][0, 2:]), strict=True)))
        for name, group in zip(names, groups, strict=True):
            line = ranks.reshape(-1)[grid.group_of(here, name)].tolist()
            members = dist.get_process_group_ranks(group)
            if line != members:
                problem = f"the line along {name!r} through rank {me} is {line}, but its gang is {members}"
                break
    # Every process raises the same error: the first one (by global rank) that found a problem.
    first = torch.tensor([me if problem else _NO_PROBLEM], dtype=torch.int64, device=device)
    root.all_reduce(first, ReduceOperation.MIN)
    culprit = int(first.item())
    if culprit != _NO_PROBLEM:
        detail = f": {problem}" if culprit == me else f" (see the error on rank {culprit})"
        raise ValueError(
            f"`dims` must name gangs that form a grid, but the gangs along {names} of rank {culprit} do not "
            f"instead{detail}."
        )
    return torch.from_numpy(ranks)


_NO_PROBLEM = 2**62


class GangDeviceMesh(DeviceMesh):
    """A ``DeviceMesh`` that equals only meshes over the same process groups (what :func:`to_device_mesh` returns).

    torch's ``DeviceMesh.__eq__`` and ``__hash__`` look at the ranks, the layout, the device type
    and the dimension names, never at the process groups. DTensor's sharding propagation caches
    its results (the C++ dispatch cache behind ``ShardingPropagator.propagate_op_sharding``) keyed
    by the input specs, meshes included, and hands back output specs that hold the mesh of the
    *first* call. So with two meshes of the same ranks and names in one process (a gang mesh and
    torchtitan's, say), a DTensor op on the second returns tensors on the first, and the next
    redistribution (tensor parallel's all-reduce, an all-gather) runs on the first mesh's groups.

    This subclass adds the names of its process groups to equality and hashing, so it is never
    equal to a mesh over other groups and those caches keep the two apart; a mesh sliced from it
    (``mesh["tp"]``) is one too. Meshes that torch derives in other ways (its private
    ``_flatten``) are plain ``DeviceMesh`` objects: name flattened dimensions in
    :func:`to_device_mesh`'s ``dims`` instead.
    """

    @classmethod
    def wrap(cls, mesh: DeviceMesh) -> GangDeviceMesh:
        """Make ``mesh`` (a plain ``DeviceMesh``) a :class:`GangDeviceMesh` in place and return it.

        :raises NotSupportedError: Where torch's ``DeviceMesh`` no longer takes a new class in place
            (see :func:`gang._torch_groups.as_mesh_subclass`).
        """
        return as_mesh_subclass(mesh, cls)

    def group_names(self) -> tuple[str, ...]:
        """The names of the process groups of the mesh's dimensions, in order."""
        names: tuple[str, ...] | None = self.__dict__.get("_gang_group_names")
        if names is None:
            names = tuple(self.get_group(axis).group_name for axis in range(self.ndim))
            self.__dict__["_gang_group_names"] = names
        return names

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, GangDeviceMesh):
            return False
        return bool(DeviceMesh.__eq__(self, other)) and self.group_names() == other.group_names()

    def __hash__(self) -> int:
        return hash((DeviceMesh.__hash__(self), self.group_names()))  # type: ignore[no-untyped-call]

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        return GangDeviceMesh.wrap(DeviceMesh.__getitem__(self, mesh_dim_names))


def fsdp_mesh(gangs: Gangs) -> DeviceMesh:
    """Return the mesh that ``fully_shard`` wants for ``gangs``.

    A 1-D ``("sdp",)`` mesh (plain FSDP) when ``gangs.rdp.size == 1``, else the 2-D
    ``("rdp", "sdp")`` mesh (HSDP: replicate over ``rdp``, shard over ``sdp``). With context
    parallel (``gangs.cp.size > 1``) the shard dimension is ``sdp`` and ``cp`` flattened, named
    ``"sdp_cp"`` (FSDP shards over both, as torchtitan does). Every process of ``gangs.root``
    must call it.

    :param gangs: Gangs from :func:`gang.create_fsdp_gangs` (or equivalent).
    :raises TypeError: If ``gangs`` is not a :class:`~gang.Gangs`.
    :raises ValueError: If nothing is sharded (``sdp`` has no process group and ``cp`` size 1), or as
        :func:`to_device_mesh`.
    """
    if not isinstance(gangs, Gangs):
        raise TypeError(f"`gangs` must be a `Gangs`, but is of type `{type(gangs).__name__}` instead.")
    sharded, folded = _SHARD.role, cast(str, _SHARD.folds)
    shard: Dim = (sharded, folded) if gangs.cp.size > 1 else sharded
    if gangs.cp.size == 1 and not gangs.sdp.supports_process_group:
        raise ValueError(
            f"`gangs.sdp` must have a process group for `fsdp_mesh`, but is {gangs.sdp!r} instead "
            "(with an sdp size of 1 nothing is sharded; use DDP over `gangs.rdp`)."
        )
    if gangs.rdp.size == 1:
        return to_device_mesh(gangs, (shard,))
    return to_device_mesh(gangs, (_REPLICATE, shard))


_SHARD = alias("dp_shard_cp")
"""torchtitan's dimension that FSDP shards over: ``sdp`` with ``cp`` folded in (:data:`gang.roles.ALIASES`)."""

_REPLICATE = alias("dp_replicate").role
"""The role of torchtitan's dimension that HSDP replicates over, ``rdp``."""


def _check_dims(gangs: Gangs, dims: Sequence[Dim]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The mesh dimension names and each dimension's roles; every check that needs no communication."""
    if not isinstance(gangs, Gangs):
        raise TypeError(f"`gangs` must be a `Gangs`, but is of type `{type(gangs).__name__}` instead.")
    names, per_dim = mesh_dims(dims)
    for axis, roles in enumerate(per_dim):
        gang: Gang = getattr(gangs, roles[0])
        if _size(gangs, roles) > 1 and not (gang if len(roles) == 1 else gangs.root).supports_process_group:
            shown = roles[0] if len(roles) == 1 else roles
            raise ValueError(
                f"`dims` must name gangs that have a process group, but `dims[{axis}]` is {shown!r} and "
                f"its gang is {gang!r} instead."
            )
    if not gangs.root.supports_process_group:
        raise ValueError(
            f"`gangs.root` must have a torch process group (a mesh lives in torch's default group), but is "
            f"{gangs.root!r} instead."
        )
    if gangs.root.device.type == "meta":
        raise ValueError("`gangs.root.device` must be a real device, but is `meta` instead.")
    return names, per_dim
