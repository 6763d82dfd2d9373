"""gang_jax: a :class:`gang.Gang` whose collectives run on JAX's multi-process collectives.

:class:`JaxGang` gives the same results as :class:`gang.ProcessGroupGang` for the same inputs,
so one test body can run on both; :mod:`gang_jax.functional` offers the same collectives on
``jax.Array`` values.
"""

from __future__ import annotations

from gang_jax.gang import DEFAULT_COORDINATION_TIMEOUT, JaxGang

__version__ = "0.1.0"

__all__ = ["DEFAULT_COORDINATION_TIMEOUT", "JaxGang"]
