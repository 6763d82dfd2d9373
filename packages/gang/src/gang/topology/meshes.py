"""The mesh-naming rules both mesh bridges share (``gang_mesh``: torch's ``DeviceMesh``, ``gang_jax``: JAX's ``Mesh``).

A bridge builds a mesh from a gang's :class:`~gang.topology.Layout` (:func:`mesh_dims` checks
what it is asked for) and reads a mesh with the same rules: :func:`mesh_roles` gives each
dimension's role (the names other libraries use included, from :data:`gang.roles.ALIASES`),
:func:`mesh_spans` which dimensions make up each gang of :class:`~gang.Gangs` (how ``dp`` relates
to ``rdp`` and ``sdp``, with :func:`role_spans`; how a mesh with expert dimensions reads the
dense axes, with :data:`gang.roles.EXPERT_MESH_AXES`), and :func:`mesh_layout` the layout of the
whole mesh. Every name comes from the table in :mod:`gang.roles`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from math import prod
from typing import Any

from gang.roles import (
    ALIASES,
    AXIS_ROLES,
    DENSE_ROLES,
    EXPERT_AXES,
    EXPERT_GRID,
    EXPERT_MESH_AXES,
    EXPERT_ROLES,
    EXPERT_SPLITS,
    GRID_AXES,
    ROLE_TABLE,
    ROLES,
    SIZE_ONE,
    VIEWS,
    role,
)
from gang.topology.layout import Layout, flattened_axes

MESH_ROLES: tuple[str, ...] = DENSE_ROLES + EXPERT_ROLES
"""The gang roles a mesh dimension can play."""

MESH_ALIASES: dict[str, str] = {alias.name: alias.role for alias in ALIASES}
"""Mesh dimension names other libraries use (torchtitan, Megatron-Core) and the role each plays
(from :data:`gang.roles.ALIASES`)."""

_FOLDS = {alias.name: alias.folds for alias in ALIASES if alias.folds is not None}

_EXPERT_DERIVED = VIEWS[1].derived

_WITH_EXPERTS = tuple(
    axis
    for axis in GRID_AXES
    if axis in EXPERT_GRID
    or any(
        r.kind == "expert" and r.axes[0] != _EXPERT_DERIVED and r.omitted in ROLES and axis in role(str(r.omitted)).axes
        for r in ROLE_TABLE
    )
)
"""The dense axes a mesh may name next to expert roles: those the views share (``pp``) and those an
expert role stands for when not set (``tp``, which ``etp`` is by default)."""

MeshDim = str | tuple[str, ...]
"""An entry of a bridge's ``dims``: a role, or a tuple of dense roles spanned at once (a flattened dimension)."""


def role_spans(names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Return, for ``root`` and every dense role, the dimensions of a grid whose groups are its gangs.

    ``names`` are the dimension names of a grid, each a dense role of :data:`gang.roles.DENSE_ROLES`.
    The result maps ``root`` and the dense roles (``dp``, ``rdp``, ``sdp``, ``cp``, ``tp``, ``pp``,
    in that order) to names from ``names``, in grid order; ``()`` means a gang of size 1. The data
    parallel rules:

    * ``root`` spans every dimension, ``cp``, ``tp`` and ``pp`` their own or none;
    * with a ``dp`` dimension, ``rdp`` is ``dp`` and ``sdp`` has size 1 (ready for DDP, as
      :func:`gang.create_parallel_gangs` builds);
    * otherwise ``dp`` spans whichever of ``rdp`` and ``sdp`` the grid has: ``rdp`` times ``sdp``
      when it has both (hybrid sharding), the one it has, or nothing.

    :raises ValueError: If a name is not a dense role, a name repeats, or ``dp`` comes with
        ``rdp`` or ``sdp`` (``dp`` is their product).
    """
    unknown = [name for name in names if name not in DENSE_ROLES]
    if unknown:
        raise ValueError(f"`names` must be roles {DENSE_ROLES}, but has {unknown} instead.")
    if len(set(names)) != len(names):
        raise ValueError(f"`names` must not repeat a role, but is {tuple(names)} instead.")
    for name in names:
        parts = role(name).axes
        if len(parts) > 1 and any(other != name and set(role(other).axes) & set(parts) for other in names):
            raise ValueError(
                f"`names` must not hold `{name}` together with "
                f"{' or '.join(f'`{AXIS_ROLES[axis]}`' for axis in parts)} ({name} is their product), "
                f"but is {tuple(names)} instead."
            )
    spans = _spans(names, expert=False)
    return {name: spans[name] for name in ("root", *DENSE_ROLES)}


def _spans(names: Sequence[str], *, expert: bool) -> dict[str, tuple[str, ...]]:
    """Which of the dimensions ``names`` (roles that fit together) make up the gang of every role.

    A role spans the dimensions whose axes are among its own, with a dimension of several grid
    axes (``dp``) counting as its slowest one (the others have size 1 on that grid). On an
    ``expert`` mesh the dense axes are read as :data:`gang.roles.EXPERT_MESH_AXES` says; an expert
    role set by the factories (``ep``, ``etp``) is its own axis there and, on a dense mesh, what
    the table says it is when not set (size 1, or the role it stands for); ``edp`` is every axis
    of the experts' ranks the others are not.
    """
    axes = _mesh_axes(expert)
    region = [a for axis in EXPERT_SPLITS for a in axes[axis]]
    on_mesh = {a for parts in axes.values() for a in parts}

    def fine(name: str) -> tuple[str, ...]:
        row = role(name)
        if row.kind == "root":
            return tuple(a for axis in GRID_AXES for a in axes[axis])
        if row.kind == "dense":
            return tuple(a for axis in row.axes for a in axes[axis])
        (axis,) = row.axes
        if axis != _EXPERT_DERIVED:
            if axis in on_mesh:
                return (axis,)
            return () if row.omitted == SIZE_ONE else fine(str(row.omitted))
        others = {a for other in EXPERT_AXES if other != axis for a in fine(AXIS_ROLES[other])}
        return tuple(a for a in region if a not in others)

    def placed(name: str) -> str:
        return fine(name)[0] if role(name).kind == "dense" else role(name).axes[0]

    return {row.name: tuple(name for name in names if placed(name) in fine(row.name)) for row in ROLE_TABLE}


def _mesh_axes(expert: bool) -> dict[str, tuple[str, ...]]:
    """What each dense axis is on a mesh: itself, or on a mesh with expert dimensions what
    :data:`gang.roles.EXPERT_MESH_AXES` says."""
    return dict(EXPERT_MESH_AXES) if expert else {axis: (axis,) for axis in GRID_AXES}


"""An entry of a bridge's ``dims``: a role, or a tuple of dense roles spanned at once (a flattened dimension)."""


def mesh_dims(dims: Sequence[MeshDim]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Check the ``dims`` of a mesh to build from gangs; return the dimension names and each one's roles.

    An entry is a field of :class:`~gang.Gangs` or a tuple of dense roles (a flattened dimension,
    named by joining them with ``_``). Every check that needs neither the gangs nor communication.

    :raises TypeError: If ``dims`` is not a sequence of names and non-empty tuples of names.
    :raises ValueError: If ``dims`` is empty, names an unknown role or a name twice, flattens roles
        that overlap or are not dense, names dimensions that share a grid axis (such as
        ``("dp", "rdp")``), or mixes expert roles with ``rdp``, ``sdp`` or ``cp``.
    """
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
        raise TypeError(f"`dims` must be a sequence of gang names such as ('sdp',), but is {dims!r} instead.")
    per_dim: list[tuple[str, ...]] = []
    for entry in dims:
        roles = (entry,) if isinstance(entry, str) else entry
        if not isinstance(roles, tuple) or not roles or not all(isinstance(name, str) for name in roles):
            raise TypeError(
                f"`dims` must contain only `str` names and non-empty tuples of them, but contains {entry!r} instead."
            )
        per_dim.append(roles)
    if not per_dim:
        raise ValueError("`dims` must name at least one gang, but is empty instead.")
    for roles in per_dim:
        for name in roles:
            if name not in ROLES:
                raise ValueError(
                    f"`dims` must contain only names of `Gangs` fields {ROLES}, but contains {name!r} instead."
                )
    names = tuple("_".join(roles) for roles in per_dim)
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"`dims` must not repeat a name, but repeats {repeated} in {names} instead.")
    axes: dict[str, str] = {}  # grid axis -> the dimension that spans it
    for axis, roles in enumerate(per_dim):
        spanned = flattened_axes(roles, argument=f"dims[{axis}]")
        for grid_axis in spanned:
            if grid_axis in axes:
                raise ValueError(
                    f"`dims` must name gangs that form a grid, but {axes[grid_axis]!r} and {names[axis]!r} of {names} "
                    f"share the grid axis {grid_axis!r} instead."
                )
            axes[grid_axis] = names[axis]
    expert = [axes[axis] for axis in EXPERT_AXES if axis in axes]
    dense = [axes[axis] for axis in GRID_AXES if axis in axes and axis not in _WITH_EXPERTS]
    if expert and dense:
        others = " and ".join(f"`{AXIS_ROLES[axis]}`" for axis in _WITH_EXPERTS)
        raise ValueError(
            f"`dims` must name gangs that form a grid, but {expert[0]!r} and {dense[0]!r} of {names} both split the "
            f"data and context parallel ranks instead (name the expert roles with {others} only)."
        )
    return names, per_dim


def mesh_roles(dim_names: Sequence[str], names: Mapping[str, str] | None) -> list[str]:
    """The role each dimension of a mesh plays, from its name, an alias or ``names``.

    ``dp``, ``rdp``, ``sdp``, ``cp``, ``tp``, ``pp``, ``ep`` and ``edp`` play themselves; the names
    of :data:`MESH_ALIASES` play their role (a name with context parallel folded in, such as
    torchtitan's ``dp_shard_cp``, plays its data parallel role and cannot come with ``cp``);
    ``names`` maps any other name (and overrides an alias).

    :param dim_names: The mesh's dimension names, in order.
    :param names: The caller's map of dimension names to roles (``None``: none).
    :raises TypeError: If ``names`` is not a mapping of ``str`` to ``str``.
    :raises ValueError: If a dimension has no role, two dimensions play the same role, a dimension
        with context parallel folded in comes with ``cp``, or ``names`` holds a key that is not a
        dimension or a value that is not a role.
    """
    if names is None:
        names = {}
    if not isinstance(names, Mapping):
        raise TypeError(f"`names` must be a mapping of mesh dimension names to roles, but is {names!r} instead.")
    for key, value in names.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"`names` must map `str` to `str`, but maps {key!r} to {value!r} instead.")
    dim_names = tuple(dim_names)
    for key, value in names.items():
        if key not in dim_names:
            raise ValueError(
                f"`names` must only map dimensions of `mesh` {dim_names}, but maps {key!r} (to {value!r}) instead."
            )
        if value not in MESH_ROLES:
            raise ValueError(f"`names` must map to roles {MESH_ROLES}, but maps {key!r} to {value!r} instead.")
    roles: list[str] = []
    for name in dim_names:
        found = names.get(name) or (name if name in MESH_ROLES else MESH_ALIASES.get(name))
        if found is None:
            raise ValueError(
                f"`mesh` dimension names must be roles {MESH_ROLES} or {tuple(MESH_ALIASES)}, or be mapped by "
                f"`names`, but {name!r} of {dim_names} is none of these instead."
            )
        if found in roles:
            raise ValueError(
                f"`mesh` dimensions must play distinct roles, but {name!r} and "
                f"{dim_names[roles.index(found)]!r} of {dim_names} both play {found!r} instead."
            )
        roles.append(found)
    for name in dim_names:
        folds = _FOLDS.get(name) if name not in names else None
        if folds is not None and folds in roles:
            raise ValueError(
                f"`mesh` must not have a `{folds}` dimension next to {name!r}, which has {role(folds).title} folded "
                f"in, but its dimensions are {dim_names} instead."
            )
    return roles


def mesh_spans(roles: Sequence[str], dim_names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Which dimensions, by role, make up each gang of :class:`~gang.Gangs` read from a mesh.

    ``roles`` are the roles of the mesh's dimensions (:func:`mesh_roles`). Dense meshes follow
    :func:`role_spans`; without expert dimensions ``ep`` has size 1, ``etp`` is ``tp`` and ``edp``
    spans ``dp`` and ``cp``. On an expert mesh (``ep``, ``edp`` or ``etp``, with ``pp``, ``rdp``
    and ``tp`` only; :data:`gang.roles.EXPERT_MESH_AXES`) ``edp`` spans every data parallel
    dimension but ``ep``, ``dp`` spans ``rdp``, ``edp`` and ``ep``, ``sdp`` spans ``edp`` and
    ``ep``, and ``tp`` and ``etp`` are one dimension (the mesh cannot tell them apart; ``etp``
    not set is ``tp``). ``()`` means a gang of size 1.

    :param dim_names: The mesh's dimension names, for error messages.
    :raises ValueError: If the roles do not fit together (``dp`` with ``rdp`` or ``sdp``; an expert
        role with ``dp``, ``sdp`` or ``cp``; ``tp`` with ``etp``).
    """
    roles = list(roles)
    expert = [name for name in roles if name in EXPERT_ROLES]
    try:
        if expert:
            split = _mesh_axes(expert=True)
            clash = [
                name
                for name in roles
                if role(name).kind == "dense" and any(len(split[a]) != 1 for a in role(name).axes)
            ]
            if clash:
                raise ValueError(
                    f"the expert roles re-factor the data and context parallel ranks, so {expert[0]!r} cannot come "
                    f"with {clash[0]!r}"
                )
            placed = {name: split[role(name).axes[0]][0] if role(name).kind == "dense" else name for name in roles}
            same = [(a, b) for i, a in enumerate(roles) for b in roles[i + 1 :] if placed[a] == placed[b]]
            if same:
                raise ValueError(f"{same[0][0]!r} and {same[0][1]!r} are the same dimension of a mesh with experts")
        else:
            role_spans(roles)
    except ValueError as ex:
        raise ValueError(
            f"`mesh` must have dimensions whose roles fit together, but its dimensions {tuple(dim_names)} "
            f"play {tuple(roles)} instead: {ex}"
        ) from None
    return _spans(roles, expert=bool(expert))


def mesh_layout(roles: Sequence[str], shape: Sequence[int], dim_names: Sequence[str]) -> tuple[Layout, tuple[int, ...]]:
    """The :class:`Layout` of a mesh whose dimensions play ``roles`` and have sizes ``shape``.

    Each axis of the layout is as large as the dimensions its role's gang spans
    (:func:`mesh_spans`): a ``dp`` dimension is ``rdp`` (``sdp`` of size 1), ``edp`` and ``ep``
    make ``sdp`` with ``ep`` expert parallel, and ``etp`` is the expert tensor parallel size. The
    root ranks are the mesh's positions in grid order: transposing the mesh's array by the
    returned ``order`` and flattening it lists them, so the layout's gang of each role is the line
    of the mesh along its dimensions, in their order (for ``dp`` spanning ``rdp`` and ``sdp``,
    ``rdp`` slowest).

    :param dim_names: The mesh's dimension names, for error messages.
    :returns: The layout (root rank *i* is the *i*-th position in grid order; no global ranks)
        and ``order``, the mesh's dimensions in grid order.
    :raises ValueError: As :func:`mesh_spans`.
    """
    spans = mesh_spans(roles, dim_names)
    sizes = dict(zip(roles, shape, strict=True))

    def size(name: str) -> int:
        return prod(sizes[dim] for dim in spans[name])

    # The grid's order, with `edp x ep` in place of their split on an expert mesh.
    axes = _mesh_axes(any(name in EXPERT_ROLES for name in roles))
    grid_order = [a for axis in GRID_AXES for a in axes[axis]]

    def position(name: str) -> int:
        row = role(name)
        return grid_order.index(row.axes[0] if row.kind == "expert" else axes[row.axes[0]][0])

    order = tuple(sorted(range(len(roles)), key=lambda dim: position(roles[dim])))
    layout = Layout(tuple(size(AXIS_ROLES[axis]) for axis in GRID_AXES))
    held = [f.name for f in dataclasses.fields(Layout) if f.name in EXPERT_AXES]  # `ep`, `etp`
    expert: dict[str, Any] = {axis: size(AXIS_ROLES[axis]) for axis in held}
    return dataclasses.replace(layout, **expert), order
