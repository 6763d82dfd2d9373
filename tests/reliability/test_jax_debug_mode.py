"""Debug mode on JaxGang: mismatched calls raise GangError on every rank, naming each rank's call."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import jax_reliability_workers

from gang.testing import World

_HERE = Path(__file__).parent


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    path = os.pathsep.join([str(_HERE), os.environ.get("PYTHONPATH", "")])
    # The workers inherit this environment: without GANG_DEBUG the default JAX gang has debug
    # mode off, and the tests turn it on with `debug=True`.
    saved = os.environ.pop("GANG_DEBUG", None)
    try:
        with World(request.param, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": path}) as w:
            yield w
    finally:
        if saved is not None:
            os.environ["GANG_DEBUG"] = saved


def test_mismatched_shapes_name_every_rank(world: World) -> None:
    messages = world.run(jax_reliability_workers.on_debug_gang, "mismatched_shapes")
    for rank, message in enumerate(messages):
        assert f"(this is rank {rank})" in message
        for r in range(world.world_size):
            assert f"rank {r}: all_reduce(shape=[{3 + r}], dtype=float32, op=SUM)" in message


def test_mismatched_collectives(world: World) -> None:
    for message in world.run(jax_reliability_workers.on_debug_gang, "mismatched_collectives"):
        assert "rank 0: broadcast(shape=[2], dtype=float32, source_rank=0)" in message
        assert "rank 1: all_reduce(shape=[2], dtype=float32, op=MAX)" in message


def test_sub_gangs_inherit_debug_mode(world: World) -> None:
    messages = world.run(jax_reliability_workers.on_debug_gang, "mismatched_in_sub_gang")
    for message in messages[:2]:
        assert "op=MIN" in message and "op=SUM" in message and "size 2" in message
    assert all(m == "not a member" for m in messages[2:])


def test_matching_calls_still_work_in_debug_mode(world: World) -> None:
    size = world.world_size
    total = sum(range(size))
    assert (
        world.run(jax_reliability_workers.on_debug_gang, "matching_calls_work")
        == [[total, total * 4 * size, 1.0]] * size
    )


def test_debug_mode_is_off_by_default(world: World) -> None:
    # Default gang off (no GANG_DEBUG), its sub-gang off, debug=False off, debug=True on.
    assert world.run(jax_reliability_workers.default_debug_flags) == [[False, False, False, True]] * world.world_size
