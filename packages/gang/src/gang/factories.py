"""Factories that split a root gang for data, tensor, pipeline and sharded data parallelism.

Every layout comes from :mod:`gang.topology`; this module only turns its groups into gangs.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch

from gang.env import get_default_device, get_world_size
from gang.fake import FakeGang
from gang.gang import Gang
from gang.gangs import Gangs
from gang.process_group import ProcessGroupGang
from gang.topology import Grid, parallel_grid, role_spans, sharded_grid


def split_along(gang: Gang, grid: Grid, *names: str) -> Gang:
    """Return the sub-gang of ``gang`` spanned by the grid dimensions ``names``.

    ``grid`` describes ``gang``'s ranks. No ``names`` or a group of one rank gives a
    :class:`FakeGang` and a group spanning all of ``gang`` is ``gang`` itself, so no needless
    process group is created.
    Every member of ``gang`` must call it with the same arguments.

    :raises ValueError: If ``grid.size != gang.size`` or a name is not a grid dimension.
    """
    if grid.size != gang.size:
        raise ValueError(f"`grid` must have {gang.size} ranks (the gang size), but has {grid.size} instead.")
    if not names:
        return FakeGang(gang.device, rank=0, size=1)
    groups = grid.groups(*names)
    group_size = len(groups[0])
    if group_size == gang.size:
        return gang
    if group_size == 1:
        return FakeGang(gang.device, rank=0, size=1)
    sub = gang.split(groups)
    if sub is None:  # Impossible: the groups partition the gang.
        raise AssertionError(f"rank {gang.rank} is in no group of {groups}")
    return sub


def create_parallel_gangs(root: Gang, *, tp_size: int = 1, pp_size: int = 1) -> Gangs:
    """Split ``root`` into data, tensor and pipeline parallel gangs.

    Tensor parallel varies fastest, then data parallel, then pipeline parallel:
    ``rank = pp_index * (dp_size * tp_size) + dp_index * tp_size + tp_index``. With 8 ranks and
    ``tp_size=2`` the tp gangs are ``[0,1] [2,3] [4,5] [6,7]`` and the dp gangs ``[0,2,4,6]
    [1,3,5,7]``. The result has ``rdp = dp`` and an ``sdp`` of size 1, ready for DDP.

    :param root: The gang to split; every member calls this with the same sizes.
    :param tp_size: The tensor parallel size.
    :param pp_size: The pipeline parallel size.
    :raises ValueError: If a size is not positive or does not divide ``root.size``.
    :raises TypeError: If a size is not an ``int``.
    :raises GangError: If creating a sub-gang fails.
    """
    grid = parallel_grid(root.size, tp_size=tp_size, pp_size=pp_size)
    return Gangs(**_split_by_role(root, grid))


def create_fsdp_gangs(gangs: Gangs, intra_node_size: int | None = None) -> Gangs:
    """Return new gangs whose ``rdp`` and ``sdp`` split ``gangs.dp`` for sharded data parallelism.

    With ``None``, ``sdp = dp`` and ``rdp`` has size 1 (fully sharded, FSDP). With an integer,
    ``dp`` is split into contiguous ``sdp`` gangs of that size and strided ``rdp`` gangs (hybrid
    sharding, HSDP): with a dp gang of 8 and ``intra_node_size=4``, sdp ``[0,1,2,3] [4,5,6,7]`` and
    rdp ``[0,4] [1,5] [2,6] [3,7]`` (ranks of the dp gang). Works whatever ``tp`` and ``pp`` are.

    :raises ValueError: If ``intra_node_size`` is not positive or does not divide ``dp.size``.
    :raises TypeError: If ``gangs`` is not a :class:`Gangs`.
    :raises GangError: If creating a sub-gang fails.
    """
    if not isinstance(gangs, Gangs):
        raise TypeError(f"`gangs` must be a `Gangs`, but is of type `{type(gangs).__name__}` instead.")
    grid = sharded_grid(gangs.dp.size, intra_node_size)
    split = _split_by_role(gangs.dp, grid)
    return dataclasses.replace(gangs, rdp=split["rdp"], sdp=split["sdp"])


def _split_by_role(gang: Gang, grid: Grid) -> dict[str, Gang]:
    """Split ``gang`` into the gang of every role (:func:`gang.topology.role_spans` of ``grid``).

    Roles that span the same dimensions share one gang.
    """
    spans = role_spans(grid.names)
    made: dict[tuple[str, ...], Gang] = {}
    for span in spans.values():
        if span not in made:
            made[span] = split_along(gang, grid, *span)
    return {role: made[span] for role, span in spans.items()}


def create_fake_gangs(device: torch.device) -> Gangs:
    """Return gangs that are all :class:`FakeGang` of size 1 on ``device`` (single-process code)."""
    gang = FakeGang(device)
    return Gangs(root=gang, dp=gang, rdp=gang, sdp=gang, tp=gang, pp=gang)


def create_default_gang(device: torch.device | None = None, *, timeout: timedelta | None = None) -> Gang:
    """Return the root gang for this process's launch environment.

    A world of one process (no launcher variables, or ``WORLD_SIZE=1``) gets a :class:`FakeGang`;
    otherwise the default process group is initialised (see
    :meth:`ProcessGroupGang.create_default_process_group`).

    :param device: The device; :func:`get_default_device` when ``None``.
    :param timeout: The collective timeout of a real gang.
    """
    if device is None:
        device = get_default_device()
    if get_world_size() == 1:
        return FakeGang(device)
    return ProcessGroupGang.create_default_process_group(device, timeout=timeout)
