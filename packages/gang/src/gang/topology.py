"""Pure rank arithmetic: named grids of ranks and the gangs they define.

Nothing in this module communicates or touches ``torch.distributed``. The factories in
:mod:`gang.factories`, the mesh bridge in ``gang_mesh`` and the JAX gang all derive their layouts
from :class:`Grid`, so every package agrees on which rank sits where.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from math import prod

from gang.extend import check_int


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
