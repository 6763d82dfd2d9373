"""The JAX mesh bridge: one :class:`~gang.Gangs` layout as a ``jax.sharding.Mesh``, and back.

:func:`to_jax_mesh` is :func:`gang_mesh.to_device_mesh` for JAX: the same ``dims``, the same
names, the same ranks along each axis. :func:`from_jax_mesh` is :func:`gang_mesh.from_device_mesh`
for JAX: the same roles and aliases, giving :class:`~gang_jax.JaxGang` gangs. Both take their axis
arithmetic from :mod:`gang.topology` (:func:`~gang.topology.mesh_dims`,
:meth:`~gang.topology.Layout.submesh`, :func:`~gang.topology.mesh_roles`,
:func:`~gang.topology.mesh_layout`), as the torch bridge does, so a layout means the same ranks in
both frameworks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch.distributed as dist
from jax.sharding import Mesh

from gang import Gang, Gangs, ProcessGroupGang
from gang.factories import gangs_of_layout
from gang.topology import Layout, MeshDim, mesh_dims, mesh_layout, mesh_roles
from gang_jax._collectives import Communicator
from gang_jax._engine import LocalEngine, _process_devices
from gang_jax.gang import JaxGang

__all__ = ["from_jax_mesh", "to_jax_mesh"]


def to_jax_mesh(gangs: Gangs, dims: Sequence[MeshDim]) -> Mesh:
    """Return a ``jax.sharding.Mesh`` whose axis *i* is the gang ``gangs.<dims[i]>``.

    ``dims`` is what :func:`gang_mesh.to_device_mesh` takes: fields of :class:`~gang.Gangs`, or
    tuples of dense roles for a flattened axis named by joining them with ``_``
    (``("rdp", ("sdp", "cp"))`` gives ``axis_names == ("rdp", "sdp_cp")``). The mesh holds the JAX
    device of each member process, laid out so that the slice along axis *i* through this
    process's device is the devices of ``gangs.<dims[i]>``'s members in gang rank order: the same
    ranks, in the same places, as the torch mesh of the same ``dims``. A size-1 gang is a size-1 axis.

    No communication: the mesh comes from the gangs' :attr:`~gang.Gangs.layout`, so every process
    of the mesh gets the same mesh, as JAX requires. Processes outside this process's grid
    (another pipeline stage, say) get the mesh of their own grid.

    Works for gangs of any kind whose layout is known: :class:`~gang_jax.JaxGang` gangs (from the
    factories on a ``JaxGang`` root, or from :func:`from_jax_mesh`), whose devices are their
    members' devices; and torch gangs from the factories, when JAX runs in the same processes with
    JAX process index equal to the torch rank (as :meth:`JaxGang.create_default
    <gang_jax.JaxGang.create_default>` arranges under every launcher): the device of global rank
    *r* is then process *r*'s device (the first CPU device it owns, the one a ``JaxGang`` uses).

    :param gangs: The gangs of this process.
    :param dims: Names of fields of :class:`~gang.Gangs` or tuples of dense roles, outermost first.
    :returns: The mesh, with ``axis_names`` the names of ``dims``.
    :raises TypeError: If ``gangs`` is not a :class:`~gang.Gangs` or ``dims`` not a sequence of
        names and tuples of names.
    :raises ValueError: If ``dims`` is empty, names an unknown role or a name twice, flattens roles
        that overlap or are not dense, or names dimensions that do not form a grid (such as
        ``("dp", "rdp")``); if the gangs' layout is unknown; if ``gangs.root`` is an isolated
        ``JaxGang``; or, for torch gangs, if this process's JAX process index differs from its torch
        rank or a member has no JAX process.
    """
    if not isinstance(gangs, Gangs):
        raise TypeError(f"`gangs` must be a `Gangs`, but is of type `{type(gangs).__name__}` instead.")
    names, per_dim = mesh_dims(dims)
    layout = gangs.layout
    if layout is None:
        raise ValueError(
            "`gangs` must know their layout (gangs from the factories or from `from_jax_mesh`), but have none "
            "instead (gangs from `gang_mesh.from_device_mesh` do not: make them with the factories)."
        )
    positions = layout.submesh(gangs.root.rank, per_dim)
    devices = _root_devices(gangs.root, layout, positions)
    return Mesh(devices, names)


def _root_devices(root: Gang, layout: Layout, positions: np.ndarray) -> np.ndarray:
    """The JAX device of each root rank in ``positions`` (an array of root ranks), same shape."""
    if isinstance(root, JaxGang):
        if root.isolated:
            raise ValueError(
                f"`gangs.root` must run JAX in this process, but is isolated (JAX runs in a child process) "
                f"instead: {root!r}."
            )
        owned = np.empty(root.size, dtype=object)
        owned[:] = root.communicator.devices
        found: np.ndarray = owned[positions]
        return found
    by_process = _process_devices()
    if isinstance(root, ProcessGroupGang):
        rank, index = dist.get_rank(), jax.process_index()
        if rank != index:
            raise ValueError(
                f"This process's JAX process index must equal its torch rank, but is {index} on torch rank {rank} "
                "instead (start JAX with `JaxGang.create_default()`, which uses the torch rank)."
            )
        global_ranks = positions if layout.global_ranks is None else np.asarray(layout.global_ranks)[positions]
    elif root.size == 1:
        global_ranks = np.full(positions.shape, jax.process_index())
    else:
        raise ValueError(f"`gangs.root` must be a `JaxGang` or a torch `ProcessGroupGang`, but is {root!r} instead.")
    missing = sorted({int(r) for r in global_ranks.reshape(-1).tolist()} - set(by_process))
    if missing:
        raise ValueError(
            f"Every member must have a JAX process, but ranks {missing} have none instead (JAX has "
            f"{jax.process_count()} processes)."
        )
    table = np.empty(max(by_process) + 1, dtype=object)
    for process, device in by_process.items():
        table[process] = device
    mapped: np.ndarray = table[global_ranks]
    return mapped


def from_jax_mesh(mesh: Mesh, *, names: Mapping[str, str] | None = None) -> Gangs:
    """Turn a ``jax.sharding.Mesh`` into :class:`~gang.Gangs` of :class:`~gang_jax.JaxGang` gangs.

    Axes are read as :func:`gang_mesh.from_device_mesh` reads dimensions: ``dp``, ``rdp``,
    ``sdp``, ``cp``, ``tp``, ``pp``, ``ep`` and ``edp`` play themselves, the names other libraries
    use are understood (torchtitan's ``dp_replicate``, ``dp_shard``, ``efsdp``, ``batch`` and its
    flattened names, which count as their data parallel role with context parallel folded in;
    :data:`gang.roles.ALIASES`, the table :func:`gang_mesh.from_device_mesh` reads too), and
    ``names`` maps any other axis name to a role. Each gang's members are the processes of the
    mesh's devices along its axes through this process's device, ranked in the mesh's order
    (``root`` spans the whole mesh in the grid's order: ``pp``, then data parallel, ``cp`` and
    ``tp``; ``dp`` of ``rdp`` and ``sdp`` axes has ``rdp`` slowest).
    Roles the mesh lacks and axes of size 1 are size-1 :class:`~gang.FakeGang` gangs, as the
    factories make them.

    No communication: every process derives the same gangs from the same mesh (each gang compiles
    its collectives on first use). The gangs know their layout (the mesh's), so
    ``to_jax_mesh(from_jax_mesh(mesh), mesh.axis_names)`` gives back ``mesh``'s devices in the same
    places (for axes named by their roles), and the factories' ``flatten`` needs no communication.

    :param mesh: A mesh holding one device of this process, and one device per process (the
        gangs' collectives run between processes).
    :param names: Maps axis names to roles, e.g. ``{"shard": "sdp"}``.
    :returns: Gangs on the CPU (the device of the tensors their collectives take), whose layout
        is the mesh's.
    :raises TypeError: If ``mesh`` is not a ``jax.sharding.Mesh``, an axis name is not a ``str``,
        or ``names`` is not a mapping of ``str`` to ``str``.
    :raises ValueError: If an axis has no role, two axes play the same role, ``dp`` comes with
        ``rdp`` or ``sdp``, a name with context parallel folded in comes with ``cp``, an expert
        role comes with ``dp``, ``sdp`` or ``cp``, ``names`` holds a key that is not an axis or a
        value that is not a role, a process owns several devices of the mesh, or this process
        owns none.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"`mesh` must be a `jax.sharding.Mesh`, but is of type `{type(mesh).__name__}` instead.")
    axis_names: tuple[Any, ...] = tuple(mesh.axis_names)
    for axis in axis_names:
        if not isinstance(axis, str):
            raise TypeError(f"`mesh` axis names must be `str`, but {axis!r} of {axis_names} is not instead.")
    roles = mesh_roles(axis_names, names)
    devices: np.ndarray = mesh.devices
    processes = [int(device.process_index) for device in devices.reshape(-1).tolist()]
    shared = sorted({p for p in processes if processes.count(p) > 1})
    if shared:
        raise ValueError(
            f"`mesh` must hold one device per process, but processes {shared} own several of its devices instead."
        )
    me = jax.process_index()
    if me not in processes:
        raise ValueError(f"`mesh` must hold a device of this process ({me}), but holds processes {processes} instead.")
    layout, order = mesh_layout(roles, devices.shape, axis_names)
    ordered: list[jax.Device] = np.transpose(devices, order).reshape(-1).tolist()
    members = tuple(int(device.process_index) for device in ordered)
    # On this process's JAX runtime: the gangs share its one queue and the timeout it was started with.
    root = JaxGang(LocalEngine(Communicator(ordered, members.index(me)), members))
    return gangs_of_layout(root, layout)
