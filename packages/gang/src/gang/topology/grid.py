"""The grid engine: a row-major grid of named dimensions over ranks, and views of one grid.

Nothing here knows about roles (:mod:`gang.roles`) or communicates. A :class:`Grid` answers
every question about one factorisation of the ranks (coordinates, the groups of some dimensions,
the sub-grid through a rank, laying gathered coordinates out on it). Several grids over the
same ranks are *views* of one grid when the dimensions they share agree (:func:`check_views`),
and dimensions taken from several views span a grid together when they split the ranks into
nested, disjoint digits (:meth:`Grid.spanning`), as Megatron-Core's ``HyperCommGrid`` views do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

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

    def digits(self) -> dict[str, tuple[int, int]]:
        """Every dimension as a digit of the rank, ``name -> (stride, size)``: the coordinate of rank
        ``r`` along it is ``r // stride % size``. Grids over the same ranks that give a name the same
        digit split the ranks alike along it."""
        return {name: (stride, size) for (name, size), stride in zip(self.dims, self._strides(), strict=True)}

    @classmethod
    def spanning(cls, size: int, digits: Mapping[str, tuple[int, int]]) -> Grid:
        """The coarsest grid of ``size`` ranks with the dimensions ``digits`` (as :meth:`digits` gives
        them, taken from views of one grid), where dimensions of several views meet.

        Its dimensions, slowest first, are the named ones of more than one rank in rank order, with
        a dimension named ``"~i"`` for the digits between and around them, then the size-1 ones.
        Costs O(number of dimensions).

        :raises ValueError: If two named dimensions of more than one rank overlap or do not nest (no
            grid has them both), or one reaches past ``size``. The message is a phrase for the
            caller's sentence.
        """
        wide = sorted((stride, n, name) for name, (stride, n) in digits.items() if n > 1)
        fine: list[tuple[str, int]] = []
        reached, previous = 1, ""
        for stride, n, name in wide:
            if stride < reached:
                raise ValueError(f"{previous!r} and {name!r} split the same ranks")
            if stride % reached != 0:
                raise ValueError(f"{previous!r} and {name!r} do not nest (strides {reached} and {stride})")
            if stride > reached:
                fine.append((f"~{len(fine)}", stride // reached))
            fine.append((name, n))
            reached, previous = stride * n, name
        if size % reached != 0:
            raise ValueError(f"{previous!r} reaches past the {size} ranks")
        if size > reached:
            fine.append((f"~{len(fine)}", size // reached))
        ones = [(name, 1) for name, (_, n) in digits.items() if n == 1]
        return cls(tuple(reversed(fine)) + tuple(ones))

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


def check_views(views: Mapping[str, Grid]) -> None:
    """Check that ``views`` (named grids) are views of one grid: the same number of ranks, and every
    dimension that several of them name is the same digit of the rank (size and stride) in each.

    :raises ValueError: If they are not. The message is a phrase for the caller's sentence.
    """
    seen: dict[str, tuple[str, tuple[int, int]]] = {}
    sizes = {name: grid.size for name, grid in views.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the views span different numbers of ranks {sizes}")
    for view, grid in views.items():
        for name, digit in grid.digits().items():
            first = seen.setdefault(name, (view, digit))
            if first[1] != digit:
                raise ValueError(
                    f"the views {first[0]!r} and {view!r} disagree on {name!r} (stride and size {first[1]} and {digit})"
                )


def partition_key(digits: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """A name for the partition of the ranks into the groups that the ``digits`` (``(stride, size)``
    pairs of views of one grid) span at once: equal names, equal groups, in the same rank order.

    Digits of size 1 are left out and adjacent ones merged, so the name does not depend on the view
    (``ep`` spanning exactly the ``cp`` ranks gets ``cp``'s name).
    """
    merged: list[tuple[int, int]] = []
    for stride, size in sorted(d for d in digits if d[1] > 1):
        if merged and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0], merged[-1][1] * size)
        else:
            merged.append((stride, size))
    return tuple(merged)


__all__ = ["Grid", "check_views", "partition_key"]
