"""The bad-call catalogue of the core package, on a JaxGang: same error, before any communication.

Every rank makes the same bad call; it must raise the same exception type, with the same text, as
on a FakeGang and a ProcessGroupGang, and a following all-reduce must succeed on every rank.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2] / "packages" / "gang" / "tests"))

import jax_reliability_workers
from gang_core_bad_calls import CATALOGUE

from gang.testing import World

_HERE = Path(__file__).parent
_CORE_TESTS = _HERE.parents[1] / "packages" / "gang" / "tests"


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    # The workers import the catalogue and the worker module by name.
    path = os.pathsep.join([str(_HERE), str(_CORE_TESTS), os.environ.get("PYTHONPATH", "")])
    with World(2, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": path, "GANG_DEBUG": "0"}) as w:
        yield w


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_call_on_jax_gang_matches_fake_gang(world: World, name: str) -> None:
    _, error, text = CATALOGUE[name]
    for rank, outcome in enumerate(world.run(jax_reliability_workers.try_bad_call, name)):
        assert outcome.startswith(error.__name__ + ":"), f"rank {rank}: {outcome}"
        assert text in outcome, f"rank {rank}: {outcome}"
