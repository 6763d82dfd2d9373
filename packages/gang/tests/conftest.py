"""Fixtures for the core tests: persistent worlds of real gloo processes, one per size."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Worker functions live in `gang_core_remote`, imported by module name in the worker processes
# (which inherit this sys.path).
sys.path.insert(0, str(Path(__file__).parent))

from gang.testing import World

_worlds: dict[int, World] = {}


def get_world(size: int) -> World:
    """Return a live world of ``size`` processes, starting a new one if the last one failed."""
    world = _worlds.get(size)
    if world is None or not world.alive:
        world = World(size, gang_timeout=60.0)
        _worlds[size] = world
    return world


@pytest.fixture(scope="session", autouse=True)
def _stop_worlds() -> Iterator[None]:
    yield
    for world in _worlds.values():
        world.close()
