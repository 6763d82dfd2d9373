"""Sphinx configuration for the gang monorepo's documentation."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for package in ("gang", "gang-mesh", "gang-jax"):
    sys.path.insert(0, str(ROOT / "packages" / package / "src"))
# The guides' doctests import the runnable examples by name (``from quickstart import ...``).
sys.path.insert(0, str(ROOT / "examples"))

import runpy  # noqa: E402

import gang  # noqa: E402  (from the folders above)

# The performance page's tables, written from the benchmarks' committed JSON (docs/_static/perf)
# into docs/_generated, which the page includes: a re-run benchmark updates the page.
runpy.run_path(str(ROOT / "benchmarks" / "docs_tables.py"))["write"]()

project = "gang"
author = "the gang developers"
copyright = "2026, the gang developers"
# The installed distributions' version (packages/gang/pyproject.toml, the one source; see CHANGELOG.md).
release = version = gang.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.doctest", "sphinx.ext.viewcode"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build", "_generated"]
html_theme = "furo"
html_title = f"gang {release}"
html_static_path: list[str] = []
# The doctests import the examples by module name (as the processes they start do).
EXAMPLES = str(ROOT / "examples")
doctest_global_setup = f"import sys\nsys.path.insert(0, {EXAMPLES!r})\nimport torch\nimport gang\nfrom gang import *\n"
