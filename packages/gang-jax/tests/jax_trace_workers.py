"""What the JAX hook test runs on every rank: the shared hook scenario on an in-process JaxGang."""

from __future__ import annotations

from typing import Any

from hook_workers import observe

import gang.trace
from gang_jax import JaxGang


def observe_jax() -> dict[str, Any]:
    """The hook scenario on a root JaxGang (JAX in this process), with the recorder's table of gangs."""
    g = JaxGang.create_default()
    observed = observe(g)
    snapshot = gang.trace._recorder.snapshot("test")
    observed["table"] = {c["desc"]: c["ranks"] for c in snapshot["pg_config"].values()}
    observed["rank"] = gang.trace.process_rank()
    g.close()
    return observed
