"""The performance page's tables come from the committed benchmark results: every table is written,
every result file says how it was made, and a changed result changes the table."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TABLES: dict[str, Any] = runpy.run_path(str(ROOT / "benchmarks" / "docs_tables.py"))


def test_every_table_is_written_from_a_result_file_that_says_how_it_was_made(tmp_path: Path) -> None:
    data = TABLES["DATA"]
    runs = json.loads((data / "runs.json").read_text())
    for name, run in runs.items():
        assert (data / name).is_file(), name
        assert {"command", "machine", "load"} <= set(run), name
    written = TABLES["write"](data, tmp_path)
    assert sorted(p.name for p in written) == sorted(f"perf_{name}.rst" for name in TABLES["TABLES"])
    for path in written:
        text = path.read_text()
        assert text.startswith(".. list-table::") and "   * - " in text, path.name
    targets = (tmp_path / "perf_targets.rst").read_text()
    assert targets.count("     - met") + targets.count("     - not met") >= 10


def test_a_rerun_benchmark_updates_its_table(tmp_path: Path) -> None:
    data = tmp_path / "perf"
    shutil.copytree(TABLES["DATA"], data)
    rows = json.loads((data / "small_messages.json").read_text())
    for row in rows:
        if row["impl"] == "gang" and row["op"] == "all_reduce":
            row["paired_ratio"] = 1.5
    (data / "small_messages.json").write_text(json.dumps(rows))
    TABLES["write"](data, tmp_path / "out")
    assert "     - 1.500 [" in (tmp_path / "out" / "perf_small_messages.rst").read_text()
    targets = (tmp_path / "out" / "perf_targets.rst").read_text()
    assert "worst 1.500 (all_reduce)" in targets
