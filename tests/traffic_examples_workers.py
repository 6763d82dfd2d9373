"""Run on every rank by ``test_traffic_examples.py``: the pipeline and MoE examples of ``examples/``.

The examples are imported by name from ``examples/`` (added to ``sys.path`` here, so the worker
processes that unpickle these functions find them too).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import moe_experts
import pipeline_send_recv

from gang import Gang, create_parallel_gangs

MOE_CASES = tuple(moe_experts.CASES)
"""The MoE example's cases, by name."""

_JAX: list[Gang] = []


def _jax_gang() -> Gang:
    """This process's in-process JaxGang over the world, made once."""
    from gang_jax import JaxGang

    if not _JAX or _JAX[0].closed:
        _JAX[:] = [JaxGang.create_default()]
    return _JAX[0]


def pipeline(root: Gang, kind: str, pp_size: int) -> list[str]:
    """Train the ``send_recv`` pipeline on the pp gangs of size ``pp_size``; return what differs from the reference."""
    base = _jax_gang() if kind == "jax" else root
    pp = base if pp_size == base.size else create_parallel_gangs(base, pp_size=pp_size).pp
    return pipeline_send_recv.check(pp)


def moe(root: Gang, ep_size: int) -> dict[str, Any]:
    """Run the MoE layer on the ep gangs of size ``ep_size`` (see :func:`moe_experts.check`)."""
    return moe_experts.check(root, ep_size)
