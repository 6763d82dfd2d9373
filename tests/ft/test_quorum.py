"""The store protocol of gang.ft on a real TCPStore, driven directly (two replicas as two threads).

The multi-process scenarios (tests/ft/test_ft.py) cover the protocol end to end; these cases set
up store states that are hard to reach there on purpose, such as a process that comes back from a
pause after the rounds it knew were deleted.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from gang._torch_groups import TCPStore
from gang.ft.quorum import KEEP_ROUNDS, ROOT, Protocol, Quorum, collect

TIMEOUT = timedelta(seconds=20)
"""Long enough that the heartbeats written once at registration stay fresh on a busy machine."""


@pytest.fixture
def server() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _client(server: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)


def _protocol(server: TCPStore, replica_id: str, timeout: timedelta = TIMEOUT) -> Protocol:
    return Protocol(_client(server), replica_id, 0, 1, timeout)


def test_a_paused_process_skips_the_rounds_deleted_meanwhile(server: TCPStore) -> None:
    a = _protocol(server, "a")
    a.register(0)
    last = 0
    for step in range(5):  # replica a trains alone: rounds 1 to 5
        quorum = a.form(last, step, 1)
        assert quorum.members == ("a",)
        assert a.vote(quorum, True)
        last = quorum.round
    for n in range(1, last + 1):
        collect(server, n)
    assert not server.check([f"{ROOT}r/2/result"]) and server.check([f"{ROOT}r/{last - KEEP_ROUNDS + 1}/result"])

    # Replica b now acts as a process that took part in round 1 and was paused since: it comes
    # back to round 2, which closed long ago and whose keys were deleted.
    b = _protocol(server, "b")
    b.register(0)
    got: dict[str, Quorum] = {}
    thread = threading.Thread(target=lambda: got.setdefault("b", b.form(1, 0, 1)))
    thread.start()
    got["a"] = a.form(last, 5, 1)
    thread.join(timeout=4 * TIMEOUT.total_seconds())
    assert not thread.is_alive()
    # Both are in round 6; round 2 was not closed again by b (without the checks for deleted
    # rounds, b closes it alone once a's heartbeat is older than the timeout).
    assert got["a"] == got["b"]
    assert got["b"].round == last + 1 and got["b"].members == ("a", "b")
    assert not server.check([f"{ROOT}r/2/result"])


def test_collect_keeps_the_rounds_still_read(server: TCPStore) -> None:
    a = _protocol(server, "a")
    a.register(0)
    last = 0
    for step in range(4):
        quorum = a.form(last, step, 1)
        assert a.vote(quorum, True)
        last = quorum.round
    collect(server, last)
    parts = ("joins", "result", "votes", "decision")
    assert not any(server.check([f"{ROOT}r/{last - KEEP_ROUNDS}/{p}"]) for p in parts)
    for n in range(last - KEEP_ROUNDS + 1, last + 1):
        assert all(server.check([f"{ROOT}r/{n}/{p}"]) for p in parts), n


def test_a_vote_read_after_its_round_was_deleted_is_lost_not_invented(server: TCPStore) -> None:
    a, x = _protocol(server, "a"), _protocol(server, "x", timedelta(seconds=1))
    a.register(0)
    x.register(0)
    got: dict[str, Quorum] = {}
    thread = threading.Thread(target=lambda: got.setdefault("x", x.form(0, 0, 2)))
    thread.start()
    first = a.form(0, 0, 2)
    thread.join(timeout=TIMEOUT.total_seconds())
    assert got["x"] == first and first.members == ("a", "x")
    votes: dict[str, bool | None] = {}
    thread = threading.Thread(target=lambda: votes.setdefault("x", x.vote(first, True)))
    thread.start()
    votes["a"] = a.vote(first, True)
    thread.join(timeout=TIMEOUT.total_seconds())
    assert votes == {"a": True, "x": True}
    # x pauses; a goes on alone for two more rounds and round 1's keys are deleted.
    x.leave()
    last = first.round
    for step in (1, 2):
        quorum = a.form(last, step, 1)
        assert quorum.members == ("a",) and a.vote(quorum, True)
        last = quorum.round
    collect(server, last)
    assert not server.check([f"{ROOT}r/{first.round}/decision"])
    # x comes back and votes again in round 1: the decision is gone; x must not write one.
    assert x.vote(first, True) is None
    assert not server.check([f"{ROOT}r/{first.round}/decision"])
