"""gang_jax: a :class:`gang.Gang` whose collectives run on JAX's multi-process collectives.

:class:`JaxGang` gives the same results as :class:`gang.ProcessGroupGang` for the same inputs,
so one test body can run on both; :mod:`gang_jax.functional` offers the same collectives on
``jax.Array`` values. :func:`to_jax_mesh` and :func:`from_jax_mesh` turn a :class:`gang.Gangs`
layout into a ``jax.sharding.Mesh`` and back (the JAX side of ``gang_mesh``).
"""

from __future__ import annotations

import importlib.metadata

from gang_jax._engine import DEFAULT_COORDINATION_TIMEOUT
from gang_jax.gang import JaxGang
from gang_jax.mesh import from_jax_mesh, to_jax_mesh

try:
    __version__ = importlib.metadata.version("gang-jax")
    """The installed distribution's version (``gang-jax`` in ``pyproject.toml``, its one source)."""
except importlib.metadata.PackageNotFoundError:  # a source tree on ``sys.path`` that was never installed
    __version__ = "0+unknown"

__all__ = ["DEFAULT_COORDINATION_TIMEOUT", "JaxGang", "from_jax_mesh", "to_jax_mesh"]
