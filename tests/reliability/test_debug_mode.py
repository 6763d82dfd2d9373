"""Debug mode: ranks compare what they call before every collective; a mismatch raises everywhere.

Each scenario runs on a torch gang (``ProcessGroupGang``, debug mode from ``GANG_DEBUG=1``) and on
a ``JaxGang`` (``debug=True``) of 2 and 4 real processes, with the same assertions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import fault_workers
import jax_reliability_workers
import pytest
import torch

from gang import FakeGang
from gang.testing import World

Scenario = Callable[[str], list[Any]]


@pytest.fixture(scope="module")
def plain_world(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Callable[[int], World]]:
    """``plain_world(n)``: this module's world of ``n`` processes without ``GANG_DEBUG`` (started on
    first use), shared by the JAX scenarios and the checks of the defaults."""
    monkeypatch_module.delenv("GANG_DEBUG", raising=False)
    worlds: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in worlds:
            worlds[size] = World(size, env={"OMP_NUM_THREADS": "1"})
        return worlds[size]

    yield get
    for world in worlds.values():
        world.close()


@pytest.fixture(
    scope="module", params=[("torch", 2), ("torch", 4), ("jax", 2), ("jax", 4)], ids=lambda p: f"{p[0]}{p[1]}"
)
def run(request: pytest.FixtureRequest, plain_world: Callable[[int], World]) -> Iterator[tuple[Scenario, int]]:
    """Run a scenario of ``fault_workers`` by name on every rank of a debug-mode gang."""
    backend, size = request.param
    if backend == "torch":
        with World(size, gang_timeout=30, env={"GANG_DEBUG": "1"}) as world:
            yield (lambda name: world.run(getattr(fault_workers, name))), size
    else:
        # Without GANG_DEBUG the workers' default JAX gang has debug mode off; the scenarios get a
        # second gang with `debug=True`.
        world = plain_world(size)
        yield (lambda name: world.run(jax_reliability_workers.on_debug_gang, name)), size


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_mismatched_shapes_name_every_rank(run: tuple[Scenario, int]) -> None:
    scenario, size = run
    for rank, message in enumerate(scenario("mismatched_shapes")):
        assert f"(this is rank {rank})" in message
        for r in range(size):
            assert f"rank {r}: all_reduce(shape=[{3 + r}], dtype=float32, op=SUM)" in message


def test_mismatched_collectives(run: tuple[Scenario, int]) -> None:
    scenario, _ = run
    for message in scenario("mismatched_collectives"):
        assert "rank 0: broadcast(shape=[2], dtype=float32, source_rank=0)" in message
        assert "rank 1: all_reduce(shape=[2], dtype=float32, op=MAX)" in message


def test_sub_gangs_inherit_debug_mode(run: tuple[Scenario, int]) -> None:
    scenario, _ = run
    messages = scenario("mismatched_in_sub_gang")
    for message in messages[:2]:
        assert "op=MIN" in message and "op=SUM" in message and "size 2" in message
    assert all(m == "not a member" for m in messages[2:])


def test_matching_calls_still_work_in_debug_mode(run: tuple[Scenario, int]) -> None:
    scenario, size = run
    total = sum(range(size))
    assert scenario("matching_calls_work") == [[total, total * 4 * size, 1.0]] * size


def test_debug_mode_is_off_by_default_on_torch_gangs(plain_world: Callable[[int], World]) -> None:
    assert FakeGang(torch.device("cpu")).debug is False
    assert FakeGang(torch.device("cpu"), debug=True).debug is True
    assert plain_world(2).run(fault_workers.debug_flag) == [False, False]


def test_debug_mode_is_off_by_default_on_jax_gangs(plain_world: Callable[[int], World]) -> None:
    # Default gang off (no GANG_DEBUG), its sub-gang off, debug=False off, debug=True on.
    assert plain_world(2).run(jax_reliability_workers.default_debug_flags) == [[False, False, False, True]] * 2
