"""The pure arithmetic of gang.bench: bandwidths, medians, slowest rank, the JSON row format, the tables."""

from __future__ import annotations

import json

import pytest

from gang.bench import metrics as bm


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 4, 1.5),
        ("all_reduce", 2, 1.0),
        ("all_reduce", 1, 0.0),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 8, 0.875),
        ("all_to_all", 2, 0.5),
        ("broadcast", 4, 1.0),
    ],
)
def test_bus_factor(op: str, n: int, factor: float) -> None:
    assert bm.bus_factor(op, n) == pytest.approx(factor)


def test_bus_factor_rejects_unknown_op_and_bad_size() -> None:
    with pytest.raises(ValueError, match="op"):
        bm.bus_factor("gather", 2)
    with pytest.raises(ValueError, match="world_size"):
        bm.bus_factor("all_reduce", 0)


def test_bandwidths() -> None:
    # 1 GB in 0.5 s is 2 GB/s; an all-reduce on 4 ranks moves 2 * 3/4 of it over the bus.
    assert bm.algbw_gbps(10**9, 0.5) == pytest.approx(2.0)
    assert bm.busbw_gbps("all_reduce", 10**9, 0.5, 4) == pytest.approx(3.0)
    assert bm.busbw_gbps("broadcast", 10**9, 0.5, 4) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="seconds"):
        bm.algbw_gbps(1, 0.0)


def test_median_and_slowest_rank() -> None:
    assert bm.median([3.0, 1.0, 2.0]) == 2.0
    assert bm.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError, match="empty"):
        bm.median([])
    # Iteration 0 was slowest on rank 1, iteration 1 on rank 0.
    assert bm.slowest_rank([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]
    assert bm.median(bm.slowest_rank([[1.0, 5.0, 1.0], [2.0, 3.0, 9.0]])) == 5.0
    with pytest.raises(ValueError, match="same number"):
        bm.slowest_rank([[1.0], [1.0, 2.0]])


def test_row_format() -> None:
    row = bm.make_row("gang", "all_gather", 1 << 20, 4, 1e-3, iters=10)
    assert list(row)[: len(bm.ROW_KEYS)] == list(bm.ROW_KEYS)
    assert row["impl"] == "gang" and row["op"] == "all_gather" and row["bytes"] == 1 << 20
    assert row["world_size"] == 4 and row["iters"] == 10
    assert row["time_us"] == pytest.approx(1000.0)
    assert row["algbw_gbps"] == pytest.approx((1 << 20) / 1e-3 / 1e9)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 0.75)
    json.loads(json.dumps(row))  # plain JSON types only
    other = bm.make_row("gang", "create_groups", 0, 8, 0.02)
    assert other["algbw_gbps"] is None and other["busbw_gbps"] is None


def test_ratio_table_and_sizes() -> None:
    rows = [
        bm.make_row("torch", "all_reduce", 64, 2, 2e-6),
        bm.make_row("gang", "all_reduce", 64, 2, 3e-6),
        bm.make_row("gang", "all_reduce", 128, 2, 3e-6),  # no baseline: left out
    ]
    assert bm.ratio_table(rows, "gang", "torch") == {("all_reduce", 2, 64): pytest.approx(1.5)}
    assert bm.format_size(4) == "4 B"
    assert bm.format_size(64 << 10) == "64 KiB"
    assert bm.format_size(3 << 19) == "1.5 MiB"
    line = bm.table_line(64, {r["impl"]: r for r in rows[:2]}, ["torch", "gang"])
    assert line.split() == ["64", "16", "float", "2.0", "0.0320", "0.0320", "3.0", "0.0213", "0.0213", "1.500"]
    header = bm.table_header("all_reduce", 2, ["torch", "gang"], "gloo").splitlines()
    assert header[-1].split() == ["#", "size", "count", "type", *["time(us)", "algbw", "busbw"] * 2, "gang/torch"]


def test_paired_ratio_is_preferred() -> None:
    # Iteration 1 was disturbed for both implementations; the per-iteration ratios stay at 1.1.
    assert bm.paired_ratio([1.1, 11.0, 2.2], [1.0, 10.0, 2.0]) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="one length"):
        bm.paired_ratio([1.0], [1.0, 2.0])
    rows = [bm.make_row("torch", "broadcast", 64, 2, 2e-6), bm.make_row("gang", "broadcast", 64, 2, 3e-6)]
    rows[1]["paired_ratio"] = 1.01
    assert bm.ratio_table(rows, "gang", "torch") == {("broadcast", 2, 64): pytest.approx(1.01)}


def test_parse_size() -> None:
    assert [bm.parse_size(t) for t in ("4", "64K", "64KiB", "16M", "1G", "2b")] == [
        4,
        64 << 10,
        64 << 10,
        16 << 20,
        1 << 30,
        2,
    ]
    for bad in ("", "K", "-4", "0", "4X", "1.5M"):
        with pytest.raises(ValueError, match="size"):
            bm.parse_size(bad)


def test_summary_reports_the_smallest_message_per_collective() -> None:
    rows = []
    for op, nbytes in (("all_reduce", 4), ("all_reduce", 1 << 20), ("all_gather", 8)):
        rows += [bm.make_row("torch", op, nbytes, 2, 1e-4), bm.make_row("gang", op, nbytes, 2, 1e-4)]
        rows[-1]["paired_ratio"] = {4: 1.01, 8: 1.03}.get(nbytes, 0.99)
    lines = bm.summary(rows)
    assert lines[0] == "gang/torch on 2 ranks: median < 64 KiB 1.020, >= 64 KiB 0.990, worst 1.030 (all_gather 8 B)"
    assert lines[1].split(": ", 1)[1] == "all_reduce 1.010 (4 B), all_gather 1.030 (8 B)"
