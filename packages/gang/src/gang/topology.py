"""Pure rank arithmetic: named grids of ranks and the gangs they define.

Nothing in this module communicates or touches ``torch.distributed``. Every layout in the
monorepo comes from :class:`Grid`, so every package agrees on which rank sits where: the factories
in :mod:`gang.factories` (through which every kind of gang is split, the JAX gang included) split
gangs along :func:`parallel_grid` and :func:`sharded_grid`; the mesh bridge ``gang_mesh`` checks
gathered gangs against the grid :func:`infer_grid` finds in them and reads a mesh as a
:class:`Grid`; and :func:`role_spans` says, for all of them, which grid dimensions make up each
gang of :class:`~gang.Gangs` (how ``dp`` relates to ``rdp`` and ``sdp``).

Vocabulary: a grid's *dimensions* are ``(name, size)`` pairs; when the names are roles of
:class:`~gang.Gangs` (``dp``, ``rdp``, ``sdp``, ``tp``, ``pp``) each dimension's groups are that
role's gangs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from math import prod

from gang.extend import ROLES, check_int


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
        smallest rank.

        :raises ValueError: If a name is unknown or repeated.
        """
        self._check_names(names)
        fixed = [name for name in self.names if name not in names]
        sizes = dict(self.dims)
        groups = []
        for fixed_coords in product(*(range(sizes[name]) for name in fixed)):
            base = dict(zip(fixed, fixed_coords, strict=True))
            group = [
                self.rank({**base, **dict(zip(names, free, strict=True))})
                for free in product(*(range(sizes[name]) for name in names))
            ]
            groups.append(group)
        return sorted(groups, key=lambda g: min(g))

    def group_of(self, rank: int, *names: str) -> list[int]:
        """Return the group of :meth:`groups` that holds ``rank``."""
        for group in self.groups(*names):
            if rank in group:
                return group
        raise ValueError(f"`rank` must be in the range [0, {self.size}), but is {rank} instead.")


DIMENSION_ROLES = ROLES[1:]
"""The roles of :class:`~gang.Gangs` that can name a grid dimension (``root`` spans the grid)."""


def role_spans(names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Return, for every role of :class:`~gang.Gangs`, the dimensions of a grid whose groups are its gangs.

    ``names`` are the dimension names of a grid, each a role of :data:`DIMENSION_ROLES`. The
    result maps ``root``, ``dp``, ``rdp``, ``sdp``, ``tp`` and ``pp`` (in that order) to names
    from ``names``, in grid order; ``()`` means a gang of size 1. The data parallel rules:

    * ``root`` spans every dimension, ``tp`` and ``pp`` their own or none;
    * with a ``dp`` dimension, ``rdp`` is ``dp`` and ``sdp`` has size 1 (ready for DDP, as
      :func:`gang.create_parallel_gangs` builds);
    * otherwise ``dp`` spans whichever of ``rdp`` and ``sdp`` the grid has: ``rdp`` times ``sdp``
      when it has both (hybrid sharding), the one it has, or nothing.

    :raises ValueError: If a name is not a role of :data:`DIMENSION_ROLES`, a name repeats, or
        ``dp`` comes with ``rdp`` or ``sdp`` (``dp`` is their product).
    """
    unknown = [name for name in names if name not in DIMENSION_ROLES]
    if unknown:
        raise ValueError(f"`names` must be roles {DIMENSION_ROLES}, but has {unknown} instead.")
    if len(set(names)) != len(names):
        raise ValueError(f"`names` must not repeat a role, but is {tuple(names)} instead.")

    def span(*roles: str) -> tuple[str, ...]:
        return tuple(name for name in names if name in roles)

    if "dp" in names:
        if "rdp" in names or "sdp" in names:
            raise ValueError(
                f"`names` must not hold `dp` together with `rdp` or `sdp` (dp is their product), "
                f"but is {tuple(names)} instead."
            )
        dp, rdp, sdp = span("dp"), span("dp"), span()
    else:
        dp, rdp, sdp = span("rdp", "sdp"), span("rdp"), span("sdp")
    return {"root": tuple(names), "dp": dp, "rdp": rdp, "sdp": sdp, "tp": span("tp"), "pp": span("pp")}


def infer_grid(
    names: Sequence[str], members: Mapping[int, Sequence[Sequence[int]]], rank: int, *, argument: str = "members"
) -> tuple[Grid, tuple[int, ...]]:
    """Find the grid that the gangs of several processes form, and return the one that holds ``rank``.

    ``members[r][i]`` lists, in gang rank order, the ranks of process ``r``'s gang along dimension
    ``names[i]``; ``members`` holds every process that takes part (ranks need not be contiguous:
    they may be global ranks of part of a world). A process's coordinate along dimension *i* is
    its rank in that gang. Processes that reach one another through gang members form one grid;
    several disconnected grids (one per pipeline stage, say) are fine.

    Every process is checked, not only the grids that hold ``rank``, so processes that call this on
    the same data reach the same verdict.

    :param argument: The caller's name for the gangs, used in error messages (``"`dims` must
        name gangs that form a grid, but ... instead."``).
    :returns: The grid holding ``rank`` (dimensions ``names`` with the gangs' sizes) and its ranks
        in grid order: ``ranks[i]`` is the rank at grid rank ``i``, so the gang of rank ``r`` along
        ``names[i]`` is ``[ranks[p] for p in grid.group_of(ranks.index(r), names[i])]``.
    :raises ValueError: If ``rank`` is not in ``members``, a gang does not hold its own process or
        holds a rank outside ``members``, or the gangs do not form grids: the sizes differ within a
        grid, two processes share coordinates, a grid is not full, or a line of the grid through a
        process is not that process's gang.
    """
    names = tuple(names)
    if rank not in members:
        raise ValueError(f"`rank` must be a process of `members` {sorted(members)}, but is {rank} instead.")
    try:
        for r, gangs in members.items():
            if len(gangs) != len(names):
                raise _NotAGridError(f"rank {r} has {len(gangs)} gangs for the {len(names)} dimensions {names}")
            for name, gang in zip(names, gangs, strict=True):
                if r not in gang:
                    raise _NotAGridError(f"the gang along {name!r} of rank {r} is {list(gang)}, without rank {r}")
                outside = [q for q in gang if q not in members]
                if outside:
                    raise _NotAGridError(
                        f"the gang along {name!r} of rank {r} is {list(gang)}, with ranks {outside} "
                        "that reported no gangs (they are not among the processes)"
                    )
        placed = [_place(names, members, component) for component in _components(members)]
    except _NotAGridError as ex:
        raise ValueError(f"`{argument}` must name gangs that form a grid, but {ex} instead.") from None
    return next((grid, ranks) for grid, ranks in placed if rank in ranks)


class _NotAGridError(Exception):
    """Why gangs do not form a grid (a phrase :func:`infer_grid` puts into its ``ValueError``)."""


def _components(members: Mapping[int, Sequence[Sequence[int]]]) -> list[list[int]]:
    """The sets of processes that reach one another through gang members, each sorted."""
    seen: set[int] = set()
    components = []
    for start in sorted(members):
        if start in seen:
            continue
        seen.add(start)
        found, frontier = [start], [start]
        while frontier:
            for gang in members[frontier.pop()]:
                for q in gang:
                    if q not in seen:
                        seen.add(q)
                        found.append(q)
                        frontier.append(q)
        components.append(sorted(found))
    return components


def _place(
    names: tuple[str, ...], members: Mapping[int, Sequence[Sequence[int]]], component: Iterable[int]
) -> tuple[Grid, tuple[int, ...]]:
    """Lay the processes of one component out as a grid and check every gang against it."""
    component = list(component)
    first = component[0]
    grid = Grid(tuple((name, len(gang)) for name, gang in zip(names, members[first], strict=True)))
    ranks: list[int | None] = [None] * grid.size
    for r in component:
        shape = tuple(len(gang) for gang in members[r])
        if shape != grid.shape:
            raise _NotAGridError(
                f"the gangs along {names} have sizes {list(grid.shape)} on rank {first} and {list(shape)} on rank {r}"
            )
        coords = {name: list(gang).index(r) for name, gang in zip(names, members[r], strict=True)}
        position = grid.rank(coords)
        other = ranks[position]
        if other is not None:
            raise _NotAGridError(
                f"the gangs along {names} place ranks {other} and {r} at the same coordinates "
                f"{list(coords.values())} (do two of them overlap?)"
            )
        ranks[position] = r
    if len(component) != grid.size:
        raise _NotAGridError(
            f"the gangs along {names} of sizes {list(grid.shape)} connect {len(component)} ranks {component}, "
            f"not the {grid.size} of a full grid"
        )
    placed = tuple(r for r in ranks if r is not None)
    # Every line of the grid must be, on each of its processes, exactly that process's gang.
    for i, name in enumerate(names):
        for group in grid.groups(name):
            line = [placed[p] for p in group]
            for r in line:
                if list(members[r][i]) != line:
                    raise _NotAGridError(
                        f"the line along {name!r} through rank {r} is {line}, but the gang along {name!r} "
                        f"of rank {r} is {list(members[r][i])}"
                    )
    return grid, placed


def parallel_grid(world_size: int, *, tp_size: int = 1, pp_size: int = 1) -> Grid:
    """Return the ``(pp, dp, tp)`` grid of :func:`gang.create_parallel_gangs`.

    Tensor parallel varies fastest, then data parallel, then pipeline parallel:
    ``rank = pp_index * (dp_size * tp_size) + dp_index * tp_size + tp_index``.

    :raises ValueError: If a size is not positive or ``tp_size * pp_size`` does not divide
        ``world_size``.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    pp_size = check_int("pp_size", pp_size, minimum=1)
    if world_size % tp_size != 0:
        raise ValueError(f"`tp_size` must be a factor of the root gang size ({world_size}), but is {tp_size} instead.")
    if world_size % pp_size != 0:
        raise ValueError(f"`pp_size` must be a factor of the root gang size ({world_size}), but is {pp_size} instead.")
    if world_size % (tp_size * pp_size) != 0:
        raise ValueError(
            f"`tp_size * pp_size` must be a factor of the root gang size ({world_size}), "
            f"but is {tp_size * pp_size} instead."
        )
    dp_size = world_size // (tp_size * pp_size)
    return Grid((("pp", pp_size), ("dp", dp_size), ("tp", tp_size)))


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
