"""Build a :class:`~torch.distributed.device_mesh.DeviceMesh` from the process groups of :class:`~gang.Gangs`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gang import Gang, Gangs, all_gather_objects

ROLES = ("root", "dp", "rdp", "sdp", "tp", "pp")
"""The fields of :class:`~gang.Gangs` that :func:`to_device_mesh` accepts as dimension names."""


def to_device_mesh(gangs: Gangs, dims: Sequence[str]) -> DeviceMesh:
    """Return a ``DeviceMesh`` whose dimension *i* is the gang ``gangs.<dims[i]>``.

    The mesh reuses the gangs' own process groups (``mesh.get_group(dims[i])`` *is*
    ``getattr(gangs, dims[i]).as_process_group()``); no communicator is created. It holds global
    ranks, laid out so that the slice along dimension *i* through this process lists the members
    of ``gangs.<dims[i]>`` in gang rank order. Processes outside this process's grid (another
    pipeline stage, say) get the mesh of their own grid, as a sliced ``init_device_mesh`` would.

    Every process of ``gangs.root`` must call it with the same ``dims``: the member lists are
    exchanged over ``gangs.root`` (after the arguments were checked) so that every process checks
    the whole layout and all raise the same error if the gangs do not form a grid.

    :param gangs: The gangs of this process.
    :param dims: Names of fields of :class:`~gang.Gangs` (``root``, ``dp``, ``rdp``, ``sdp``, ``tp``,
        ``pp``), outermost first; for example ``("rdp", "sdp", "tp")``.
    :returns: A mesh with ``mesh_dim_names == tuple(dims)`` on ``gangs.root.device``'s type.
    :raises TypeError: If ``gangs`` is not a :class:`~gang.Gangs` or ``dims`` not a sequence of ``str``.
    :raises ValueError: If ``dims`` is empty, names an unknown field or a field twice, names a gang
        without a process group (such as a size-1 :class:`~gang.FakeGang`), or names gangs that do
        not form a grid (for example ``("dp", "rdp")``).
    """
    names = _check_dims(gangs, dims)
    chosen = [getattr(gangs, name) for name in names]
    groups = [gang.as_process_group() for gang in chosen]
    mine = tuple(tuple(dist.get_process_group_ranks(group)) for group in groups)
    everyone = all_gather_objects(gangs.root, mine)
    mesh = _build_grid(names, everyone, dist.get_rank())
    return DeviceMesh.from_group(groups, gangs.root.device.type, mesh=mesh, mesh_dim_names=names)


def fsdp_mesh(gangs: Gangs) -> DeviceMesh:
    """Return the mesh that ``fully_shard`` wants for ``gangs``.

    A 1-D ``("sdp",)`` mesh (plain FSDP) when ``gangs.rdp.size == 1``, else the 2-D
    ``("rdp", "sdp")`` mesh (HSDP: replicate over ``rdp``, shard over ``sdp``). Every process of
    ``gangs.root`` must call it.

    :param gangs: Gangs from :func:`gang.create_fsdp_gangs` (or equivalent).
    :raises TypeError: If ``gangs`` is not a :class:`~gang.Gangs`.
    :raises ValueError: If ``gangs.sdp`` has no process group (size 1), or as :func:`to_device_mesh`.
    """
    if not isinstance(gangs, Gangs):
        raise TypeError(f"`gangs` must be a `Gangs`, but is of type `{type(gangs).__name__}` instead.")
    if not gangs.sdp.supports_process_group:
        raise ValueError(
            f"`gangs.sdp` must have a process group for `fsdp_mesh`, but is {gangs.sdp!r} instead "
            "(with an sdp size of 1 nothing is sharded; use DDP over `gangs.rdp`)."
        )
    if gangs.rdp.size == 1:
        return to_device_mesh(gangs, ("sdp",))
    return to_device_mesh(gangs, ("rdp", "sdp"))


def _check_dims(gangs: Gangs, dims: Sequence[str]) -> tuple[str, ...]:
    if not isinstance(gangs, Gangs):
        raise TypeError(f"`gangs` must be a `Gangs`, but is of type `{type(gangs).__name__}` instead.")
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
        raise TypeError(f"`dims` must be a sequence of gang names such as ('sdp',), but is {dims!r} instead.")
    for name in dims:
        if not isinstance(name, str):
            raise TypeError(f"`dims` must contain only `str` names, but contains {name!r} instead.")
    names = tuple(dims)
    if not names:
        raise ValueError("`dims` must name at least one gang, but is empty instead.")
    for name in names:
        if name not in ROLES:
            raise ValueError(
                f"`dims` must contain only names of `Gangs` fields {ROLES}, but contains {name!r} instead."
            )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"`dims` must not repeat a name, but repeats {repeated} in {names} instead.")
    for i, name in enumerate(names):
        gang: Gang = getattr(gangs, name)
        if not gang.supports_process_group:
            raise ValueError(
                f"`dims` must name gangs that have a process group, but `dims[{i}]` is {name!r} and "
                f"`gangs.{name}` is {gang!r} instead (a size-1 gang has no process group; leave it out of the mesh)."
            )
    if gangs.root.device.type == "meta":
        raise ValueError("`gangs.root.device` must be a real device, but is `meta` instead.")
    return names


def _build_grid(names: tuple[str, ...], everyone: list[tuple[tuple[int, ...], ...]], me: int) -> torch.Tensor:
    """Lay out the grid that holds ``me``, after checking that every process's gangs form grids.

    ``everyone[r][i]`` lists the global ranks of process ``r``'s gang ``names[i]``. Every process
    runs this on the same data, so every process reaches the same verdict.
    """
    world = len(everyone)
    ndim = len(names)
    # A process's coordinate along dimension i is its rank in its gang of that dimension.
    coords: list[tuple[int, ...]] = []
    for r, lists in enumerate(everyone):
        coord = []
        for i, group in enumerate(lists):
            if r not in group:
                raise ValueError(
                    f"`dims` must name gangs that hold their own process, but `gangs.{names[i]}` of rank {r} "
                    f"is {list(group)}, which does not hold rank {r}."
                )
            coord.append(group.index(r))
        coords.append(tuple(coord))

    # Group the processes into grids: rank r's grid is every rank reachable through gang members.
    grid_of = [-1] * world
    grids: list[list[int]] = []
    for start in range(world):
        if grid_of[start] >= 0:
            continue
        grid_of[start] = len(grids)
        found, frontier = [start], [start]
        while frontier:
            r = frontier.pop()
            for reached in everyone[r]:
                for q in reached:
                    if not 0 <= q < world:
                        raise ValueError(
                            f"`dims` must name gangs of global ranks in [0, {world}), but a gang of rank {r} "
                            f"is {list(reached)} instead."
                        )
                    if grid_of[q] < 0:
                        grid_of[q] = grid_of[start]
                        found.append(q)
                        frontier.append(q)
        grids.append(sorted(found))

    mesh_of_grid: list[torch.Tensor] = []
    for members in grids:
        shape = tuple(len(group) for group in everyone[members[0]])
        where: dict[tuple[int, ...], int] = {}
        for r in members:
            sizes = tuple(len(group) for group in everyone[r])
            if sizes != shape:
                raise ValueError(
                    f"`dims` must name gangs that form a grid, but {names} have sizes {list(shape)} on rank "
                    f"{members[0]} and {list(sizes)} on rank {r} instead."
                )
            other = where.setdefault(coords[r], r)
            if other != r:
                raise ValueError(
                    f"`dims` must name gangs that form a grid, but {names} place ranks {other} and {r} at the same "
                    f"position {list(coords[r])} instead (do two of these gangs overlap?)."
                )
        if len(members) != math.prod(shape):
            raise ValueError(
                f"`dims` must name gangs that form a grid, but {names} of sizes {list(shape)} connect "
                f"{len(members)} ranks {members} instead of {math.prod(shape)}."
            )
        mesh = torch.empty(shape, dtype=torch.int)
        for position, r in where.items():
            mesh[position] = r
        # Every slice through every rank must be exactly that rank's gang, in gang rank order.
        for r in members:
            for i in range(ndim):
                index = tuple(slice(None) if j == i else coords[r][j] for j in range(ndim))
                line = tuple(int(v) for v in mesh[index].tolist())
                if line != everyone[r][i]:
                    raise ValueError(
                        f"`dims` must name gangs that form a grid, but the line along {names[i]!r} through rank "
                        f"{r} is {list(line)} while `gangs.{names[i]}` of rank {r} is {list(everyone[r][i])} instead."
                    )
        mesh_of_grid.append(mesh)
    return mesh_of_grid[grid_of[me]]
