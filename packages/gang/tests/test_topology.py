"""The pure rank arithmetic every package derives its layouts from."""

from __future__ import annotations

import itertools

import pytest

from gang.topology import Grid, infer_grid, parallel_grid, role_spans, sharded_grid


def test_row_major_rank_formula() -> None:
    grid = parallel_grid(48, tp_size=2, pp_size=3, cp_size=2)
    assert grid.names == ("pp", "dp", "cp", "tp") and grid.shape == (3, 4, 2, 2)
    for pp, dp, cp, tp in itertools.product(range(3), range(4), range(2), range(2)):
        rank = ((pp * 4 + dp) * 2 + cp) * 2 + tp  # the SPEC's layout formula
        assert grid.rank({"pp": pp, "dp": dp, "cp": cp, "tp": tp}) == rank
        assert grid.coords(rank) == {"pp": pp, "dp": dp, "cp": cp, "tp": tp}


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
        (lambda: parallel_grid(8, tp_size=4, pp_size=4), ValueError, "`tp_size * cp_size * pp_size`"),
        (lambda: parallel_grid(8, cp_size=3), ValueError, "`cp_size` must be a factor"),
        (lambda: parallel_grid(8, tp_size=True), TypeError, "`tp_size`"),
        (lambda: sharded_grid(8, 3), ValueError, "`intra_node_size`"),
    ],
)
def test_errors(call: object, error: type[Exception], text: str) -> None:
    with pytest.raises(error) as info:
        call()  # type: ignore[operator]
    assert text in str(info.value)


# -- role_spans: the data parallel rules ----------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("pp", "dp", "tp"), {"root": ("pp", "dp", "tp"), "dp": ("dp",), "rdp": ("dp",), "sdp": (), "tp": ("tp",)}),
        (("rdp", "sdp", "tp"), {"dp": ("rdp", "sdp"), "rdp": ("rdp",), "sdp": ("sdp",), "pp": ()}),
        (("sdp", "rdp"), {"dp": ("sdp", "rdp"), "rdp": ("rdp",), "sdp": ("sdp",)}),  # grid order kept
        (("sdp",), {"root": ("sdp",), "dp": ("sdp",), "rdp": (), "sdp": ("sdp",), "tp": (), "pp": ()}),
        (("tp", "rdp"), {"dp": ("rdp",), "rdp": ("rdp",), "sdp": ()}),
        (("tp",), {"dp": (), "rdp": (), "sdp": ()}),
        ((), {"root": (), "dp": (), "tp": ()}),
    ],
)
def test_role_spans(names: tuple[str, ...], expected: dict[str, tuple[str, ...]]) -> None:
    spans = role_spans(names)
    assert list(spans) == ["root", "dp", "rdp", "sdp", "cp", "tp", "pp"]
    for role, span in expected.items():
        assert spans[role] == span, role


@pytest.mark.parametrize(
    ("names", "text"),
    [
        (("dp", "sdp"), "`dp` together with `rdp` or `sdp`"),
        (("rdp", "dp"), "`dp` together with `rdp` or `sdp`"),
        (("dp", "ep"), "['ep']"),
        (("root",), "['root']"),
        (("tp", "tp"), "repeat"),
    ],
)
def test_role_spans_errors(names: tuple[str, ...], text: str) -> None:
    with pytest.raises(ValueError, match="`names`") as info:
        role_spans(names)
    assert text in str(info.value)


def test_role_spans_on_a_grid_give_the_factory_layout() -> None:
    # HSDP with tp: (pp, rdp, sdp, tp) of 16; rank 13 = pp 1, rdp 1, sdp 0, tp 1.
    grid = Grid((("pp", 2), ("rdp", 2), ("sdp", 2), ("tp", 2)))
    gangs = {role: grid.group_of(13, *span) for role, span in role_spans(grid.names).items()}
    assert gangs == {
        "root": list(range(16)),
        "dp": [9, 11, 13, 15],
        "rdp": [9, 13],
        "sdp": [13, 15],
        "cp": [13],
        "tp": [12, 13],
        "pp": [5, 13],
    }


# -- infer_grid: the grid that gathered gangs form ------------------------------------------------


def _gangs_of(grid: Grid, ranks: list[int]) -> dict[int, list[list[int]]]:
    """What each process of a grid placed on ``ranks`` reports: its gang along every dimension."""
    return {ranks[p]: [[ranks[q] for q in grid.group_of(p, name)] for name in grid.names] for p in range(grid.size)}


def test_infer_grid_finds_the_layout() -> None:
    grid = Grid((("rdp", 2), ("sdp", 2), ("tp", 2)))
    members = _gangs_of(grid, list(range(8)))
    for rank in range(8):
        assert infer_grid(grid.names, members, rank) == (grid, tuple(range(8)))


def test_infer_grid_on_ranks_of_part_of_a_world() -> None:
    # One pipeline stage of (pp, sdp, tp) = (2, 2, 2): ranks 4..7 only, or a sliced-out axis
    # (dp, cp, tp) with cp = 1: ranks 2, 3, 6, 7.
    grid = Grid((("sdp", 2), ("tp", 2)))
    for ranks in ([4, 5, 6, 7], [2, 3, 6, 7]):
        members = _gangs_of(grid, ranks)
        assert infer_grid(grid.names, members, ranks[3]) == (grid, tuple(ranks))


def test_infer_grid_transposed_and_disconnected() -> None:
    # ("dp", "tp") with pp = 2 over 8 ranks: two grids, one per stage, each holding its own ranks.
    world = Grid((("pp", 2), ("dp", 2), ("tp", 2)))
    members = {r: [world.group_of(r, "tp"), world.group_of(r, "dp")] for r in range(8)}
    grid, ranks = infer_grid(("tp", "dp"), members, 6)
    assert grid == Grid((("tp", 2), ("dp", 2)))
    assert ranks == (4, 6, 5, 7)  # row-major over (tp, dp): the transposed array
    assert infer_grid(("tp", "dp"), members, 1)[1] == (0, 2, 1, 3)


@pytest.mark.parametrize(
    ("names", "members", "text"),
    [
        # rdp lies inside dp: 4 ranks cannot fill a 4 x 2 grid.
        (
            ("dp", "rdp"),
            {
                0: [[0, 1, 2, 3], [0, 2]],
                1: [[0, 1, 2, 3], [1, 3]],
                2: [[0, 1, 2, 3], [0, 2]],
                3: [[0, 1, 2, 3], [1, 3]],
            },
            "connect 4 ranks",
        ),
        # Two gangs that are the same: ranks 0 and 1 at coordinates (1, 1) and (0, 0) only.
        (("a", "b"), {0: [[0, 1], [0, 1]], 1: [[0, 1], [0, 1]]}, "connect 2 ranks"),
        (("a",), {0: [[0, 1]], 1: [[0, 1, 2]], 2: [[0, 1, 2]]}, "sizes [2] on rank 0 and [3] on rank 1"),
        (("a",), {0: [[0, 1]], 1: [[1, 0]]}, "place ranks 0 and 1 at the same coordinates [0]"),
        # Distinct coordinates, but rank 3's gang along b is not the line through it.
        (
            ("a", "b"),
            {0: [[0, 1], [0, 2]], 1: [[0, 1], [1, 3]], 2: [[2, 3], [0, 2]], 3: [[2, 3], [2, 3]]},
            "the line along 'b' through rank 3 is [1, 3], but the gang along 'b' of rank 3 is [2, 3]",
        ),
        (("a",), {0: [[1, 2]], 1: [[1, 2]], 2: [[1, 2]]}, "without rank 0"),
        (("a",), {0: [[0, 5]]}, "with ranks [5] that reported no gangs"),
        (("a", "b"), {0: [[0]]}, "1 gangs for the 2 dimensions"),
    ],
)
def test_infer_grid_errors(names: tuple[str, ...], members: dict[int, list[list[int]]], text: str) -> None:
    with pytest.raises(ValueError, match="`members` must name gangs that form a grid, but ") as info:
        infer_grid(names, members, 0)
    assert text in str(info.value)
    assert str(info.value).count("instead") == 1, str(info.value)  # One "..., but ... instead." sentence.


def test_infer_grid_names_the_callers_argument_and_checks_rank() -> None:
    with pytest.raises(ValueError, match="`dims` must name gangs that form a grid"):
        infer_grid(("a",), {0: [[0, 1]], 1: [[1, 0]]}, 0, argument="dims")
    with pytest.raises(ValueError, match="`rank` must be a process of `members`"):
        infer_grid(("a",), {0: [[0]]}, 3)
