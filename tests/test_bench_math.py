"""The pure arithmetic of the benchmarks: bandwidths, medians, slowest rank and the JSON row format."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "benchmath.py"
    spec = importlib.util.spec_from_file_location("benchmath_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bm = _load()


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
    line = bm.table_line("all_reduce", 64, {r["impl"]: r for r in rows[:2]})
    assert "1.500" in line


def test_paired_ratio_is_preferred() -> None:
    # Iteration 1 was disturbed for both implementations; the per-iteration ratios stay at 1.1.
    assert bm.paired_ratio([1.1, 11.0, 2.2], [1.0, 10.0, 2.0]) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="one length"):
        bm.paired_ratio([1.0], [1.0, 2.0])
    rows = [bm.make_row("torch", "broadcast", 64, 2, 2e-6), bm.make_row("gang", "broadcast", 64, 2, 3e-6)]
    rows[1]["paired_ratio"] = 1.01
    assert bm.ratio_table(rows, "gang", "torch") == {("broadcast", 2, 64): pytest.approx(1.01)}
