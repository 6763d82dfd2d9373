"""Bad calls raise a clear error before any communication, on FakeGang and on real gloo gangs alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from bad_call_workers import CATALOGUE
from core_workers import try_call

from gang import FakeGang
from gang.testing import World


def test_catalogue_is_large() -> None:
    assert len(CATALOGUE) >= 30


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_call_on_fake_gang(name: str) -> None:
    call, error, text = CATALOGUE[name]
    gang = FakeGang(torch.device("cpu"), rank=1, size=4)
    with pytest.raises(error, match=None) as info:
        call(gang)
    assert text in str(info.value)
    t = torch.ones(1)
    gang.all_reduce(t, __import__("gang").ReduceOperation.SUM)
    assert t.item() == 4


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_call_on_process_group_gang_matches_fake_gang(name: str, worlds: Callable[[int], World]) -> None:
    _, error, text = CATALOGUE[name]
    # Every rank makes the bad call, then an all_reduce proves nobody was left behind.
    outcomes = worlds(2).run(try_call, name)
    for outcome in outcomes:
        assert outcome.startswith(error.__name__ + ":"), outcome
        assert text in outcome
