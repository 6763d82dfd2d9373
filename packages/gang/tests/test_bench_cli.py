"""``python -m gang.bench`` end to end: it starts its own local processes, prints the tables and writes the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gang.bench.__main__ import main, without_nproc
from gang.bench.metrics import OPS, ROW_KEYS, TIME_COLUMNS, TRAFFIC_OPS


def test_bench_on_two_local_processes(tmp_path: Path) -> None:
    # The tp gang of a layout (here every rank), with one result element corrupted through the
    # test-only seam: `#wrong` counts it, every other result is right, and the exit status says so.
    out = tmp_path / "r.json"
    command = [sys.executable, "-m", "gang.bench", "--nproc", "2", "--sizes", "4", "1K", "--iters", "3"]
    command += ["--no-jax", "--gang", "tp", "--tp", "2", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GANG_BENCH_CORRUPT="gang:all_gather")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    # Progress goes to stderr (rank 0 only), one line per collective when it is not a terminal.
    progress = [line for line in done.stderr.splitlines() if line.startswith("[gang.bench]")]
    assert [line.split()[2] for line in progress[:-1]] == list(OPS), done.stderr
    assert progress[-1].startswith("[gang.bench] done in")
    # One nccl-tests-style table per collective, with a busbw column per implementation and the ratio.
    lines = done.stdout.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("#") and "size" in line and "busbw" in line]
    assert len(headers) == len(OPS), done.stdout
    for i in headers:
        assert lines[i - 2].startswith("# ") and "on tp gangs of 2 ranks" in lines[i - 2]
        names = lines[i].split()
        assert names == ["#", "size", "count", "type", *TIME_COLUMNS * 2, "gang/torch"]
        first, second = lines[i + 1].split(), lines[i + 2].split()
        assert len(first) == len(second) == len(names) - 1
        assert int(first[0]) < int(second[0]) and first[2] == "float"
        wrong = 1 if "all_gather" in lines[i - 2] else 0
        assert [int(first[8]), int(second[8])] == [0, 0] and [int(first[14]), int(second[14])] == [wrong] * 2
    assert any(line.startswith("gang/torch on 2 ranks:") for line in lines)
    assert "#wrong: 2 result elements differ from the expected values" in lines
    assert any("smallest message: all_reduce" in line for line in lines)
    # The JSON: the environment, one row per (impl, op, size), the summary.
    result = json.loads(out.read_text())
    assert result["environment"]["world_size"] == 2 and result["environment"]["backend"] == "gloo"
    assert (result["environment"]["gang"], result["environment"]["dtype"]) == ("tp", "float32")
    rows = result["rows"]
    assert {(r["impl"], r["op"]) for r in rows} == {(impl, op) for impl in ("torch", "gang") for op in OPS}
    for row in rows:
        assert list(row)[: len(ROW_KEYS)] == list(ROW_KEYS)
        assert row["world_size"] == 2 and row["iters"] == 3 and row["time_us"] > 0
        assert row["busbw_gbps"] > 0 and row["count"] * 4 == row["bytes"]
        assert row["wrong"] == (1 if (row["impl"], row["op"]) == ("gang", "all_gather") else 0)
        assert row["mean_us"] > 0 and row["p95_us"] >= row["time_us"]
    sizes = {r["op"]: sorted({r["bytes"] for r in rows if r["op"] == op}) for op in OPS for r in rows if r["op"] == op}
    # 4 bytes is one float; collectives that split the buffer over the ranks round it up to one per rank.
    assert sizes["all_reduce"] == sizes["broadcast"] == [4, 1024]
    assert sizes["all_gather"] == sizes["reduce_scatter"] == sizes["all_to_all"] == [8, 1024]
    assert result["summary"][0].startswith("gang/torch on 2 ranks:")


def test_traffic_rows_on_two_local_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # `--traffic` adds the point-to-point, uneven and overlapped rows to `--ops`; one element of the
    # gang's exchange_rows result is corrupted through the test-only seam and `#wrong` counts it.
    # `main` is called in this process, as `python -m gang.bench` calls it (the test above runs that
    # command): it starts torchrun, whose 2 processes run `python -m gang.bench`. That saves the
    # command's own process, which imports gang and torch only to start torchrun.
    out = tmp_path / "r.json"
    argv = ["--nproc", "2", "--ops", "broadcast", "--traffic"]
    argv += ["--sizes", "4", "1K", "--iters", "3", "--no-jax", "--no-plots", "--out", str(out)]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GANG_BENCH_CORRUPT", "gang:exchange_rows")
    code = main(argv)
    done = capfd.readouterr()
    assert code == 1, done.out + done.err
    lines = done.out.splitlines()
    titles = [line.split()[1] for line in lines if line.startswith("# ") and " on 2 ranks (gloo)" in line]
    assert titles == ["broadcast", *TRAFFIC_OPS], done.out
    assert "#wrong: 2 result elements differ from the expected values" in lines  # one per size
    assert any(line.startswith("gang/torch traffic on 2 ranks: send ") for line in lines), done.out
    assert sum("overlap gain through" in line for line in lines) == 2, done.out
    rows = json.loads(out.read_text())["rows"]
    pairs = {(impl, op) for impl in ("torch", "gang") for op in ("broadcast", *TRAFFIC_OPS)}
    assert {(r["impl"], r["op"]) for r in rows} == pairs | {
        ("gang-sequential", "overlap"),
        ("torch-sequential", "overlap"),
    }
    for row in rows:
        assert row["wrong"] == (1 if (row["impl"], row["op"]) == ("gang", "exchange_rows") else 0), row
        assert row["time_us"] > 0 and row["busbw_gbps"] > 0
        assert ("overlap_gain" in row) == (row["op"] == "overlap" and row["impl"] in ("torch", "gang"))
    # The messages are not rounded to the ranks; the buckets of `overlap` are rounded to whole buckets.
    sizes = {op: sorted({r["bytes"] for r in rows if r["op"] == op}) for op in TRAFFIC_OPS}
    assert sizes["send"] == sizes["all_to_all_uneven"] == [4, 1024] and sizes["overlap"] == [32, 1024]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--nproc", "2", "--quick"], ["--quick"]),
        (["--quick", "--nproc=4", "--out", "x.json"], ["--quick", "--out", "x.json"]),
    ],
)
def test_nproc_is_not_passed_on(argv: list[str], expected: list[str]) -> None:
    assert without_nproc(argv) == expected


def test_bad_arguments_are_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    # `main` parses the arguments before it launches any process.
    for args, message in (
        (["--nproc", "0"], "`--nproc` must be at least 1, but is 0 instead."),
        (["--sizes", "4X"], "a size must be a number of bytes"),
        (["--tp", "0"], "`--tp` must be at least 1, but is 0 instead."),
        (["--impls", "gang", "nccl"], "`--impls` must name some of torch, gang"),
    ):
        with pytest.raises(SystemExit, match="2") as exit_info:
            main(args)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
