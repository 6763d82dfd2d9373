"""Set-up for the core tests: helper modules on the path, and every world stopped at the end."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The helper modules (`gang_core_*`) are imported by name here and in the worker processes, which
# inherit this sys.path.
sys.path.insert(0, str(Path(__file__).parent))

from gang_core_worlds import stop_worlds


@pytest.fixture(scope="session", autouse=True)
def _stop_worlds() -> Iterator[None]:
    yield
    stop_worlds()
