"""Fixtures shared by every test folder of the monorepo (pytest loads this for all of them).

The helper modules of the test folders (``*_workers.py``) are importable by name through pytest's
``pythonpath`` setting (root ``pyproject.toml``); the worker processes of a
:class:`~gang.testing.World` start with the same ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gang.testing import World

_pool: dict[int, World] = {}


def shared_world(size: int) -> World:
    """Return the session's live world of ``size`` real gloo processes (a new one if a test killed it)."""
    world = _pool.get(size)
    if world is None or not world.alive:
        world = World(size, gang_timeout=60.0)
        _pool[size] = world
    return world


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_worlds() -> Iterator[None]:
    yield
    for world in _pool.values():
        world.close()
    _pool.clear()


@pytest.fixture
def worlds() -> Callable[[int], World]:
    """``worlds(n)``: the session's shared world of ``n`` processes (started on first use)."""
    return shared_world


@pytest.fixture
def world4() -> World:
    """The session's shared world of four processes."""
    return shared_world(4)


@pytest.fixture
def world8() -> World:
    """The session's shared world of eight processes."""
    return shared_world(8)
