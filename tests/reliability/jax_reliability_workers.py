"""Functions the JAX reliability tests run on every rank of a :class:`gang.testing.World`.

Each process creates one :class:`~gang_jax.JaxGang` on first use and keeps it in a module global,
so a whole test module shares one JAX runtime per process (as ``tests/conformance_workers.py``
does). The world's own torch gang is ignored.
"""

from __future__ import annotations

from typing import Any

import torch

from gang import Gang, ReduceOperation
from gang_jax import JaxGang

_JAX: JaxGang | None = None
_DEBUG: JaxGang | None = None


def jax_gang() -> JaxGang:
    """This process's root :class:`JaxGang` (debug mode as ``GANG_DEBUG`` says), created on first use."""
    global _JAX
    if _JAX is None or _JAX.closed:
        _JAX = JaxGang.create_default()
    return _JAX


def debug_jax_gang() -> JaxGang:
    """A second gang over the same runtime with debug mode on (``create_default`` wraps the runtime)."""
    global _DEBUG
    jax_gang()
    if _DEBUG is None or _DEBUG.closed:
        _DEBUG = JaxGang.create_default(debug=True)
    return _DEBUG


def try_bad_call(_: Gang, name: str) -> str:
    """Run one catalogued bad call on the JAX gang; return ``"Type: message"``; then prove it still works."""
    from core_workers import try_call

    return try_call(jax_gang(), name)


def on_debug_gang(_: Gang, fn_name: str) -> Any:
    """Run ``fault_workers.<fn_name>`` on this process's debug-mode JAX gang."""
    import fault_workers

    result = getattr(fault_workers, fn_name)(debug_jax_gang())
    # Whatever happened, the plain gang must still work afterwards.
    g = jax_gang()
    t = torch.ones(1)
    g.all_reduce(t, ReduceOperation.SUM)
    assert t.item() == g.size, t
    return result


def default_debug_flags(_: Gang) -> list[bool]:
    """Debug mode of the default JAX gang, of its sub-gang, and of an explicit ``debug=False`` wrapper."""
    g = jax_gang()
    sub = g.create_gang(list(range(g.size)))
    assert sub is not None
    flags = [g.debug, sub.debug, JaxGang.create_default(debug=False).debug, debug_jax_gang().debug]
    sub.close()
    return flags
