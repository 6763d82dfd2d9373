"""``nox -s lint``'s check that the repository's text describes the product: no dated run logs and no
numbered work sessions (``history`` in ``noxfile.py``), found in every way they are written."""

from __future__ import annotations

import runpy
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOXFILE: dict[str, Any] = runpy.run_path(str(ROOT / "noxfile.py"))
# The samples are put together here, so that this file's own text holds none of them.
MONTH, YEAR, ISO, THIRD = "Novem" + "ber", "20" + "26", "20" + "26-11-27", "third" + " session"


def _found(tmp_path: Path, files: dict[str, str]) -> list[str]:
    """What ``history`` reports for a git repository holding ``files``."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    return list(NOXFILE["history"](tmp_path))


@pytest.mark.parametrize(
    "text",
    [
        f"The figures come from runs on {ISO}.",
        f"The figures come from runs on 27 {MONTH} {YEAR}.",
        f"Measured in {MONTH} {YEAR} on this machine.",
        f"Measured on {MONTH} 27, {YEAR}.",
        f"The code of 27\n{MONTH} at 11:42 UTC.",
        f"As the {THIRD} found.",
        "As the last\nsession found.",
    ],
)
def test_a_dated_run_log_or_a_numbered_session_is_found_however_it_is_written(tmp_path: Path, text: str) -> None:
    found = _found(tmp_path, {"guide.rst": "A guide.\n\n" + text + "\n"})
    assert len(found) == 1 and found[0].startswith("guide.rst:3: "), found


def test_product_words_pass_and_the_changelog_may_hold_dates(tmp_path: Path) -> None:
    files = {
        "guide.rst": "Run ``nox -s lint``; the nox session and the pytest session scope.\nMay the 4 ranks agree.\n",
        "CHANGELOG.md": f"## 0.1.0 ({ISO})\n\n- Released on 27 {MONTH} {YEAR}.\n",
    }
    assert _found(tmp_path, files) == []
