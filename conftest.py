"""Fixtures shared by every test folder of the monorepo (pytest loads this for all of them).

The helper modules of the test folders (``*_workers.py``) are importable by name through pytest's
``pythonpath`` setting (root ``pyproject.toml``); the worker processes of a
:class:`~gang.testing.World` start with the same ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gang.testing import World, close_shared_worlds, shared_world

# gang's pytest plugin (`@pytest.mark.gang`). Installing gang registers it through its entry point;
# naming it here also works where gang is only on the path (the two do not load it twice). Its
# tests and the fixtures below share one world per size (`gang.testing.shared_world`).
pytest_plugins = ["gang.pytest_plugin"]


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_worlds() -> Iterator[None]:
    yield
    close_shared_worlds()


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
