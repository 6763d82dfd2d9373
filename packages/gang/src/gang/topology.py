"""Pure rank arithmetic: named grids of ranks and the gangs they define.

Nothing in this module communicates or touches ``torch.distributed``. It holds the one grid
engine: :class:`Grid` (a row-major grid of named dimensions: coordinates, the groups of some
dimensions, the sub-grid through a rank, and :meth:`Grid.place`, which lays gathered coordinates
out on it); a :class:`Layout` is the grid of :data:`gang.roles.GRID_AXES` and its expert
factorisation, each a :class:`Grid`. The factories in
:mod:`gang.factories` (through which every kind of gang is split, the JAX gang included) split
gangs along a :class:`Layout` (:func:`parallel_layout`), whose arithmetic is closed-form: a rank's
group along any roles costs the size of that group, never the size of the world. Both mesh bridges
(``gang_mesh`` for torch's ``DeviceMesh``, ``gang_jax`` for JAX's ``Mesh``) build meshes from a
gang's :class:`Layout` (:func:`mesh_dims` checks what they are asked for) and read a mesh with the
same rules: :func:`mesh_roles` gives each dimension's role (the names other libraries use
included), :func:`mesh_spans` which dimensions make up each gang of :class:`~gang.Gangs` (how
``dp`` relates to ``rdp`` and ``sdp``, with :func:`role_spans`), and :func:`mesh_layout` the
:class:`Layout` of the whole mesh. What has no layout finds its grid with :meth:`Grid.place`:
:meth:`Gangs.flatten <gang.Gangs.flatten>` and ``gang_mesh.to_device_mesh`` of gangs without a
layout, from every process's gathered coordinates; ``gang_mesh.from_device_mesh`` reads a mesh as
a :class:`Grid` of its dimensions. The dry run (:func:`gang.testing.dry_run`) goes through the
factories, so through :class:`Layout`.

Vocabulary: a grid's *dimensions* are ``(name, size)`` pairs; when the names are roles of
:class:`~gang.Gangs` (the table in :mod:`gang.roles`) each dimension's groups are that role's
gangs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from math import prod

import numpy as np

from gang.extend import check_int
from gang.roles import (
    ALIASES,
    AXIS_ROLES,
    DENSE_ROLES,
    EXPERT_AXES,
    EXPERT_GRID,
    EXPERT_ROLES,
    EXPERT_SPLITS,
    GRID_AXES,
    ROLE_TABLE,
    ROLES,
    role,
)


@dataclass(frozen=True)
class Grid:
    """A row-major grid of named dimensions over the ranks ``0 .. size - 1``.

    The first dimension varies slowest and the last fastest, so for dimensions ``(("pp", 2),
    ("dp", 2), ("tp", 2))`` the rank at coordinates ``(p, d, t)`` is ``p * 4 + d * 2 + t``.

    :param dims: ``(name, size)`` pairs; names are unique and sizes positive.
    :raises ValueError: If a name repeats or a size is not positive.
    :raises TypeError: If a size is not an ``int``.
    """

    dims: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"`dims` must have unique names, but has {names} instead.")
        for name, size in self.dims:
            if check_int(f"dims[{name!r}]", size) <= 0:
                raise ValueError(f"The size of dimension {name!r} must be positive, but is {size} instead.")

    @property
    def names(self) -> tuple[str, ...]:
        """The dimension names, slowest first."""
        return tuple(name for name, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        """The dimension sizes, slowest first."""
        return tuple(size for _, size in self.dims)

    @property
    def size(self) -> int:
        """The number of ranks in the grid."""
        return prod(self.shape)

    def _strides(self) -> tuple[int, ...]:
        strides = []
        step = 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return tuple(reversed(strides))

    def _check_names(self, names: Sequence[str]) -> None:
        unknown = [name for name in names if name not in self.names]
        if unknown:
            raise ValueError(f"`names` must be dimensions of {self.names}, but has {unknown} instead.")
        if len(set(names)) != len(names):
            raise ValueError(f"`names` must not repeat a dimension, but is {list(names)} instead.")

    def coords(self, rank: int) -> dict[str, int]:
        """Return the coordinate of ``rank`` along every dimension.

        :raises ValueError: If ``rank`` is outside ``[0, size)``.
        """
        if not 0 <= rank < self.size:
            raise ValueError(f"`rank` must be in the range [0, {self.size}), but is {rank} instead.")
        return {name: (rank // stride) % size for (name, size), stride in zip(self.dims, self._strides(), strict=True)}

    def rank(self, coords: Mapping[str, int]) -> int:
        """Return the rank at ``coords`` (every dimension must be given)."""
        if set(coords) != set(self.names):
            raise ValueError(f"`coords` must name exactly {self.names}, but names {sorted(coords)} instead.")
        rank = 0
        for (name, size), stride in zip(self.dims, self._strides(), strict=True):
            index = coords[name]
            if not 0 <= index < size:
                raise ValueError(f"`coords[{name!r}]` must be in the range [0, {size}), but is {index} instead.")
            rank += index * stride
        return rank

    def groups(self, *names: str) -> list[list[int]]:
        """Partition the ranks into the groups spanned by the dimensions ``names``.

        Each group holds the ranks that share their coordinates along every *other* dimension.
        Within a group, ranks are ordered row-major over ``names`` in the order given, so with
        ``names == ("rdp", "sdp")`` the ``sdp`` index varies fastest. Groups are ordered by their
        smallest rank. Vectorised: no Python loop over the ranks.

        :raises ValueError: If a name is unknown or repeated.
        """
        result: list[list[int]] = self.group_table(*names).tolist()
        return result

    def group_table(self, *names: str) -> np.ndarray:
        """:meth:`groups` as a ``[size / group size, group size]`` array (enumerates every rank, vectorised)."""
        self._check_names(names)
        grid = np.arange(self.size, dtype=np.int64).reshape(self.shape)
        fixed = [i for i, name in enumerate(self.names) if name not in names]
        free = [self.names.index(name) for name in names]
        # Fixed coordinates ascend row-major, and so do the groups' smallest ranks (offset 0).
        table: np.ndarray = grid.transpose(fixed + free).reshape(-1, prod(self.shape[i] for i in free))
        return table

    def group_of(self, rank: int, *names: str) -> list[int]:
        """Return the group of :meth:`groups` that holds ``rank``, in O(group size).

        :raises ValueError: If ``rank`` is outside ``[0, size)`` or a name is unknown or repeated.
        """
        self._check_names(names)
        members: list[int] = self.submesh(rank, [names]).tolist()
        return members

    def submesh(self, rank: int, dims: Sequence[Sequence[str]]) -> np.ndarray:
        """The ranks of the sub-grid through ``rank`` spanned by ``dims``, as an array of shape
        ``[size of dims[0], size of dims[1], ...]``.

        Entry *i* of ``dims`` names the dimensions that axis *i* of the result spans at once
        (row-major in the order given); each 1-D slice through ``rank`` along axis *i* is the group
        of :meth:`groups` of ``dims[i]`` that holds ``rank``. Costs O(size of the result).

        :raises ValueError: If ``rank`` is outside ``[0, size)`` or a name is unknown or repeated.
        """
        self._check_names([name for names in dims for name in names])
        coords = self.coords(rank)
        strides = dict(zip(self.names, self._strides(), strict=True))
        sizes = dict(self.dims)
        result = np.full((), rank - sum(coords[name] * strides[name] for names in dims for name in names))
        for names in dims:
            offsets = np.zeros(1, dtype=np.int64)
            for name in names:
                offsets = (offsets[:, None] + np.arange(sizes[name], dtype=np.int64) * strides[name]).reshape(-1)
            result = result[..., None] + offsets
        return result

    def place(self, coords: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Lay ``values`` out on the grid: the array of :attr:`shape` whose entry at ``coords[i]`` is ``values[i]``.

        What finds a grid in gathered coordinates (gangs without a layout) uses it.

        :param coords: An integer array ``[n, len(dims)]``, one row of coordinates per value.
        :param values: The ``n`` values.
        :raises ValueError: If the coordinates do not fill the grid exactly once: a count other than
            :attr:`size`, a coordinate out of range, or two values at the same coordinates. The
            message is a phrase for the caller's sentence.
        """
        coords = np.asarray(coords, dtype=np.int64).reshape(-1, len(self.dims))
        shape = np.asarray(self.shape, dtype=np.int64)
        if len(coords) != self.size or bool(((coords < 0) | (coords >= shape)).any()):
            raise ValueError(f"{len(coords)} processes are not the {self.size} of a grid of sizes {list(self.shape)}")
        positions = np.ravel_multi_index(tuple(coords.T), self.shape)
        unique, counts = np.unique(positions, return_counts=True)
        if len(unique) != self.size:
            twice = np.unravel_index(int(unique[counts > 1][0]), self.shape)
            raise ValueError(
                f"two processes have the same coordinates {[int(c) for c in twice]} along {list(self.names)}"
            )
        placed = np.empty(self.size, dtype=np.asarray(values).dtype)
        placed[positions] = values
        return placed.reshape(self.shape)


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
    ``expert`` grid the expert axes split the second axis of :data:`gang.roles.EXPERT_SPLITS`
    (``sdp = edp x ep``, torchtitan's ``efsdp x ep``) and the ones after it have size 1; ``ep`` is
    its axis and ``edp`` the rest of :data:`gang.roles.EXPERT_SPLITS`.
    """
    axes = _mesh_axes(expert)
    fastest = EXPERT_AXES[-1]

    def fine(name: str) -> tuple[str, ...]:
        row = role(name)
        if row.kind == "root":
            return tuple(a for axis in GRID_AXES for a in axes[axis])
        if row.kind == "dense":
            return tuple(a for axis in row.axes for a in axes[axis])
        if row.axes == (fastest,):
            return (fastest,)
        return tuple(a for axis in EXPERT_SPLITS for a in axes[axis] if a != fastest)

    def placed(name: str) -> str:
        return fine(name)[0] if role(name).kind == "dense" else role(name).axes[0]

    return {row.name: tuple(name for name in names if placed(name) in fine(row.name)) for row in ROLE_TABLE}


def _mesh_axes(expert: bool) -> dict[str, tuple[str, ...]]:
    """What each grid axis is on a mesh: itself, or on an expert mesh ``EXPERT_AXES`` (the second
    split) or nothing (the splits after it, of size 1)."""
    axes: dict[str, tuple[str, ...]] = {axis: (axis,) for axis in GRID_AXES}
    if expert:
        axes[EXPERT_SPLITS[1]] = EXPERT_AXES
        for axis in EXPERT_SPLITS[2:]:
            axes[axis] = ()
    return axes


def parallel_grid(world_size: int, *, tp_size: int = 1, pp_size: int = 1, cp_size: int = 1) -> Grid:
    """Return the ``(pp, dp, cp, tp)`` grid of :func:`gang.create_parallel_gangs`.

    Tensor parallel varies fastest, then context parallel, then data parallel, then pipeline
    parallel: ``rank = ((pp_index * dp_size + dp_index) * cp_size + cp_index) * tp_size + tp_index``.

    :raises ValueError: If a size is not positive or ``tp_size * cp_size * pp_size`` does not
        divide ``world_size``.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    sizes = {"tp_size": tp_size, "pp_size": pp_size, "cp_size": cp_size}
    for name, value in sizes.items():
        sizes[name] = check_int(name, value, minimum=1)
        if world_size % sizes[name] != 0:
            raise ValueError(f"`{name}` must be a factor of the root gang size ({world_size}), but is {value} instead.")
    tp_size, pp_size, cp_size = sizes["tp_size"], sizes["pp_size"], sizes["cp_size"]
    if world_size % (tp_size * cp_size * pp_size) != 0:
        raise ValueError(
            f"`tp_size * cp_size * pp_size` must be a factor of the root gang size ({world_size}), "
            f"but is {tp_size} * {cp_size} * {pp_size} = {tp_size * cp_size * pp_size} instead."
        )
    dp_size = world_size // (tp_size * cp_size * pp_size)
    return Grid((("pp", pp_size), ("dp", dp_size), ("cp", cp_size), ("tp", tp_size)))


def sharded_grid(dp_size: int, intra_node_size: int | None) -> Grid:
    """Return the ``(rdp, sdp)`` grid that splits a data parallel gang of ``dp_size`` ranks.

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
    return Grid((("rdp", dp_size // intra_node_size), ("sdp", intra_node_size)))


# -- layouts: the grid of the factories, in closed form -----------------------------------------


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
    order = EXPERT_AXES if set(axes) <= set(EXPERT_AXES) else GRID_AXES
    return tuple(axis for axis in order if axis in axes)


@dataclass(frozen=True, eq=False)
class Layout:
    """Where every rank of a root gang sits: the grid of :data:`gang.roles.GRID_AXES` in closed form.

    The rank of root-gang rank *r* along each axis follows from the row-major grid of ``shape``
    (pipeline slowest, tensor parallel fastest). The expert roles re-factor the ``rdp x sdp x cp``
    ranks of one (pp, tp) position into ``edp x ep`` (``ep`` fastest), which is again a row-major
    grid, ``(pp, edp, ep, tp)``. Both are :class:`Grid` objects, which answer every query. Every
    query but :meth:`groups` (which lists every gang, for a backend that wants them all) costs time
    in the size of its answer, never in the size of the world.

    :param shape: The size of each axis of :data:`gang.roles.GRID_AXES` (``pp, rdp, sdp, cp, tp``).
    :param ep: The expert parallel size; it divides ``rdp * sdp * cp``.
    :param global_ranks: The global rank of each root-gang rank (``None``: root rank *r* is global
        rank *r*). Held as given, not copied.
    :raises ValueError: If ``shape`` does not have one positive size per axis, or ``ep`` does not
        divide ``rdp * sdp * cp``, or ``global_ranks`` has the wrong length.
    """

    shape: tuple[int, ...]
    ep: int = 1
    global_ranks: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if len(self.shape) != len(GRID_AXES):
            raise ValueError(f"`shape` must have one size per axis of {GRID_AXES}, but is {self.shape} instead.")
        for axis, size in zip(GRID_AXES, self.shape, strict=True):
            check_int(f"shape[{axis!r}]", size, minimum=1)
        check_int("ep", self.ep, minimum=1)
        expert_ranks = prod(self.sizes[axis] for axis in EXPERT_SPLITS)
        if expert_ranks % self.ep != 0:
            raise ValueError(
                f"`ep_size` must be a factor of `dp_size * cp_size` ({expert_ranks}), but is {self.ep} instead."
            )
        if self.global_ranks is not None and len(self.global_ranks) != self.size:
            raise ValueError(
                f"`global_ranks` must have {self.size} ranks (the grid size), but has {len(self.global_ranks)} instead."
            )

    @classmethod
    def of(cls, sizes: Mapping[str, int], ep: int = 1, global_ranks: Sequence[int] | None = None) -> Layout:
        """The layout whose axes of :data:`gang.roles.GRID_AXES` have ``sizes`` (axes not named have size 1).

        :raises ValueError: If ``sizes`` names an axis that is not a grid axis, or as the constructor.
        """
        unknown = [axis for axis in sizes if axis not in GRID_AXES]
        if unknown:
            raise ValueError(f"`sizes` must name axes of {GRID_AXES}, but names {unknown} instead.")
        return cls(tuple(sizes.get(axis, 1) for axis in GRID_AXES), ep, global_ranks)

    def resized(self, **sizes: int) -> Layout:
        """This layout with the grid axes named in ``sizes`` resized (the expert size and global ranks kept)."""
        return Layout.of({**dict(zip(GRID_AXES, self.shape, strict=True)), **sizes}, self.ep, self.global_ranks)

    @property
    def sizes(self) -> dict[str, int]:
        """The size of every axis, dense and expert: ``pp, rdp, sdp, cp, tp, edp, ep``."""
        sizes = dict(zip(GRID_AXES, self.shape, strict=True))
        sizes["ep"] = self.ep
        sizes["edp"] = prod(sizes[axis] for axis in EXPERT_SPLITS) // self.ep
        return sizes

    @property
    def size(self) -> int:
        """The number of ranks of the root gang."""
        return prod(self.shape)

    def size_of(self, *roles: str) -> int:
        """The size of the gang that spans ``roles`` at once (see :func:`flattened_axes`)."""
        sizes = self.sizes
        return prod(sizes[axis] for axis in flattened_axes(roles))

    @cached_property
    def _grids(self) -> tuple[Grid, Grid]:
        """The dense grid (of :data:`gang.roles.GRID_AXES`) and the expert one (of :data:`gang.roles.EXPERT_GRID`)."""
        sizes = self.sizes
        dense, expert = (Grid(tuple((axis, sizes[axis]) for axis in axes)) for axes in (GRID_AXES, EXPERT_GRID))
        return dense, expert

    def _grid(self, axes: Sequence[str]) -> Grid:
        """The factorisation that holds ``axes``: the expert grid if it names an expert axis, else the dense one."""
        dense, expert = self._grids
        return expert if set(axes) & set(EXPERT_AXES) else dense

    def coords(self, rank: int) -> dict[str, int]:
        """The index of root rank ``rank`` along every axis, dense and expert.

        :raises ValueError: If ``rank`` is outside ``[0, size)``.
        """
        rank = check_int("rank", rank)
        dense, expert = self._grids
        return {**dense.coords(rank), **expert.coords(rank)}

    def submesh(self, rank: int, dims: Sequence[str | Sequence[str]]) -> np.ndarray:
        """The root ranks of the sub-grid through ``rank`` spanned by ``dims``, as an array of shape
        ``[size of dims[0], size of dims[1], ...]``.

        Each entry of ``dims`` names a role or a tuple of roles spanned at once (a flattened
        dimension, see :func:`flattened_axes`); entry *i* indexes axis *i* of the result, and each
        1-D slice through ``rank`` along axis *i* is the gang of ``dims[i]`` that holds ``rank``,
        in its rank order (:meth:`Grid.submesh` of the grid's axes). Costs O(size of the result).

        :raises ValueError: If a role is unknown, or two dimensions share a grid axis, or expert
            roles are mixed with ``rdp``, ``sdp``, ``cp`` or ``dp``.
        """
        self.coords(rank)
        per_dim = [flattened_axes((dim,) if isinstance(dim, str) else tuple(dim), argument="dims") for dim in dims]
        every = [axis for axes in per_dim for axis in axes]
        if len(set(every)) != len(every):
            raise ValueError(f"`dims` must name dimensions that share no grid axis, but is {list(dims)} instead.")
        grid = self._grid(every)
        if any(axis not in grid.names for axis in every):
            raise ValueError(
                f"`dims` must not mix the expert roles with `rdp`, `sdp`, `cp` or `dp`, but is {list(dims)} instead."
            )
        return grid.submesh(rank, per_dim)

    def members(self, rank: int, *roles: str) -> list[int]:
        """The root ranks of the gang spanning ``roles`` at once that holds root rank ``rank``, in
        its rank order (the grid's: outer axes vary slowest). O(group size).

        :raises ValueError: As :func:`flattened_axes` and :meth:`coords`.
        """
        flattened_axes(roles)
        members: list[int] = self.submesh(rank, [roles]).tolist()
        return members

    def groups(self, *roles: str) -> np.ndarray:
        """Every gang spanning ``roles`` at once, one row per gang in rank order, rows ordered by
        their smallest rank: a ``[size / group size, group size]`` array of root ranks
        (:meth:`Grid.group_table` of the grid's axes).

        Enumerates the world (vectorised); only what needs every group (torch's ``split_group``)
        calls it.
        """
        axes = flattened_axes(roles)
        return self._grid(axes).group_table(*axes)

    def describe(self, rank: int, roles: Sequence[str]) -> str:
        """The role and position of the gang spanning ``roles`` through root rank ``rank``, as a person names it.

        ``"tp of pp 1, dp 0"``: the roles, then the index along every other axis of size above 1
        (``rdp`` is called ``dp`` when ``sdp`` has size 1). The flight recorder names gangs so.
        """
        axes = flattened_axes(roles)
        sizes, coords = self.sizes, self.coords(rank)
        grid_axes = EXPERT_GRID if set(axes) & set(EXPERT_AXES) else GRID_AXES
        others = [a for a in grid_axes if a not in axes and sizes[a] > 1]
        where = ", ".join(f"{'dp' if a == 'rdp' and sizes['sdp'] == 1 else a} {coords[a]}" for a in others)
        name = " x ".join(roles)
        return f"{name} of {where}" if where else name

    def key(self, *roles: str) -> tuple[str, ...]:
        """A name for the partition of the ranks into the gangs spanning ``roles``: equal keys, equal gangs.

        Axes of size 1 are left out, and an expert partition that equals a dense one (``ep`` of
        size 1, or an ``ep`` block that is exactly the trailing ``cp``, ``sdp x cp`` or
        ``rdp x sdp x cp`` ranks) gets the dense key.
        """
        axes = flattened_axes(roles)
        sizes = self.sizes
        if set(axes) & set(EXPERT_AXES):
            suffix = 1
            inner = EXPERT_SPLITS
            for i in range(len(inner), -1, -1):
                if i < len(inner):
                    suffix *= sizes[inner[i]]
                if suffix == self.ep:  # ep spans inner[i:], edp spans inner[:i]
                    dense = inner[i:] if "ep" in axes else inner[:i]
                    rest = [axis for axis in axes if axis not in EXPERT_AXES]
                    axes = tuple(axis for axis in GRID_AXES if axis in dense or axis in rest)
                    break
        return tuple(axis for axis in axes if sizes[axis] > 1)


def parallel_layout(
    world_size: int,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    global_ranks: Sequence[int] | None = None,
) -> Layout:
    """Return the layout of :func:`gang.create_parallel_gangs` (``rdp = dp``, ``sdp`` of size 1).

    :raises ValueError: As :func:`parallel_grid`, or if ``ep_size`` does not divide ``dp_size * cp_size``.
    """
    grid = parallel_grid(world_size, tp_size=tp_size, pp_size=pp_size, cp_size=cp_size)
    sizes = dict(grid.dims)
    ep_size = check_int("ep_size", ep_size, minimum=1)
    sizes["rdp"] = sizes.pop("dp")  # rdp = dp, sdp of size 1
    return Layout.of(sizes, ep_size, global_ranks)


# -- meshes: what both mesh bridges (torch's DeviceMesh, JAX's Mesh) share ---------------------------

MESH_ROLES: tuple[str, ...] = DENSE_ROLES + EXPERT_ROLES
"""The gang roles a mesh dimension can play."""

MESH_ALIASES: dict[str, str] = {alias.name: alias.role for alias in ALIASES}
"""Mesh dimension names other libraries use (torchtitan, Megatron-Core) and the role each plays
(from :data:`gang.roles.ALIASES`)."""

_FOLDS_CP = frozenset(alias.name for alias in ALIASES if alias.folds_cp)

MeshDim = str | tuple[str, ...]
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
    dense = [axes[axis] for axis in EXPERT_SPLITS if axis in axes]
    if expert and dense:
        others = " and ".join(f"`{AXIS_ROLES[axis]}`" for axis in GRID_AXES if axis not in EXPERT_SPLITS)
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
    folded = [name for name in dim_names if name in _FOLDS_CP and name not in names]
    if folded and "cp" in roles:
        raise ValueError(
            f"`mesh` must not have a `cp` dimension next to {folded[0]!r}, which has context parallel folded in, "
            f"but its dimensions are {dim_names} instead."
        )
    return roles


def mesh_spans(roles: Sequence[str], dim_names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Which dimensions, by role, make up each gang of :class:`~gang.Gangs` read from a mesh.

    ``roles`` are the roles of the mesh's dimensions (:func:`mesh_roles`). Dense meshes follow
    :func:`role_spans`; without expert dimensions ``ep`` has size 1 and ``edp`` spans ``dp`` and
    ``cp``. On an expert mesh (``ep`` or ``edp``, with ``pp``, ``rdp`` and ``tp`` only) ``edp``
    spans every data parallel dimension but ``ep``, ``dp`` spans ``rdp``, ``edp`` and ``ep``, and
    ``sdp`` spans ``edp`` and ``ep``. ``()`` means a gang of size 1.

    :param dim_names: The mesh's dimension names, for error messages.
    :raises ValueError: If the roles do not fit together (``dp`` with ``rdp`` or ``sdp``; an expert
        role with ``dp``, ``sdp`` or ``cp``).
    """
    roles = list(roles)
    expert = [name for name in roles if name in EXPERT_ROLES]
    try:
        if expert:
            split = _mesh_axes(expert=True)
            clash = [
                name
                for name in roles
                if role(name).kind == "dense" and any(split[axis] != (axis,) for axis in role(name).axes)
            ]
            if clash:
                raise ValueError(
                    f"the expert roles re-factor the data and context parallel ranks, so {expert[0]!r} cannot come "
                    f"with {clash[0]!r}"
                )
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
    make ``sdp`` with ``ep`` expert parallel. The root ranks are the mesh's positions in grid
    order: transposing the mesh's array by the returned ``order`` and flattening it lists them,
    so the layout's gang of each role is the line of the mesh along its dimensions, in their
    order (for ``dp`` spanning ``rdp`` and ``sdp``, ``rdp`` slowest).

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
    layout = Layout(tuple(size(AXIS_ROLES[axis]) for axis in GRID_AXES), size(AXIS_ROLES["ep"]))
    return layout, order
