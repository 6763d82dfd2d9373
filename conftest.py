"""Fixtures shared by every test folder of the monorepo (pytest loads this for all of them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gang.testing import World


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
