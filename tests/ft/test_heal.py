"""The store-free parts of healing and of the CUDA vote: the heal plan, the state's skeleton, the poll."""

from __future__ import annotations

import pickle

import torch

from gang.ft.group import wait_until
from gang.ft.heal import TensorSlot, flatten
from gang.ft.policy import heal_plan

M = tuple("abcde")


def test_heal_plan_spreads_the_members_behind_over_the_up_to_date_ones() -> None:
    assert heal_plan(M[:3], (5, 5, 5), init_sync=True) == {}
    assert heal_plan(M, (5, 0, 5, 3, 0), init_sync=True) == {"b": "a", "d": "c", "e": "a"}
    assert heal_plan(M[:2], (2, 7)) == {"a": "b"}
    assert heal_plan((), (), init_sync=True) == {}


def test_init_sync_makes_the_first_member_the_only_sender_at_step_0() -> None:
    assert heal_plan(M[:3], (0, 0, 0), init_sync=True) == {"b": "a", "c": "a"}
    assert heal_plan(M[:3], (0, 0, 0)) == {}
    assert heal_plan(M[:1], (0,), init_sync=True) == {}
    assert heal_plan(M[:2], (0, 1), init_sync=True) == {"a": "b"}  # past step 0, the ordinary rule


def test_the_header_holds_the_structure_and_the_leaves_not_the_bytes() -> None:
    big = torch.zeros(1000, 1000)
    state = {"w": big, "opt": {"m": [torch.ones(3, dtype=torch.bfloat16), "adam"]}, "t": (1, torch.tensor(2))}
    skeleton, tensors = flatten(state)
    assert [path for path, _ in tensors] == [("w",), ("opt", "m", 0), ("t", 1)]
    assert tensors[0][1] is big
    assert skeleton == {
        "w": TensorSlot(0, torch.float32, (1000, 1000), True, False),
        "opt": {"m": [TensorSlot(1, torch.bfloat16, (3,), True, False), "adam"]},
        "t": (1, TensorSlot(2, torch.int64, (), True, False)),
    }
    assert len(pickle.dumps(skeleton)) < 2000  # the tensors' bytes travel apart, in chunks


def test_wait_until_polls_until_the_condition_or_the_timeout() -> None:
    # What the CUDA vote polls (an event's `query`) stands here for a condition that becomes true.
    calls = []

    def after_three() -> bool:
        calls.append(1)
        return len(calls) >= 3

    assert wait_until(after_three, 60.0) and len(calls) == 3
    assert not wait_until(lambda: False, 0.05)
