"""The pure arithmetic of gang.bench: bandwidths, medians, percentiles, slowest rank, the JSON row format, the
tables, the expected values that `#wrong` checks results against, and the modules' import graph."""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path

import pytest
import torch

from gang.bench import cases as bcases
from gang.bench import collectives as bc
from gang.bench import metrics as bm
from gang.bench import traffic as bt


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


def test_mean_and_percentiles() -> None:
    assert bm.mean([1.0, 2.0, 6.0]) == 3.0
    data = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert bm.percentile(data, 50) == bm.median(data) == 3.0
    assert (bm.percentile(data, 0), bm.percentile(data, 100)) == (1.0, 5.0)
    # NumPy's linear method: position 0.95 * 4 = 3.8 lies between 4.0 and 5.0.
    assert bm.percentile(data, 95) == pytest.approx(4.8)
    assert bm.percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError, match="empty"):
        bm.mean([])
    with pytest.raises(ValueError, match="`q` must be in"):
        bm.percentile(data, 101)


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
    rows[0].update(mean_us=2.5, p95_us=4.0, wrong=0)
    rows[1].update(wrong=3)  # no mean or p95 (an older row): the median stands in
    line = bm.table_line(64, {r["impl"]: r for r in rows[:2]}, ["torch", "gang"])
    torch_cols = ["2.5", "2.0", "4.0", "0.0320", "0.0320", "0"]
    assert line.split() == ["64", "16", "float", *torch_cols, "3.0", "3.0", "3.0", "0.0213", "0.0213", "3", "1.500"]
    assert bm.total_wrong(rows) == 3
    header = bm.table_header("all_reduce", 2, ["torch", "gang"], "gloo").splitlines()
    assert header[-1].split() == ["#", "size", "count", "type", *bm.TIME_COLUMNS * 2, "gang/torch"]
    assert "all_reduce on tp gangs of 2 ranks" in bm.table_header("all_reduce", 2, ["gang"], "gloo", "tp")


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


def _collective(op: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What every rank must get: the collective computed from every rank's input (SUM, source 0)."""
    n = len(inputs)
    if op == "all_reduce":
        return [torch.stack(inputs).sum(0).to(inputs[0].dtype)] * n
    if op == "reduce_scatter":
        total = torch.stack(inputs).sum(0).to(inputs[0].dtype)
        return [total[r] for r in range(n)]
    if op == "all_gather":
        return [torch.stack(inputs)] * n
    if op == "all_to_all":
        return [torch.stack([inputs[i][r] for i in range(n)]) for r in range(n)]
    return [inputs[0]] * n


@pytest.mark.parametrize("dtype", list(bc.DTYPES.values()), ids=list(bc.DTYPES))
@pytest.mark.parametrize("size", [1, 3, 8])
def test_reference_inputs_give_the_expected_results(dtype: torch.dtype, size: int) -> None:
    for op in bm.OPS:
        numel = bc.numel_for(300, size, op, dtype.itemsize)
        pairs = [bcases.reference(op, rank, size, numel, dtype) for rank in range(size)]
        results = _collective(op, [inp for inp, _ in pairs])
        for rank, (result, (inp, expected)) in enumerate(zip(results, pairs, strict=True)):
            assert result.dtype == expected.dtype == dtype
            assert bcases.count_wrong(result, expected) == 0, (op, rank)
            if size > 1 and op != "all_reduce":
                # Data from the wrong rank (or a rank that kept its own input) is caught.
                other = results[(rank + 1) % size] if op in ("reduce_scatter", "all_to_all") else None
                stale = inp if op == "broadcast" and rank > 0 else other
                if stale is not None:
                    assert bcases.count_wrong(stale, expected) > 0, (op, rank)


def test_a_case_counts_its_wrong_elements() -> None:
    # A one-rank "collective" that copies its input: right, then corrupted by the seam, then wrong.
    source, expected = bcases.reference("all_gather", 0, 1, 5)
    inp, out = source.clone(), torch.zeros(1, 5)
    runs: list[int] = []

    def run() -> None:
        runs.append(1)
        out[0].copy_(inp)

    def reset() -> None:
        inp.copy_(source)

    case = bcases.Case(run, reset, lambda: out, expected)
    inp.fill_(-1)  # what the timed iterations left behind: refilled before the checked call
    assert case.check() == 0 and len(runs) == 1
    assert case.check(corrupt=True) == 1 and bcases.count_wrong(out, expected) == 0
    assert bcases.count_wrong(out[:, :4], expected) == 5  # a result of the wrong shape is all wrong
    out_of_place = bcases.Case(lambda: None, lambda: None, lambda: torch.zeros(1, 5), expected)
    assert out_of_place.check() == int((expected != 0).sum()) > 0


@pytest.mark.parametrize("size", [1, 2, 3, 8])
@pytest.mark.parametrize("numel", [1, 7, 1000])
def test_skewed_exchange_expects_what_every_rank_sends(size: int, numel: int) -> None:
    splits = bt.skewed_splits(size, numel)
    assert sum(splits) == numel and min(splits) >= 0 and splits[0] == max(splits)
    if size > 1 and numel >= 1000:  # rank 0 is the hot one: 3 * size shares of 4 * size - 1
        assert splits[0] >= numel * 3 * size // (4 * size - 1) > splits[1]
    data = [bt._uneven_data(rank, size, numel, torch.float32) for rank in range(size)]
    for rank, (_, expected, _, out_splits) in enumerate(data):
        # What the ranks send this rank, in rank order: the exchange all_to_all_single performs.
        blocks = []
        for inp, _, in_splits, _ in data:
            offsets = [sum(in_splits[:j]) for j in range(size)]
            blocks.append(inp[offsets[rank] : offsets[rank] + in_splits[rank]])
        assert [len(b) for b in blocks] == out_splits
        assert bcases.count_wrong(torch.cat(blocks), expected) == 0
        if size > 1 and len(expected):  # a block from the wrong rank is caught
            wrong = torch.cat(blocks[1:] + blocks[:1])
            assert bcases.count_wrong(wrong, expected) > 0 or splits[rank] == 0


def _bench_imports() -> dict[str, set[str]]:
    """The ``gang.bench`` modules each module of ``gang.bench`` imports, at its top or inside a function."""
    folder = Path(bc.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "gang.bench":
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gang.bench."):
                found.add((node.module or "").removeprefix("gang.bench."))
            elif isinstance(node, ast.Import):
                found.update(a.name.removeprefix("gang.bench.") for a in node.names if a.name.startswith("gang.bench."))
        graph[path.stem] = found - {path.stem}
    return graph


def test_bench_modules_import_no_cycle() -> None:
    """No module of gang.bench imports, even lazily, a module that imports it back (directly or through others)."""
    graph = _bench_imports()
    assert graph["collectives"] >= {"cases", "traffic"} and "collectives" not in graph["traffic"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or reaches(nxt, goal, seen | {nxt}) for nxt in graph.get(start, set()) - seen)

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert not cycles, f"import cycles through {cycles}: {graph}"


@pytest.mark.parametrize("count", [1, 2, 4, 5])
def test_call_order_lets_each_call_follow_either_neighbour_equally_often(count: int) -> None:
    iterations = 2 * count * 3
    follows: dict[tuple[int, int], int] = {}
    for it in range(iterations):
        order = bc.call_order(it, count)
        assert sorted(order) == list(range(count))
        for before, after in itertools.pairwise(order):
            follows[(before, after)] = follows.get((before, after), 0) + 1
    for i in range(count):
        j = (i + 1) % count
        if i != j:
            assert follows.get((i, j), 0) == follows.get((j, i), 0) > 0, (i, j, follows)
