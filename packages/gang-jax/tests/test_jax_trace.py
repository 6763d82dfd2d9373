"""Hooks and the flight recorder on an in-process JaxGang (the isolated one: tests/reliability/test_trace.py)."""

from __future__ import annotations

from jax_trace_workers import observe_jax
from test_trace_hooks import _check_events

from gang.testing import World


def test_hooks_see_every_operation_of_a_jax_gang() -> None:
    with World(2, init_gang=False) as world:
        observed = world.run(observe_jax, timeout=600)
    for rank, o in enumerate(observed):
        _check_events(o["events"], 2)
        assert o["results"][1] == [0.0]
        assert o["rank"] == rank
        assert o["table"]["world"] == "[0, 1]"
    assert observed[0]["results"][0] == [3.0, 3.0]
