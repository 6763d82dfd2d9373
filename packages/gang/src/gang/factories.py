"""Factories that split a root gang for data, context, tensor, pipeline, expert and sharded data parallelism.

Every layout comes from :mod:`gang.topology` (:class:`~gang.topology.Layout`) and every role from
:mod:`gang.roles`; this module only turns their groups into gangs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gang.env import get_default_device, get_world_size
from gang.extend import check_open
from gang.fake import FakeGang
from gang.gang import Gang
from gang.gangs import Gangs
from gang.process_group_gang import ProcessGroupGang
from gang.roles import ROLES
from gang.split import split_groups, split_layout
from gang.topology import Grid, Layout, parallel_layout, sharded_grid


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
    return split_groups(gang, grid.groups(*names))


def create_parallel_gangs(
    root: Gang,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    etp_size: int | None = None,
) -> Gangs:
    """Split ``root`` into data, context, tensor, pipeline and expert parallel gangs.

    Tensor parallel varies fastest, then context parallel, then data parallel, then pipeline
    parallel (torchtitan's and Megatron's order):
    ``rank = ((pp_index * dp_size + dp_index) * cp_size + cp_index) * tp_size + tp_index``. With 8
    ranks and ``tp_size=2`` the tp gangs are ``[0,1] [2,3] [4,5] [6,7]`` and the dp gangs
    ``[0,2,4,6] [1,3,5,7]``. Expert parallel gangs are carved from the ``dp x cp`` ranks of one
    (pp, tp) position: contiguous blocks of ``ep_size`` in (dp, cp) order, cp fastest; ``edp``
    holds the ranks of equal position in those blocks. With ``etp_size`` the experts' grid
    factorises the ``dp x cp x tp`` ranks of one pipeline stage as ``edp x ep x etp`` instead
    (``etp`` fastest, then ``ep``: Megatron-Core's expert tensor parallel), so ``etp_size=1`` lets
    the ``ep`` gangs span the tensor parallel ranks too (torchtitan's sparse mesh); omitted, ``etp``
    is ``tp`` and the ``ep`` and ``edp`` gangs are as above. The result has ``rdp = dp`` and an
    ``sdp`` of size 1, ready for DDP, and knows its :attr:`~gang.Gangs.layout`.

    Size-1 gangs are :class:`FakeGang` and a gang spanning all of ``root`` is ``root`` itself.
    On a :class:`ProcessGroupGang` each process computes only its own gangs' members (O(gang
    size), never O(world)) and creates only its own groups, except where the backend's
    ``split_group`` wants every group (NCCL); other gangs get every group of each split.

    :param root: The gang to split; every member calls this with the same sizes.
    :param tp_size: The tensor parallel size.
    :param pp_size: The pipeline parallel size.
    :param cp_size: The context parallel size.
    :param ep_size: The expert parallel size; it divides ``dp_size * cp_size`` (with ``etp_size``,
        ``ep_size * etp_size`` divides ``dp_size * cp_size * tp_size``).
    :param etp_size: The expert tensor parallel size; ``None`` is ``tp_size``.
    :raises ValueError: If a size is not positive or does not divide ``root.size``, or ``ep_size``
        does not divide ``dp_size * cp_size`` (``ep_size * etp_size`` does not divide
        ``dp_size * cp_size * tp_size``).
    :raises TypeError: If ``root`` is not a :class:`Gang` or a size is not an ``int``.
    :raises GangError: If creating a sub-gang fails.
    """
    if not isinstance(root, Gang):
        raise TypeError(f"`root` must be a `Gang`, but is of type `{type(root).__name__}` instead.")
    check_open(root, "create_parallel_gangs")
    global_ranks = root.global_ranks if isinstance(root, ProcessGroupGang) else None
    layout = parallel_layout(
        root.size,
        tp_size=tp_size,
        pp_size=pp_size,
        cp_size=cp_size,
        ep_size=ep_size,
        etp_size=etp_size,
        global_ranks=global_ranks,
    )
    return gangs_of_layout(root, layout)


def create_fsdp_gangs(gangs: Gangs, intra_node_size: int | None = None) -> Gangs:
    """Return new gangs whose ``rdp`` and ``sdp`` split ``gangs.dp`` for sharded data parallelism.

    With ``None``, ``sdp = dp`` and ``rdp`` has size 1 (fully sharded, FSDP). With an integer,
    ``dp`` is split into contiguous ``sdp`` gangs of that size and strided ``rdp`` gangs (hybrid
    sharding, HSDP): with a dp gang of 8 and ``intra_node_size=4``, sdp ``[0,1,2,3] [4,5,6,7]`` and
    rdp ``[0,4] [1,5] [2,6] [3,7]`` (ranks of the dp gang). Works whatever ``tp``, ``pp``, ``cp``,
    ``ep`` and ``etp`` are; ``cp``, ``ep``, ``edp`` and ``etp`` are kept, and so is the layout
    (with the new ``rdp x sdp`` split) when ``gangs`` has one.

    :raises ValueError: If ``intra_node_size`` is not positive or does not divide ``dp.size``.
    :raises TypeError: If ``gangs`` is not a :class:`Gangs`.
    :raises GangError: If creating a sub-gang fails.
    """
    if not isinstance(gangs, Gangs):
        raise TypeError(f"`gangs` must be a `Gangs`, but is of type `{type(gangs).__name__}` instead.")
    grid = sharded_grid(gangs.dp.size, intra_node_size)
    # The dp gang on its own: a layout of one (rdp, sdp) plane.
    plane = Layout.of(dict(grid.dims))
    split = _split_by_role(gangs.dp, plane, roles=grid.names)
    layout = None if gangs.layout is None else gangs.layout.resized(**dict(grid.dims))
    changes: dict[str, Any] = {**split, "layout": layout}
    return dataclasses.replace(gangs, **changes)


def gangs_of_layout(root: Gang, layout: Layout) -> Gangs:
    """Split ``root``, whose ranks ``layout`` describes, into the gang of every role, as the factories do.

    What the factories and a mesh bridge that reads a layout off a mesh (``gang_jax.from_jax_mesh``)
    share: size-1 gangs are :class:`FakeGang`, a gang spanning ``root`` is ``root``, roles with the
    same members share one gang, and the result knows ``layout``. Every member of ``root`` calls
    it with the same layout.

    :raises ValueError: If ``layout.size != root.size``.
    """
    return Gangs(**_split_by_role(root, layout), layout=layout)


def _split_by_role(gang: Gang, layout: Layout, roles: Sequence[str] = ROLES) -> dict[str, Gang]:
    """Split ``gang`` (whose ranks ``layout`` describes) into the gang of every role of ``roles``.

    Roles whose gangs are the same (equal :meth:`Layout.key`) share one gang, and every member
    splits in the same order (the table's), so the members agree on every group's name.
    """
    made: dict[tuple[tuple[int, int], ...], Gang] = {}
    result = {}
    for name in roles:
        key = layout.key(name)
        if key not in made:
            made[key] = split_layout(gang, layout, (name,))
        result[name] = made[key]
    return result


def create_fake_gangs(device: torch.device) -> Gangs:
    """Return gangs that are all :class:`FakeGang` of size 1 on ``device`` (single-process code), every role."""
    gang = FakeGang(device)
    return Gangs(**dict.fromkeys(ROLES, gang), layout=Layout.of({}))


def create_default_gang(device: torch.device | None = None, *, timeout: timedelta | None = None) -> Gang:
    """Return the root gang for this process's launch environment.

    When torch's default process group already exists (a framework such as Ray Train's
    ``TorchTrainer``, Lightning, Accelerate or torchtitan initialised it), the gang adopts it: a
    :class:`ProcessGroupGang` over that group that does not own it (see
    :meth:`ProcessGroupGang.from_process_group`), so closing the gang destroys only the sub-gangs
    made from it and leaves the group to the framework. Otherwise a world of one process (no
    launcher variables, or ``WORLD_SIZE=1``) gets a :class:`FakeGang`, and a larger world
    initialises the default process group (see :meth:`ProcessGroupGang.create_default_process_group`).

    :param device: The device; :func:`get_default_device` when ``None``.
    :param timeout: The collective timeout of a real gang. An adopted group keeps its own timeout
        (its collectives were set up by the framework); ``timeout`` is then given to its sub-gangs.
    """
    if device is None:
        device = get_default_device()
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        assert world is not None  # initialised
        return ProcessGroupGang.from_process_group(world, device, timeout=timeout)
    if get_world_size() == 1:
        return FakeGang(device)
    return ProcessGroupGang.create_default_process_group(device, timeout=timeout)
