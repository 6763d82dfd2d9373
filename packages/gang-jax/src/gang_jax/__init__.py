"""gang_jax: a :class:`gang.Gang` whose collectives run on JAX's multi-process collectives.

:class:`JaxGang` gives the same results as :class:`gang.ProcessGroupGang` for the same inputs,
so one test body can run on both; :mod:`gang_jax.functional` offers the same collectives on
``jax.Array`` values.
"""

from __future__ import annotations

import importlib.metadata

from gang_jax.gang import DEFAULT_COORDINATION_TIMEOUT, JaxGang

try:
    __version__ = importlib.metadata.version("gang-jax")
    """The installed distribution's version (``gang-jax`` in ``pyproject.toml``, its one source)."""
except importlib.metadata.PackageNotFoundError:  # a source tree on ``sys.path`` that was never installed
    __version__ = "0+unknown"

__all__ = ["DEFAULT_COORDINATION_TIMEOUT", "JaxGang"]
