"""The bad-call catalogue of the core package, on a JaxGang: same error, before any communication.

Every rank makes the same bad call; it must raise the same exception type, with the same text, as
on a FakeGang and a ProcessGroupGang, and a following all-reduce must succeed on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax_reliability_workers
import pytest
from bad_call_workers import CATALOGUE

from gang.testing import World


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with World(2, env={"OMP_NUM_THREADS": "1", "GANG_DEBUG": "0"}) as w:
        yield w


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_call_on_jax_gang_matches_fake_gang(world: World, name: str) -> None:
    _, error, text = CATALOGUE[name]
    for rank, outcome in enumerate(world.run(jax_reliability_workers.try_bad_call, name)):
        assert outcome.startswith(error.__name__ + ":"), f"rank {rank}: {outcome}"
        assert text in outcome, f"rank {rank}: {outcome}"
