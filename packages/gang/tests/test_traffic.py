"""Point-to-point, uneven rows and handles on real gloo processes: what the conformance table does not
cover (its cases compare gangs with each other): a bounded ``wait``, any posting order, debug mode.

The bodies marked ``@pytest.mark.gang`` run on every rank of the session's shared worlds.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from gang import Gang, GangError, ProcessGroupGang
from gang.work import CompletedWork, check_wait_timeout


def test_a_completed_work_and_the_checks_of_wait() -> None:
    work = CompletedWork("all_reduce")
    assert work.is_completed() and work.operation == "all_reduce"
    work.wait()
    work.wait(timeout=0.5)
    assert repr(work) == "CompletedWork('all_reduce', completed)"
    for bad, error, text in [
        ("1", TypeError, "'1' of type `str`"),
        (True, TypeError, "True of type `bool`"),
        (0, ValueError, "but is 0 instead"),
        (-1.5, ValueError, "but is -1.5 instead"),
        (math.inf, ValueError, "but is inf instead"),
        (math.nan, ValueError, "but is nan instead"),
    ]:
        with pytest.raises(error, match="`timeout` must be") as info:
            work.wait(timeout=bad)  # type: ignore[arg-type]
        assert text in str(info.value)
    assert check_wait_timeout(None) is None and check_wait_timeout(2) == 2.0


@pytest.mark.gang(world_size=2)
def test_a_timeout_bounds_one_wait_and_the_transfer_goes_on(gang: Gang) -> None:
    # Rank 1 sends only once rank 0's bounded wait has given up (rank 0 then tells it to), so the
    # first wait cannot complete whatever the machine's speed; the second one gets the data.
    go = torch.zeros(1)
    if gang.rank == 0:
        data = torch.zeros(3)
        work = gang.recv(data, 1, async_op=True)
        with pytest.raises(GangError, match=r"`recv` did not complete within the `wait` timeout of 0.05 s"):
            work.wait(timeout=0.05)
        assert not work.is_completed()
        gang.send(go, 1)
        work.wait()
        assert work.is_completed() and data.tolist() == [1.0, 2.0, 3.0]
        work.wait()  # a completed work waits no more
    else:
        gang.recv(go, 0)
        gang.send(torch.tensor([1.0, 2.0, 3.0]), 0, async_op=True).wait(timeout=60.0)


@pytest.mark.gang(world_size=[2, 4])
def test_send_recv_completes_whatever_order_the_ranks_list_their_pairs_in(gang: Gang) -> None:
    # Every rank sends to the next and the previous rank and receives from both, of different
    # sizes, each rank listing its pairs in its own random order (same seed on every rank: the
    # transfers between two ranks keep their order, which is what matches them).
    rank, size = gang.rank, gang.size
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for trial in range(8):
        shuffle = random.Random(1000 * trial + rank).shuffle
        forward, backward = 1000 + trial, 3 + trial
        from_prev, from_next = torch.zeros(forward), torch.zeros(backward)
        sends = [(torch.full((forward,), float(rank)), nxt), (torch.full((backward,), -float(rank)), prv)]
        recvs = [(from_prev, prv), (from_next, nxt)]
        if size == 2:  # next and previous are one rank: the forward transfer goes first both ways
            sends.sort(key=lambda pair: -pair[0].numel())
            recvs.sort(key=lambda pair: -pair[0].numel())
        else:
            shuffle(sends)
            shuffle(recvs)
        work = gang.send_recv(sends, recvs, async_op=trial % 2 == 1)
        if work is not None:
            work.wait()
        assert torch.equal(from_prev, torch.full((forward,), float(prv))), trial
        assert torch.equal(from_next, torch.full((backward,), -float(nxt))), trial


def _debug_gang(gang: Gang) -> Gang:
    """A debug-mode gang over the same group (the caller keeps the group)."""
    return ProcessGroupGang.from_process_group(gang.as_process_group(), gang.device, debug=True)


def _send_float_receive_int(g: Gang) -> None:
    """Rank 0 sends float32[4, 8] to rank 1, which receives int64[4, 8]."""
    if g.rank == 0:
        g.send(torch.ones(4, 8), 1)
    else:
        g.recv(torch.zeros(4, 8, dtype=torch.int64), 0)


@pytest.mark.gang(world_size=[2, 4])
def test_debug_mode_names_both_sides_of_a_pair_that_does_not_match(gang: Gang) -> None:
    # Ranks 0 and 1 disagree on the dtype; ranks 2 and 3 (in a world of 4) make matching calls.
    g = _debug_gang(gang)
    expected = "rank 0 sends float32[4, 8] to rank 1, but rank 1 receives int64[4, 8] from rank 0"
    if g.rank >= 2:
        peer = 5 - g.rank
        received = torch.zeros(2, dtype=torch.int64)
        g.send_recv([(torch.full((2,), g.rank), peer)], [(received, peer)])
        assert received.tolist() == [peer, peer]
        return
    with pytest.raises(GangError, match="Debug mode: point-to-point calls do not match") as info:
        _send_float_receive_int(g)
    assert str(info.value) == f"Debug mode: point-to-point calls do not match: {expected}."


@pytest.mark.gang(world_size=[2, 4])
def test_debug_mode_checks_that_uneven_splits_match_across_ranks(gang: Gang) -> None:
    # Rank 0 expects two rows from rank 1, which sends it one: every rank raises, naming the pair.
    g = _debug_gang(gang)
    output_splits = [1] * g.size
    if g.rank == 0:
        output_splits[1] = 2
    with pytest.raises(GangError, match="Debug mode: the splits of `all_to_all_uneven` do not match") as info:
        g.all_to_all_uneven(torch.empty(sum(output_splits), 3), torch.ones(g.size, 3), output_splits, [1] * g.size)
    assert "rank 1 sends 1 rows to rank 0, but rank 0 receives 2 rows from rank 1" in str(info.value)
    assert f"(this is rank {g.rank})" in str(info.value)
    # Matching calls go through in debug mode.
    out = torch.empty(g.size, 3)
    g.all_to_all_uneven(out, torch.full((g.size, 3), float(g.rank)), [1] * g.size, [1] * g.size)
    assert out[:, 0].tolist() == [float(r) for r in range(g.size)]
