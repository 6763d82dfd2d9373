"""The pure rank arithmetic every package derives its layouts from."""

from __future__ import annotations

import itertools

import pytest

from gang.topology import Grid, parallel_grid, sharded_grid


def test_row_major_rank_formula() -> None:
    grid = parallel_grid(24, tp_size=2, pp_size=3)
    assert grid.names == ("pp", "dp", "tp") and grid.shape == (3, 4, 2)
    for pp, dp, tp in itertools.product(range(3), range(4), range(2)):
        rank = pp * (4 * 2) + dp * 2 + tp
        assert grid.rank({"pp": pp, "dp": dp, "tp": tp}) == rank
        assert grid.coords(rank) == {"pp": pp, "dp": dp, "tp": tp}


def test_groups_partition_the_ranks() -> None:
    grid = Grid((("a", 2), ("b", 3), ("c", 2)))
    for names in [("a",), ("b",), ("c",), ("a", "c"), ("b", "c"), ("a", "b", "c")]:
        groups = grid.groups(*names)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(12)), names
        assert all(len(g) == len(groups[0]) for g in groups)
    assert grid.groups("a", "b", "c") == [list(range(12))]
    assert grid.groups("c", "a") == [[0, 6, 1, 7], [2, 8, 3, 9], [4, 10, 5, 11]]


def test_sharded_grid() -> None:
    assert sharded_grid(6, None).groups("sdp") == [list(range(6))]
    assert sharded_grid(6, None).groups("rdp") == [[r] for r in range(6)]
    assert sharded_grid(6, 3).groups("rdp") == [[0, 3], [1, 4], [2, 5]]


@pytest.mark.parametrize(
    ("call", "error", "text"),
    [
        (lambda: Grid((("a", 2), ("a", 2))), ValueError, "unique"),
        (lambda: Grid((("a", 0),)), ValueError, "positive"),
        (lambda: Grid((("a", 2.0),)), TypeError, "`int`"),  # type: ignore[arg-type]
        (lambda: Grid((("a", 2),)).groups("b"), ValueError, "`names`"),
        (lambda: Grid((("a", 2),)).groups("a", "a"), ValueError, "repeat"),
        (lambda: Grid((("a", 2),)).coords(2), ValueError, "`rank`"),
        (lambda: Grid((("a", 2),)).rank({"a": 2}), ValueError, "coords"),
        (lambda: Grid((("a", 2),)).rank({"b": 0}), ValueError, "`coords`"),
        (lambda: parallel_grid(8, tp_size=3), ValueError, "`tp_size` must be a factor"),
        (lambda: parallel_grid(8, pp_size=0), ValueError, "`pp_size`"),
        (lambda: parallel_grid(8, tp_size=4, pp_size=4), ValueError, "`tp_size * pp_size`"),
        (lambda: parallel_grid(8, tp_size=True), TypeError, "`tp_size`"),
        (lambda: sharded_grid(8, 3), ValueError, "`intra_node_size`"),
    ],
)
def test_errors(call: object, error: type[Exception], text: str) -> None:
    with pytest.raises(error) as info:
        call()  # type: ignore[operator]
    assert text in str(info.value)
