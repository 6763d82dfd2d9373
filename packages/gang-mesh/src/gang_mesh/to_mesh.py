"""Build a :class:`~torch.distributed.device_mesh.DeviceMesh` from the process groups of :class:`~gang.Gangs`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gang import Gang, Gangs, all_gather_objects
from gang.roles import ROLES
from gang.topology import infer_grid


def to_device_mesh(gangs: Gangs, dims: Sequence[str]) -> DeviceMesh:
    """Return a ``DeviceMesh`` whose dimension *i* is the gang ``gangs.<dims[i]>``.

    The mesh reuses the gangs' own process groups (``mesh.get_group(dims[i])`` *is*
    ``getattr(gangs, dims[i]).as_process_group()``); no communicator is created. It holds global
    ranks, laid out so that the slice along dimension *i* through this process lists the members
    of ``gangs.<dims[i]>`` in gang rank order. Processes outside this process's grid (another
    pipeline stage, say) get the mesh of their own grid, as a sliced ``init_device_mesh`` would.

    Every process of ``gangs.root`` must call it with the same ``dims``: the member lists are
    exchanged over ``gangs.root`` (after the arguments were checked) so that every process checks
    the whole layout (:func:`gang.topology.infer_grid`) and all raise the same error if the gangs
    do not form a grid. ``gangs.root`` need not span every process: gangs from
    :func:`~gang_mesh.from_device_mesh` on a sub-mesh give back that sub-mesh.

    :param gangs: The gangs of this process.
    :param dims: Names of fields of :class:`~gang.Gangs` (``root``, ``dp``, ``rdp``, ``sdp``, ``tp``,
        ``pp``), outermost first; for example ``("rdp", "sdp", "tp")``.
    :returns: A mesh with ``mesh_dim_names == tuple(dims)`` on ``gangs.root.device``'s type.
    :raises TypeError: If ``gangs`` is not a :class:`~gang.Gangs` or ``dims`` not a sequence of ``str``.
    :raises ValueError: If ``dims`` is empty, names an unknown field or a field twice, names a gang
        without a process group (such as a size-1 :class:`~gang.FakeGang`), or names gangs that do
        not form a grid (for example ``("dp", "rdp")``).
    """
    roles = _check_dims(gangs, dims)
    groups = [getattr(gangs, role).as_process_group() for role in roles]
    me = dist.get_rank()
    mine = tuple(tuple(dist.get_process_group_ranks(group)) for group in groups)
    # Keyed by global rank: `gangs.root` need not be the whole world (a sub-mesh's gangs).
    everyone = dict(all_gather_objects(gangs.root, (me, mine)))
    grid, ranks = infer_grid(roles, everyone, me, argument="dims")
    mesh = torch.tensor(ranks, dtype=torch.int).reshape(grid.shape)
    return DeviceMesh.from_group(groups, gangs.root.device.type, mesh=mesh, mesh_dim_names=roles)


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
    roles = tuple(dims)
    if not roles:
        raise ValueError("`dims` must name at least one gang, but is empty instead.")
    for role in roles:
        if role not in ROLES:
            raise ValueError(
                f"`dims` must contain only names of `Gangs` fields {ROLES}, but contains {role!r} instead."
            )
    repeated = sorted({role for role in roles if roles.count(role) > 1})
    if repeated:
        raise ValueError(f"`dims` must not repeat a name, but repeats {repeated} in {roles} instead.")
    for axis, role in enumerate(roles):
        gang: Gang = getattr(gangs, role)
        if not gang.supports_process_group:
            raise ValueError(
                f"`dims` must name gangs that have a process group, but `dims[{axis}]` is {role!r} and "
                f"`gangs.{role}` is {gang!r} instead (a size-1 gang has no process group; leave it out of the mesh)."
            )
    if gangs.root.device.type == "meta":
        raise ValueError("`gangs.root.device` must be a real device, but is `meta` instead.")
    return roles
