"""Persistent worlds of real gloo processes for the core tests, one per size."""

from __future__ import annotations

from gang.testing import World

_worlds: dict[int, World] = {}


def get_world(size: int) -> World:
    """Return a live world of ``size`` processes, starting a new one if the last one failed."""
    world = _worlds.get(size)
    if world is None or not world.alive:
        world = World(size, gang_timeout=60.0)
        _worlds[size] = world
    return world


def stop_worlds() -> None:
    """Stop every world started by :func:`get_world`."""
    for world in _worlds.values():
        world.close()
    _worlds.clear()
