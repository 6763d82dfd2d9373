"""The pure rank arithmetic every package derives its layouts from."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gang.topology import Grid, parallel_grid, role_spans, sharded_grid


def test_row_major_rank_formula() -> None:
    grid = parallel_grid(48, tp_size=2, pp_size=3, cp_size=2)
    # The dense view's axes, from the table: the data parallel ranks are all replicated (rdp = dp).
    assert grid.names == ("pp", "rdp", "sdp", "cp", "tp") and grid.shape == (3, 4, 1, 2, 2)
    for pp, dp, cp, tp in itertools.product(range(3), range(4), range(2), range(2)):
        rank = ((pp * 4 + dp) * 2 + cp) * 2 + tp  # the SPEC's layout formula
        assert grid.rank({"pp": pp, "rdp": dp, "sdp": 0, "cp": cp, "tp": tp}) == rank
        assert grid.coords(rank) == {"pp": pp, "rdp": dp, "sdp": 0, "cp": cp, "tp": tp}


def test_groups_partition_the_ranks() -> None:
    grid = Grid((("a", 2), ("b", 3), ("c", 2)))
    for names in [("a",), ("b",), ("c",), ("a", "c"), ("b", "c"), ("a", "b", "c")]:
        groups = grid.groups(*names)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(12)), names
        assert all(len(g) == len(groups[0]) for g in groups)
    assert grid.groups("a", "b", "c") == [list(range(12))]
    assert grid.groups("c", "a") == [[0, 6, 1, 7], [2, 8, 3, 9], [4, 10, 5, 11]]


def test_submesh_and_group_of_are_the_groups_through_a_rank() -> None:
    grid = Grid((("a", 2), ("b", 3), ("c", 2)))
    for rank in range(grid.size):
        mesh = grid.submesh(rank, [("c",), ("a", "b")])
        assert mesh.shape == (2, 6)
        for names in [("a",), ("b", "c"), ("c", "a")]:
            assert grid.group_of(rank, *names) in grid.groups(*names)
            assert rank in grid.group_of(rank, *names)
        here = grid.coords(rank)
        assert mesh[:, here["a"] * 3 + here["b"]].tolist() == grid.group_of(rank, "c")
        assert mesh[here["c"]].tolist() == grid.group_of(rank, "a", "b")


def test_place_lays_gathered_coordinates_out_on_the_grid() -> None:
    grid = Grid((("a", 2), ("b", 3)))
    processes = [5, 0, 3, 1, 4, 2]  # process i sits at grid rank processes[i]
    coords = np.array([[grid.coords(p)["a"], grid.coords(p)["b"]] for p in processes])
    placed = grid.place(coords, np.arange(6) + 100)
    assert [int(placed.reshape(-1)[p]) for p in processes] == [100 + i for i in range(6)]
    with pytest.raises(ValueError, match=r"5 processes are not the 6 of a grid of sizes \[2, 3\]"):
        grid.place(coords[:5], np.arange(5))
    with pytest.raises(ValueError, match="not the 6"):
        grid.place(np.vstack([coords[:5], [[0, 3]]]), np.arange(6))  # b = 3 is outside the grid
    with pytest.raises(ValueError, match=r"two processes have the same coordinates \[0, 0\] along \['a', 'b'\]"):
        grid.place(np.vstack([coords[:5], [[0, 0]]]), np.arange(6))


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
