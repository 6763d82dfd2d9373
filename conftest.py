"""Fixtures shared by every test folder of the monorepo (pytest loads this for all of them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gang.testing import World

# gang's pytest plugin (`@pytest.mark.gang`). Installing gang registers it through its entry point;
# naming it here also works where gang is only on the path (the two do not load it twice).
pytest_plugins = ["gang.pytest_plugin"]


@pytest.fixture(scope="module")
def world4() -> Iterator[World]:
    """Four real gloo processes, reused by the tests of one module."""
    with World(4) as world:
        yield world


@pytest.fixture(scope="module")
def world8() -> Iterator[World]:
    """Eight real gloo processes, reused by the tests of one module."""
    with World(8) as world:
        yield world
