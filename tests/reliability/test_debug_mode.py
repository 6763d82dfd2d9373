"""Debug mode: ranks compare what they call before every collective; a mismatch raises everywhere."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from faults import (
    debug_flag,
    matching_calls_work,
    mismatched_collectives,
    mismatched_in_sub_gang,
    mismatched_shapes,
)

from gang import FakeGang
from gang.testing import World


@pytest.fixture(scope="module", params=[2, 4])
def debug_world(request: pytest.FixtureRequest) -> Iterator[World]:
    with World(request.param, gang_timeout=30, env={"GANG_DEBUG": "1"}) as world:
        yield world


def test_mismatched_shapes_name_every_rank(debug_world: World) -> None:
    messages = debug_world.run(mismatched_shapes)
    size = debug_world.world_size
    for rank, message in enumerate(messages):
        assert f"(this is rank {rank})" in message
        for r in range(size):
            assert f"rank {r}: all_reduce(shape=[{3 + r}], dtype=float32, op=SUM)" in message


def test_mismatched_collectives(debug_world: World) -> None:
    for message in debug_world.run(mismatched_collectives):
        assert "rank 0: broadcast(shape=[2], dtype=float32, source_rank=0)" in message
        assert "rank 1: all_reduce(shape=[2], dtype=float32, op=MAX)" in message


def test_sub_gangs_inherit_debug_mode(debug_world: World) -> None:
    messages = debug_world.run(mismatched_in_sub_gang)
    for message in messages[:2]:
        assert "op=MIN" in message and "op=SUM" in message and "size 2" in message
    assert all(m == "not a member" for m in messages[2:])


def test_matching_calls_still_work_in_debug_mode(debug_world: World) -> None:
    size = debug_world.world_size
    total = sum(range(size))
    assert debug_world.run(matching_calls_work) == [[total, total * 4 * size, 1.0]] * size


def test_debug_mode_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GANG_DEBUG", raising=False)
    assert FakeGang(torch.device("cpu")).debug is False
    assert FakeGang(torch.device("cpu"), debug=True).debug is True
    with World(2) as world:
        assert world.run(debug_flag) == [False, False]
