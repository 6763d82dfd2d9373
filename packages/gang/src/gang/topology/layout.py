"""The role layouts: where every rank of a root gang sits, for every role of :data:`gang.roles.ROLE_TABLE`.

A :class:`Layout` is the one grid of ranks seen through the named views of
:data:`gang.roles.VIEWS` (the dense roles' axes, the experts' ``edp x ep x etp``), each a
:class:`~gang.topology.Grid`, checked to agree on the axes they share. Its arithmetic is
closed-form: a rank's group along any roles costs the size of that group, never the size of the
world. The factories (:mod:`gang.factories`, through which every kind of gang is split, the JAX
gang included) split gangs along a layout (:func:`parallel_layout`), and so does the dry run
(:func:`gang.testing.dry_run`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from math import prod
from typing import Any

import numpy as np

from gang.extend import check_int
from gang.roles import AXIS_ROLES, EXPERT_AXES, EXPERT_SPLITS, GRID_AXES, ROLE_TABLE, SIZE_ONE, VIEWS, covering, role
from gang.topology.grid import Grid, check_views, partition_key


def parallel_grid(world_size: int, *, tp_size: int = 1, pp_size: int = 1, cp_size: int = 1) -> Grid:
    """Return the grid of :data:`gang.roles.GRID_AXES` of :func:`gang.create_parallel_gangs`.

    Tensor parallel varies fastest, then context parallel, then data parallel, then pipeline
    parallel: ``rank = ((pp_index * dp_size + dp_index) * cp_size + cp_index) * tp_size + tp_index``.
    The data parallel ranks are all replicated (``rdp = dp``, ``sdp`` of size 1, ready for DDP).

    :raises ValueError: If a size is not positive or ``tp_size * cp_size * pp_size`` does not
        divide ``world_size``.
    """
    return _grid_of_sizes(world_size, tp_size=tp_size, pp_size=pp_size, cp_size=cp_size)


def _grid_of_sizes(world_size: int, **given: int) -> Grid:
    """:func:`parallel_grid` for the ``<role>_size`` arguments ``given`` (each role one dense axis); the
    first axis that no role given is on holds the rest of the ranks, the others have size 1."""
    world_size = check_int("world_size", world_size, minimum=1)
    sizes: dict[str, int] = {}
    for name, given_value in given.items():
        value = sizes[role(name.removesuffix("_size")).axes[0]] = check_int(name, given_value, minimum=1)
        if world_size % value != 0:
            raise ValueError(f"`{name}` must be a factor of the root gang size ({world_size}), but is {value} instead.")
    if world_size % prod(sizes.values()) != 0:
        fastest_first = sorted(given, key=lambda name: -GRID_AXES.index(role(name.removesuffix("_size")).axes[0]))
        product = " * ".join(fastest_first)
        shown = " * ".join(str(given[name]) for name in fastest_first)
        raise ValueError(
            f"`{product}` must be a factor of the root gang size ({world_size}), "
            f"but is {shown} = {prod(sizes.values())} instead."
        )
    rest = [axis for axis in GRID_AXES if axis not in sizes]
    sizes[rest[0]] = world_size // prod(sizes.values())
    return Grid(tuple((axis, sizes.get(axis, 1)) for axis in GRID_AXES))


def sharded_grid(dp_size: int, intra_node_size: int | None) -> Grid:
    """Return the ``(rdp, sdp)`` grid (the axes of the data parallel role) that splits a data
    parallel gang of ``dp_size`` ranks.

    ``sdp`` gangs are contiguous blocks of ``intra_node_size`` ranks and ``rdp`` gangs are strided.
    With ``None`` the whole data parallel gang is one ``sdp`` gang (fully sharded).

    :raises ValueError: If ``intra_node_size`` is not positive or does not divide ``dp_size``.
    """
    dp_size = check_int("dp_size", dp_size, minimum=1)
    if intra_node_size is None:
        intra_node_size = dp_size
    intra_node_size = check_int("intra_node_size", intra_node_size, minimum=1)
    if dp_size % intra_node_size != 0:
        raise ValueError(
            f"`intra_node_size` must be a factor of the data parallel gang size ({dp_size}), "
            f"but is {intra_node_size} instead."
        )
    replicated, sharded = role("dp").axes
    return Grid(((replicated, dp_size // intra_node_size), (sharded, intra_node_size)))


def flattened_axes(roles: Sequence[str], *, argument: str = "roles") -> tuple[str, ...]:
    """Return the grid axes (of :data:`gang.roles.GRID_AXES` or :data:`gang.roles.EXPERT_AXES`)
    that the gang spanning ``roles`` at once is the product of, slowest first.

    ``roles`` may name ``root`` alone, one expert role alone, or dense roles that share no grid
    axis; the order in which they are named does not matter.

    :param argument: The caller's name for ``roles``, used in error messages.
    :raises ValueError: If ``roles`` is empty, names an unknown role, repeats one, or names
        overlapping roles (``dp`` with ``rdp`` or ``sdp``; ``root``, ``ep`` or ``edp`` with any
        other role).
    :raises TypeError: If a role is not a ``str``.
    """
    roles = tuple(roles)
    if not roles:
        raise ValueError(f"`{argument}` must name at least one role, but is empty instead.")
    for name in roles:
        if not isinstance(name, str):
            raise TypeError(
                f"`{argument}` must be role names, but holds {name!r} of type `{type(name).__name__}` instead."
            )
    unknown = [name for name in roles if name not in [row.name for row in ROLE_TABLE]]
    if unknown:
        raise ValueError(
            f"`{argument}` must name roles of {tuple(row.name for row in ROLE_TABLE)}, but has {unknown} instead."
        )
    if len(set(roles)) != len(roles):
        raise ValueError(f"`{argument}` must not repeat a role, but is {roles} instead.")
    if len(roles) > 1:
        alone = [name for name in roles if role(name).kind != "dense"]
        if alone:
            raise ValueError(
                f"`{argument}` must name `{alone[0]}` alone (it overlaps every dense role), but is {roles} instead."
            )
    axes: list[str] = []
    for name in roles:
        overlap = [axis for axis in role(name).axes if axis in axes]
        if overlap:
            raise ValueError(
                f"`{argument}` must name roles that do not overlap, but {roles} share the grid axes {overlap} instead."
            )
        axes.extend(role(name).axes)
    order = next(view.axes for view in VIEWS if set(axes) <= set(view.axes))
    return tuple(axis for axis in order if axis in axes)


@dataclass(frozen=True, eq=False)
class Layout:
    """Where every rank of a root gang sits: one grid of ranks, seen through the views of :data:`gang.roles.VIEWS`.

    The dense view is the row-major grid of ``shape`` over :data:`gang.roles.GRID_AXES`
    (pipeline slowest, tensor parallel fastest). The expert view re-factors the
    ``rdp x sdp x cp x tp`` ranks of one pipeline stage as ``edp x ep x etp`` (``etp`` fastest,
    then ``ep``), again row-major, ``(pp, edp, ep, etp)``; with ``etp`` the tensor parallel size
    (its default) the ``ep`` and ``edp`` gangs are carved from the ``rdp x sdp x cp`` ranks of one
    (pp, tp) position. Every view is a :class:`~gang.topology.Grid` (:attr:`views`), checked to
    agree on the axes they share, and gangs may span axes of several views where those split the
    ranks into nested digits (``edp``, ``ep`` and ``tp`` when ``etp`` is ``tp``). Every query but
    :meth:`groups` (which lists every gang, for a backend that wants them all) costs time in the
    size of its answer, never in the size of the world.

    :param shape: The size of each axis of :data:`gang.roles.GRID_AXES` (``pp, rdp, sdp, cp, tp``).
    :param ep: The expert parallel size.
    :param global_ranks: The global rank of each root-gang rank (``None``: root rank *r* is global
        rank *r*). Held as given, not copied.
    :param etp: The expert tensor parallel size; ``None`` is the tensor parallel size.
        ``ep * etp`` divides ``rdp * sdp * cp * tp``.
    :raises ValueError: If ``shape`` does not have one positive size per axis, ``ep`` or ``etp``
        is not positive, ``ep * etp`` does not divide ``rdp * sdp * cp * tp`` (``ep`` does not
        divide ``rdp * sdp * cp`` when ``etp`` is ``None``), or ``global_ranks`` has the wrong
        length.
    """

    shape: tuple[int, ...]
    ep: int = 1
    global_ranks: Sequence[int] | None = None
    etp: int | None = None

    def __post_init__(self) -> None:
        if len(self.shape) != len(GRID_AXES):
            raise ValueError(f"`shape` must have one size per axis of {GRID_AXES}, but is {self.shape} instead.")
        for axis, size in zip(GRID_AXES, self.shape, strict=True):
            check_int(f"shape[{axis!r}]", size, minimum=1)
        given = self._expert_sizes()
        named = {axis: check_int(axis, size, minimum=1) for axis, size in given.items() if size is not None}
        # An expert size left to its default is a dense role's size, which cancels from both sides.
        stands_for = {
            axis
            for name, size in given.items()
            if size is None and role(AXIS_ROLES[name]).omitted != SIZE_ONE
            for axis in role(str(role(AXIS_ROLES[name]).omitted)).axes
        }
        split = [axis for axis in EXPERT_SPLITS if axis not in stands_for]
        want = prod(self.shape[GRID_AXES.index(axis)] for axis in split)
        if want % prod(named.values()) != 0:
            product = prod(named.values())
            raise ValueError(
                f"`{' * '.join(f'{axis}_size' for axis in named)}` must be a factor of "
                f"`{' * '.join(f'{name}_size' for name in covering(split))}` ({want}), but is "
                f"{' * '.join(map(str, named.values()))}{f' = {product}' if len(named) > 1 else ''} instead."
            )
        if self.global_ranks is not None and len(self.global_ranks) != self.size:
            raise ValueError(
                f"`global_ranks` must have {self.size} ranks (the grid size), but has {len(self.global_ranks)} instead."
            )
        check_views(self.views)

    def _expert_sizes(self) -> dict[str, Any]:
        """The expert axes whose sizes are fields of the layout (all but the derived one), as given."""
        return {axis: getattr(self, axis) for axis in EXPERT_AXES if axis != _EXPERT_VIEW.derived}

    @classmethod
    def of(
        cls, sizes: Mapping[str, int], ep: int = 1, global_ranks: Sequence[int] | None = None, *, etp: int | None = None
    ) -> Layout:
        """The layout whose axes of :data:`gang.roles.GRID_AXES` have ``sizes`` (axes not named have size 1).

        :raises ValueError: If ``sizes`` names an axis that is not a grid axis, or as the constructor.
        """
        unknown = [axis for axis in sizes if axis not in GRID_AXES]
        if unknown:
            raise ValueError(f"`sizes` must name axes of {GRID_AXES}, but names {unknown} instead.")
        return cls(tuple(sizes.get(axis, 1) for axis in GRID_AXES), ep, global_ranks, etp)

    def resized(self, **sizes: int) -> Layout:
        """This layout with the grid axes named in ``sizes`` resized (the expert sizes and global ranks kept)."""
        dense = {**dict(zip(GRID_AXES, self.shape, strict=True)), **sizes}
        return Layout.of(dense, self.ep, self.global_ranks, etp=self.etp)

    @cached_property
    def _sizes(self) -> dict[str, int]:
        sizes = dict(zip(GRID_AXES, self.shape, strict=True))
        for axis, size in self._expert_sizes().items():
            if size is None:  # the table's default: size 1, or the size of the role it stands for
                omitted = role(AXIS_ROLES[axis]).omitted
                size = 1 if omitted == SIZE_ONE else prod(sizes[a] for a in role(str(omitted)).axes)
            sizes[axis] = size
        derived = _EXPERT_VIEW.derived
        if derived is not None:
            others = prod(sizes[axis] for axis in EXPERT_AXES if axis != derived)
            sizes[derived] = prod(sizes[axis] for axis in EXPERT_SPLITS) // others
        return {axis: sizes[axis] for view in VIEWS for axis in view.axes}

    @property
    def sizes(self) -> dict[str, int]:
        """The size of every axis of every view: ``pp, rdp, sdp, cp, tp, edp, ep, etp``."""
        return dict(self._sizes)

    @property
    def size(self) -> int:
        """The number of ranks of the root gang."""
        return prod(self.shape)

    def size_of(self, *roles: str) -> int:
        """The size of the gang that spans ``roles`` at once (see :func:`flattened_axes`)."""
        sizes = self._sizes
        return prod(sizes[axis] for axis in flattened_axes(roles))

    @cached_property
    def views(self) -> dict[str, Grid]:
        """Every view of :data:`gang.roles.VIEWS` by name, as a :class:`~gang.topology.Grid` of its axes."""
        sizes = self._sizes
        return {view.name: Grid(tuple((axis, sizes[axis]) for axis in view.axes)) for view in VIEWS}

    @cached_property
    def _digits(self) -> dict[str, tuple[int, int]]:
        """Every axis of every view as a digit of the root rank, ``(stride, size)`` (views agree on shared ones)."""
        return {axis: digit for grid in self.views.values() for axis, digit in grid.digits().items()}

    def _grid(self, axes: Sequence[str]) -> Grid:
        """The coarsest grid that has ``axes`` (of any views).

        :raises ValueError: If the axes do not form a grid together (a phrase, see :meth:`Grid.spanning`).
        """
        return Grid.spanning(self.size, {axis: self._digits[axis] for axis in axes})

    def coords(self, rank: int) -> dict[str, int]:
        """The index of root rank ``rank`` along every axis of every view.

        :raises ValueError: If ``rank`` is outside ``[0, size)``.
        """
        rank = check_int("rank", rank)
        return {axis: value for grid in self.views.values() for axis, value in grid.coords(rank).items()}

    def submesh(self, rank: int, dims: Sequence[str | Sequence[str]]) -> np.ndarray:
        """The root ranks of the sub-grid through ``rank`` spanned by ``dims``, as an array of shape
        ``[size of dims[0], size of dims[1], ...]``.

        Each entry of ``dims`` names a role or a tuple of roles spanned at once (a flattened
        dimension, see :func:`flattened_axes`); entry *i* indexes axis *i* of the result, and each
        1-D slice through ``rank`` along axis *i* is the gang of ``dims[i]`` that holds ``rank``,
        in its rank order (:meth:`Grid.submesh` of the grid the axes form together). Costs O(size
        of the result).

        :raises ValueError: If a role is unknown, or two dimensions share an axis, or the axes of
            different views do not form a grid (the expert roles with ``rdp``, ``sdp``, ``cp`` or
            ``dp``; or with ``tp`` when ``etp`` is not ``tp``).
        """
        self.coords(rank)
        per_dim = [flattened_axes((dim,) if isinstance(dim, str) else tuple(dim), argument="dims") for dim in dims]
        every = [axis for axes in per_dim for axis in axes]
        if len(set(every)) != len(every):
            raise ValueError(f"`dims` must name dimensions that share no grid axis, but is {list(dims)} instead.")
        try:
            grid = self._grid(every)
        except ValueError as ex:
            raise ValueError(
                f"`dims` must name dimensions that form a grid, but {ex} in {list(dims)} instead."
            ) from None
        return grid.submesh(rank, per_dim)

    def members(self, rank: int, *roles: str) -> list[int]:
        """The root ranks of the gang spanning ``roles`` at once that holds root rank ``rank``, in
        its rank order (the grid's: outer axes vary slowest). O(group size).

        :raises ValueError: As :func:`flattened_axes` and :meth:`coords`.
        """
        axes = flattened_axes(roles)
        members: list[int] = self._grid(axes).submesh(rank, [axes]).tolist()
        return members

    def groups(self, *roles: str) -> np.ndarray:
        """Every gang spanning ``roles`` at once, one row per gang in rank order, rows ordered by
        their smallest rank: a ``[size / group size, group size]`` array of root ranks
        (:meth:`Grid.group_table` of the grid of the axes).

        Enumerates the world (vectorised); only what needs every group (torch's ``split_group``)
        calls it.
        """
        axes = flattened_axes(roles)
        return self._grid(axes).group_table(*axes)

    def describe(self, rank: int, roles: Sequence[str]) -> str:
        """The role and position of the gang spanning ``roles`` through root rank ``rank``, as a person names it.

        ``"tp of pp 1, dp 0"``: the roles, then the index of the gang along every other role of its
        view whose size is above 1 (the dense roles that cover the other dense axes, in table order,
        as :func:`gang.roles.covering` gives them; the expert axes by name), slowest first. The flight
        recorder names gangs so.
        """
        axes = flattened_axes(roles)
        view = next((v for v in VIEWS if set(axes) <= set(v.axes)), VIEWS[0])
        rest = [axis for axis in view.axes if axis not in axes]
        names = [*covering([a for a in rest if a in GRID_AXES]), *(a for a in rest if a not in GRID_AXES)]
        coords, sizes = self.coords(rank), self._sizes
        parts = []
        for name in sorted(names, key=lambda n: view.axes.index(flattened_axes((n,))[0])):
            index = 0
            for axis in flattened_axes((name,)):
                index = index * sizes[axis] + coords[axis]
            if self.size_of(name) > 1:
                parts.append(f"{name} {index}")
        label = " x ".join(roles)
        return f"{label} of {', '.join(parts)}" if parts else label

    def key(self, *roles: str) -> tuple[tuple[int, int], ...]:
        """A name for the partition of the ranks into the gangs spanning ``roles``: equal keys, equal
        gangs in the same rank order (:func:`~gang.topology.partition_key`).

        It does not depend on the view, so roles of different views whose gangs are the same get
        one key: ``etp`` and ``tp`` when ``etp`` is ``tp``, ``ep`` of size 1, or an ``ep`` block that
        is exactly the trailing ``cp``, ``sdp x cp`` or ``tp`` ranks.
        """
        return partition_key([self._digits[axis] for axis in flattened_axes(roles)])


_EXPERT_VIEW = VIEWS[1]


def parallel_layout(
    world_size: int,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    etp_size: int | None = None,
    global_ranks: Sequence[int] | None = None,
) -> Layout:
    """Return the layout of :func:`gang.create_parallel_gangs` (``rdp = dp``, ``sdp`` of size 1).

    :raises ValueError: As :func:`parallel_grid`, or if ``ep_size`` does not divide
        ``dp_size * cp_size`` (``etp_size`` ``None``), or ``ep_size * etp_size`` does not divide
        ``dp_size * cp_size * tp_size``.
    """
    grid = parallel_grid(world_size, tp_size=tp_size, pp_size=pp_size, cp_size=cp_size)
    ep_size = check_int("ep_size", ep_size, minimum=1)
    if etp_size is not None:
        etp_size = check_int("etp_size", etp_size, minimum=1)
    return Layout.of(dict(grid.dims), ep_size, global_ranks, etp=etp_size)


def _check_fields() -> None:
    """The expert sizes a :class:`Layout` holds are the expert axes of the table but the derived one."""
    held = [f.name for f in fields(Layout) if f.name in AXIS_ROLES]
    assert held == [axis for axis in EXPERT_AXES if axis != _EXPERT_VIEW.derived], held


_check_fields()
