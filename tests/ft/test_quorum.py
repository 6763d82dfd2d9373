"""The store protocol of gang.ft on a real TCPStore, driven directly (replicas as threads).

The multi-process scenarios (tests/ft/test_ft.py) cover the protocol end to end; these cases set
up store states that are hard to reach there on purpose, such as a process that comes back from a
pause after the rounds it knew were deleted, or a process that registers and never joins.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

import pytest

from gang._torch_groups import TCPStore
from gang.ft.group import wait_until
from gang.ft.policy import Policy, Quorum, SparesPolicy
from gang.ft.quorum import (
    KEEP_ROUNDS,
    ROOT,
    ROUND_KEYS,
    IdentityError,
    QuorumClient,
    QuorumTimeoutError,
    StoreClient,
    collect,
)

SECONDS = 20.0
"""Heartbeat and quorum timeouts long enough that heartbeats written once stay fresh on a busy machine."""

_T = TypeVar("_T")


class InterleavingClient(StoreClient):
    """A store client that runs ``then()`` once, right after it read ``key`` (a test-only seam),
    the first time the value read satisfies ``when``.

    Every request still goes to the real store: the seam only forces an interleaving of two
    processes' requests that is otherwise a matter of luck (another process's writes land between
    two reads of this one).
    """

    def __init__(
        self, port: int, key: str, then: Callable[[], None], when: Callable[[bytes | None], bool] = lambda _: True
    ) -> None:
        super().__init__("127.0.0.1", port, retry=1.0, timeout=timedelta(seconds=SECONDS))
        self._key, self._then, self._when = key, then, when
        self.fired = False

    def peek(self, key: str) -> bytes | None:
        value = super().peek(key)
        if key == self._key and not self.fired and self._when(value):
            self.fired = True
            self._then()
        return value


class WokenClient(StoreClient):
    """A store client that runs ``then()`` once, when a blocking wait of it was woken with an
    empty answer, before it checks the key (a test-only seam over :meth:`StoreClient._woken`)."""

    def __init__(self, port: int, then: Callable[[], object]) -> None:
        super().__init__("127.0.0.1", port, retry=1.0, timeout=timedelta(seconds=SECONDS))
        self._then = then
        self.waiting = self.fired = False

    def wait(self, key: str, seconds: float, *, since: int | None = None) -> bytes | None:
        self.waiting = True
        return super().wait(key, seconds, since=since)

    def _woken(self, key: str) -> None:
        if not self.fired:
            self.fired = True
            self._then()


class CountingClient(StoreClient):
    """A store client that records every request it sends: ``read <keys>`` or ``write <key>``."""

    def __init__(self, port: int) -> None:
        super().__init__("127.0.0.1", port, retry=1.0, timeout=timedelta(seconds=SECONDS))
        self.keys: list[str] = []
        self.woken = 0  # how often a blocking wait was woken with an empty answer
        self._current = ""

    def _call(self, request: Callable[[TCPStore], _T], since: int | None = None) -> _T:
        self.keys.append(self._current)
        return super()._call(request, since)

    def compare_set(self, key: str, expected: str, desired: str, *, since: int | None = None) -> bytes:
        self._current = f"read {key}" if expected == desired else f"write {key}"
        return super().compare_set(key, expected, desired, since=since)

    def set(self, key: str, value: str) -> None:
        self._current = f"write {key}"
        super().set(key, value)

    def append(self, key: str, value: str) -> None:
        self._current = f"write {key}"
        super().append(key, value)

    def add(self, key: str, amount: int) -> int:
        self._current = f"write {key}"
        return super().add(key, amount)

    def multi_get(self, keys: list[str], *, since: int | None = None) -> list[bytes]:
        self._current = "read " + " ".join(keys)
        return super().multi_get(keys, since=since)

    def read(self, key: str) -> bytes | None:
        self._current = f"check {key}"
        return super().read(key)

    def wait(self, key: str, seconds: float, *, since: int | None = None) -> bytes | None:
        self._current = f"wait {key}"
        return super().wait(key, seconds, since=since)

    def _woken(self, key: str) -> None:
        self.woken += 1


@pytest.fixture
def server() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _client(
    server: TCPStore,
    replica_id: str,
    *,
    rank: int = 0,
    size: int = 1,
    min_replicas: int = 1,
    quorum: float = SECONDS,
    heartbeat: float = SECONDS,
) -> QuorumClient:
    policy = Policy(min_replicas, quorum, heartbeat)
    return QuorumClient(CountingClient(server.port), replica_id, rank, size, uuid.uuid4().hex[:16], policy)


def _pair(server: TCPStore) -> tuple[QuorumClient, QuorumClient, Quorum]:
    """Replicas ``a`` and ``b`` (``min_replicas=2``), registered, and the first quorum they formed."""
    a, b = _client(server, "a", min_replicas=2), _client(server, "b", min_replicas=2)
    a.register(0)
    b.register(0)
    return a, b, _in_threads({"a": partial(a.form, 0, 0), "b": partial(b.form, 0, 0)})["a"]


def _requests(client: QuorumClient) -> list[str]:
    """The requests ``client`` sent so far (see :class:`CountingClient`)."""
    assert isinstance(client.client, CountingClient)
    return client.client.keys


def _in_threads(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run ``calls`` at once, one thread each; return their results (or the exceptions they raised)."""
    got: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Any]) -> None:
        try:
            got[name] = fn()
        except Exception as ex:
            got[name] = ex

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    assert all(not t.is_alive() for t in threads), "a protocol call hung"
    return got


def test_a_paused_process_skips_the_rounds_deleted_meanwhile(server: TCPStore) -> None:
    a = _client(server, "a")
    a.register(0)
    last = 0
    for step in range(5):  # replica a trains alone: rounds 1 to 5
        quorum = a.form(last, step)
        assert quorum.members == ("a",)
        assert a.vote(quorum, True, SECONDS)
        last = quorum.round
    closed = a.take_closed()  # the rounds a published as their leader, each handed out once
    assert closed == list(range(1, last + 1)) and a.take_closed() == []
    for n in closed:
        collect(a.client, n)
    assert not server.check([f"{ROOT}r/2/result"]) and server.check([f"{ROOT}r/{last - KEEP_ROUNDS + 1}/result"])

    # Replica b now acts as a process that took part in round 1 and was paused since: it comes
    # back to round 2, which closed long ago and whose keys were deleted.
    b = _client(server, "b")
    b.register(0)
    got = _in_threads({"b": lambda: b.form(1, 0), "a": lambda: a.form(last, 5)})
    # Both are in round 6; round 2 was not closed again by b.
    assert got["a"] == got["b"]
    assert got["b"].round == last + 1 and got["b"].members == ("a", "b")
    assert got["b"].heal == {"b": "a"}
    assert not server.check([f"{ROOT}r/2/result"])


def test_collect_keeps_the_rounds_still_read(server: TCPStore) -> None:
    a = _client(server, "a")
    a.register(0)
    last = 0
    for step in range(4):
        quorum = a.form(last, step)
        assert a.vote(quorum, True, SECONDS)
        last = quorum.round
    collect(a.client, last)
    assert not any(server.check([f"{ROOT}r/{last - KEEP_ROUNDS}/{p}"]) for p in ROUND_KEYS)
    for n in range(last - KEEP_ROUNDS + 1, last + 1):
        assert all(server.check([f"{ROOT}r/{n}/{p}"]) for p in ROUND_KEYS), n


def test_a_vote_read_after_its_round_was_deleted_is_lost_not_invented(server: TCPStore) -> None:
    a, x = _client(server, "a", min_replicas=2), _client(server, "x", min_replicas=2)
    a.register(0)
    x.register(0)
    got = _in_threads({"x": lambda: x.form(0, 0), "a": lambda: a.form(0, 0)})
    first = got["a"]
    assert got["x"] == first and first.members == ("a", "x")
    votes = _in_threads({"x": lambda: x.vote(first, True, SECONDS), "a": lambda: a.vote(first, True, SECONDS)})
    assert votes == {"a": True, "x": True}
    # x pauses; a goes on alone for two more rounds and round 1's keys are deleted.
    x.leave()
    a.policy = Policy(1, SECONDS, SECONDS)
    last = first.round
    for step in (1, 2):
        quorum = a.form(last, step)
        assert quorum.members == ("a",) and a.vote(quorum, True, SECONDS)
        last = quorum.round
    collect(a.client, last)
    assert not server.check([f"{ROOT}r/{first.round}/decision"])
    # x comes back and votes again in round 1: the decision is gone; x must not write one, and
    # the vote counter its vote created is deleted again.
    assert x.vote(first, True, SECONDS) is None
    assert not server.check([f"{ROOT}r/{first.round}/decision"])
    assert not server.check([f"{ROOT}r/{first.round}/ok"])


def test_the_last_voter_decides_in_two_requests_and_a_middle_one_in_one_before_polling(server: TCPStore) -> None:
    # Three replicas vote: the first checks the round still exists, the second only counts
    # itself, and the last (whose count completes the vote) counts itself and writes the
    # decision, whose value it reads back from that one request.
    clients = [_client(server, rid, min_replicas=3) for rid in "abc"]
    for c in clients:
        c.register(0)
    quorum = _in_threads({c.replica_id: partial(c.form, 0, 0) for c in clients})["a"]
    before = [len(_requests(c)) for c in clients]
    votes: dict[str, Any] = {}
    ok = f"{ROOT}r/{quorum.round}/ok"
    first = threading.Thread(target=lambda: votes.update(a=clients[0].vote(quorum, True, SECONDS)))
    first.start()
    while not server.check([ok]):
        time.sleep(0.001)
    second = threading.Thread(target=lambda: votes.update(b=clients[1].vote(quorum, True, SECONDS)))
    second.start()
    while server.add(ok, 0) < 2:
        time.sleep(0.001)
    assert clients[2].vote(quorum, True, SECONDS) is True
    first.join(6 * SECONDS)
    second.join(6 * SECONDS)
    assert votes == {"a": True, "b": True}
    sent = [_requests(c)[n:] for c, n in zip(clients, before, strict=True)]
    decision = f"{ROOT}r/{quorum.round}/decision"
    assert sent[2] == [f"write {ok}", f"write {decision}"], sent[2]
    assert sent[0][:2] == [f"write {ok}", f"read {ROOT}r/{quorum.round}/result"], sent[0]
    # The middle one polls the decision: `check` (waking no waiting request) until it exists, then reads it.
    assert sent[1][0] == f"write {ok}" and sent[1][-1] == f"read {decision}", sent[1]
    assert set(sent[1][1:]) <= {f"check {decision}", f"read {decision}"}, sent[1]


def test_a_failed_vote_aborts_for_everyone(server: TCPStore) -> None:
    a, b, quorum = _pair(server)
    votes = _in_threads({"a": lambda: a.vote(quorum, True, SECONDS), "b": lambda: b.vote(quorum, False, SECONDS)})
    assert votes == {"a": False, "b": False}


def test_a_duplicate_is_refused_naming_both_and_the_first_goes_on(server: TCPStore) -> None:
    first = _client(server, "r", rank=1, size=2)
    first.register(0)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.05):
            first.beat(0)

    beater = threading.Thread(target=beat)
    beater.start()
    duplicate = _client(server, "r", rank=1, size=2)
    try:
        with pytest.raises(IdentityError, match=r"replica 'r' rank 1 is already taken by a live process at .*:\d+; "):
            duplicate.register(0)
    finally:
        stop.set()
        beater.join()
    first.beat(1)  # still the owner: no error


def test_a_restart_right_after_a_death_takes_the_identity_over(server: TCPStore) -> None:
    # The dead incarnation's heartbeat is still fresh, but it never changes again: the new one
    # waits for it to grow older than `heartbeat_timeout` and takes over (no false duplicate).
    dead = _client(server, "r", heartbeat=0.5)
    dead.register(0)
    restarted = _client(server, "r", heartbeat=0.5)
    restarted.register(0)
    with pytest.raises(IdentityError, match="taken over by a new incarnation"):
        dead.beat(1)


def test_a_process_seen_dead_is_marked_once_by_its_incarnation_and_a_beat_undoes_a_false_mark(
    server: TCPStore,
) -> None:
    watched, watcher = _client(server, "w"), _client(server, "x")
    watched.register(0)
    assert watcher.address_of(("w", 0), "another incarnation") is None
    assert watcher.address_of(("w", 0), watched.token) == "-"  # the address it published
    assert not watcher.mark_dead(("w", 0), "another incarnation")
    assert watcher.mark_dead(("w", 0), watched.token)
    assert not watcher.mark_dead(("w", 0), watched.token)  # already marked
    policy = Policy(1, SECONDS, SECONDS)
    assert "w" not in policy.live(watcher._view(1, 0.0))
    # A restart is let in at once: the old incarnation was seen dead.
    restarted = _client(server, "w")
    restarted.register(0)
    assert "w" in policy.live(watcher._view(1, 0.0))
    with pytest.raises(IdentityError, match="taken over by a new incarnation"):
        watched.beat(1)
    # A live process taken for dead writes its next heartbeat over the mark.
    assert watcher.mark_dead(("w", 0), restarted.token)
    restarted.beat(1)
    assert "w" in policy.live(watcher._view(1, 0.0))
    restarted.leave()
    assert not watcher.mark_dead(("w", 0), restarted.token)  # it left: not a death


def test_a_silent_incarnation_is_replaced_and_learns_it(server: TCPStore) -> None:
    old = _client(server, "r", heartbeat=0.05)
    old.register(0)
    new = _client(server, "r", heartbeat=0.05)
    assert wait_until(
        lambda: _registers(new), timeout=100.0
    )  # once old's heartbeat is older than 50 ms, new takes over
    with pytest.raises(IdentityError, match="taken over by a new incarnation"):
        old.beat(1)


def _registers(client: QuorumClient) -> bool:
    try:
        client.register(0)
    except IdentityError:
        return False
    return True


def test_a_process_that_never_joins_does_not_block_the_others(server: TCPStore) -> None:
    # Replica b has 2 processes; rank 1 never reaches `join` (no heartbeat key at all). Replica a
    # forms its quorum without waiting: before the fix, reading b's missing heartbeat key blocked
    # every round for the store timeout.
    a = _client(server, "a")
    a.register(0)
    b0 = _client(server, "b", rank=0, size=2)
    b0.register(0)
    quorum = _in_threads({"a": lambda: a.form(0, 0)})["a"]
    assert isinstance(quorum, Quorum) and quorum.members == ("a",)


def test_fewer_than_min_replicas_joined_gives_up_naming_the_quorum(server: TCPStore) -> None:
    # Replica b heartbeats but never joins: with min_replicas=2 nobody can go on. Both a and a
    # second process of a's round raise with the leader's reason, not hang.
    a = _client(server, "a", min_replicas=2, quorum=0.3)
    b = _client(server, "b", min_replicas=2, quorum=0.3)
    a.register(0)
    b.register(0)
    got = _in_threads({"a": lambda: a.form(0, 0)})
    assert isinstance(got["a"], QuorumTimeoutError), got
    assert "quorum 1" in str(got["a"]) and "`min_replicas`=2" in str(got["a"]) and "['a']" in str(got["a"])


def test_a_non_leaders_traffic_does_not_read_the_other_replicas(server: TCPStore) -> None:
    # Eight replicas form quorums and vote: only the round's leader (and the first voter, which
    # proposes the next round) reads the joins, the registry and the heartbeats; every other
    # process touches its own keys and one key per wait.
    clients = [_client(server, str(i), min_replicas=8) for i in range(8)]
    for c in clients:
        c.register(0)
    last = 0
    for step in range(3):
        quorums = _in_threads({c.replica_id: partial(c.form, last, step) for c in clients})
        quorum = quorums["0"]
        assert all(q == quorum for q in quorums.values()) and len(quorum.members) == 8
        votes = _in_threads({c.replica_id: partial(c.vote, quorum, True, SECONDS) for c in clients})
        assert votes == {c.replica_id: True for c in clients}
        last = quorum.round
    leaders = {server.get(f"{ROOT}r/{n}/leader").decode().split("|")[0] for n in range(1, last + 1)}
    assert len(leaders) < 8
    for c in clients:
        counting = c.client
        assert isinstance(counting, CountingClient)
        joined = counting.keys.index(f"write {ROOT}r/1/joins")
        reads = [k.removeprefix("read ") for k in counting.keys[joined:] if k.startswith("read ")]
        proposer = any(k.startswith(f"write {ROOT}r/") and k.endswith("/next") for k in counting.keys)
        if c.replica_id not in leaders and not proposer:
            assert not any(k.startswith(f"{ROOT}hb/") or k.endswith(("/joins", "/reg")) for k in reads), reads


def test_a_member_silent_during_a_step_aborts_it_and_ends_the_vote(server: TCPStore) -> None:
    # Replicas a, b, c form a quorum; then c goes silent. b watches c (the next member): seen
    # through a policy whose `heartbeat_timeout` is 1 s, c's silence aborts the step for every
    # member (one key), and a vote with a 600 s deadline ends on it (the harness would call a
    # 600 s wait a hang).
    clients = {rid: _client(server, rid) for rid in "abc"}
    for client in clients.values():
        client.register(0)
    quorum = _in_threads({rid: partial(c.form, 0, 0) for rid, c in clients.items()})["a"]
    assert isinstance(quorum, Quorum) and quorum.members == ("a", "b", "c")
    b = clients["b"]
    watcher = QuorumClient(b.client, "b", 0, 1, b.token, Policy(1, SECONDS, 1.0))
    clients["c"].beat(0)
    assert watcher.check_step(quorum) is None
    assert clients["a"].check_step(quorum) is None  # a watches b
    assert not server.check([f"{ROOT}r/{quorum.round}/decision"])
    votes = _in_threads(
        {"a": partial(clients["a"].vote, quorum, True, 600.0), "b": partial(watcher.vote, quorum, True, 600.0)}
    )
    assert votes == {"a": False, "b": False}
    reason = watcher.check_step(quorum)
    assert reason is not None and "replica 'c' rank 0 of the quorum was silent for" in reason, reason
    assert clients["a"].check_step(quorum) == "a member of the quorum aborted the step"


def _watching(watcher: QuorumClient, quorum: Quorum, deadline: float, until: threading.Event) -> threading.Thread:
    """What a process's heartbeat thread does while its training thread blocks in a vote: watch
    the vote (:meth:`QuorumClient.watch_vote`) every heartbeat period, on its own connection."""

    def run() -> None:
        while not until.wait(watcher.watch_interval):
            watcher.watch_vote(quorum, deadline)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_blocked_vote_learns_the_decision_in_one_request_and_its_watcher_ends_it(server: TCPStore) -> None:
    # a, b and c vote on round 1, a and b blocking for the decision (`block`): each learns it
    # from one blocking request, without polling.
    clients = {rid: _client(server, rid) for rid in "abc"}
    for client in clients.values():
        client.register(0)
    quorum = _in_threads({rid: partial(c.form, 0, 0) for rid, c in clients.items()})["a"]
    assert quorum.members == ("a", "b", "c")
    before = {rid: len(_requests(c)) for rid, c in clients.items()}
    ok, decision = f"{ROOT}r/{quorum.round}/ok", f"{ROOT}r/{quorum.round}/decision"
    votes: dict[str, Any] = {}
    blocked = []
    for n, rid in enumerate("ab", 1):
        blocked.append(threading.Thread(target=partial(_record_vote, votes, clients[rid], quorum, block=True)))
        blocked[-1].start()
        assert wait_until(partial(_counted, server, ok, n), timeout=100.0)
    assert wait_until(lambda: sum(f"wait {decision}" in _requests(clients[r]) for r in "ab") == 2, timeout=100.0)
    votes["c"] = clients["c"].vote(quorum, True, SECONDS)
    for thread in blocked:
        thread.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    assert votes == {"a": True, "b": True, "c": True}
    sent = {rid: _requests(c)[before[rid] :] for rid, c in clients.items()}
    assert sent["b"] == [f"write {ok}", f"wait {decision}"], sent["b"]
    assert sent["a"] == [f"write {ok}", f"read {ROOT}r/{quorum.round}/result", f"wait {decision}"], sent["a"]
    # Round 2: c goes silent. a and b block for the decision with a 60 s deadline; b's other
    # thread watches the vote, sees c silent (its policy's `heartbeat_timeout` is 1 s) and writes
    # `abort`, which ends both waits (without it, a and b would abort at their deadline).
    second = _in_threads({rid: partial(c.form, quorum.round, 1, (quorum, True)) for rid, c in clients.items()})["a"]
    assert second.members == ("a", "b", "c") and second.round == 2
    b = clients["b"]
    watcher = QuorumClient(CountingClient(server.port), "b", 0, 1, b.token, Policy(1, SECONDS, 1.0))
    done = threading.Event()
    watching = _watching(watcher, second, time.monotonic() + 600.0, done)  # not its deadline: c's silence
    votes = _in_threads({rid: partial(clients[rid].vote, second, True, 60.0, block=True) for rid in "ab"})
    done.set()
    watching.join(timeout=6 * SECONDS)
    assert votes == {"a": False, "b": False}
    assert server.get(f"{ROOT}r/{second.round}/decision") == b"abort"
    assert f"write {ROOT}r/{second.round}/decision" in _requests(watcher)  # the watcher's abort ended the waits


def test_checking_a_step_wakes_no_member_blocked_in_its_vote(server: TCPStore) -> None:
    # a blocks for the decision while b checks the step (as a member still in a collective does,
    # and every heartbeat thread watching a vote, every 0.1 s): b reads the decision without
    # waking a's wait (a read by `compare_set` of the missing key would, and a would ask again:
    # requests growing with the square of the members).
    a, b, quorum = _pair(server)
    decision = f"{ROOT}r/{quorum.round}/decision"
    votes: dict[str, Any] = {}
    voting = threading.Thread(target=partial(_record_vote, votes, a, quorum, block=True))
    voting.start()
    assert wait_until(lambda: f"wait {decision}" in _requests(a), timeout=100.0)
    for _ in range(20):  # over 0.2 s: the wait recorded above reaches the store meanwhile
        assert b.check_step(quorum) is None
        time.sleep(0.01)
    votes["b"] = b.vote(quorum, True, SECONDS)
    voting.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    assert votes == {"a": True, "b": True}
    assert isinstance(a.client, CountingClient) and a.client.woken == 0
    assert f"check {decision}" in _requests(b) and f"read {decision}" not in _requests(b)


def test_a_blocking_wait_outlasts_reads_of_its_missing_key(server: TCPStore) -> None:
    # torch's store wakes a waiting request when another client's `compare_set` finds the key
    # missing (every `peek`), answering an empty value: the wait must go on until the key is set.
    waiter, reader = CountingClient(server.port), CountingClient(server.port)
    key = f"{ROOT}r/1/decision"
    got: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: got.update(value=waiter.wait(key, 600.0)))
    waiting.start()
    assert wait_until(lambda: f"wait {key}" in waiter.keys, timeout=100.0)
    for _ in range(50):  # reads while the waiter blocks (the first one after it blocked woke it)
        assert reader.peek(key) is None
        time.sleep(0.01)
    assert waiting.is_alive(), got
    reader.compare_set(key, "", "commit")
    waiting.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    assert got == {"value": b"commit"}
    # The decision is written right after such a wake-up, before the waiter checks the key: it
    # reads the decision, not the empty answer of the wake-up.
    other = f"{ROOT}r/2/decision"
    woken = WokenClient(server.port, lambda: reader.compare_set(other, "", "commit"))
    waiting = threading.Thread(target=lambda: got.update(value=woken.wait(other, 600.0)))
    waiting.start()
    assert wait_until(lambda: woken.waiting, timeout=100.0)
    while waiting.is_alive() and not woken.fired:
        reader.peek(other)
        time.sleep(0.01)
    waiting.join(timeout=6 * SECONDS)
    assert woken.fired and got == {"value": b"commit"}, got


def test_a_blocked_vote_ends_at_its_deadline_and_writes_nothing_in_a_deleted_round(server: TCPStore) -> None:
    # a and b form round 1; b never votes but stays live. a blocks for the decision; its watcher
    # writes `abort` once the vote's deadline passed. Then, in round 2, a blocks again and the
    # round's keys are deleted under it (as if a had been paused until two more rounds closed,
    # before its wait reached the store): at its deadline a loses the vote and writes no decision.
    a, b, first = _pair(server)
    watcher = QuorumClient(CountingClient(server.port), "a", 0, 1, a.token, a.policy)
    done = threading.Event()
    watching = _watching(watcher, first, time.monotonic() + 0.5, done)
    assert a.vote(first, True, SECONDS, block=True) is False
    done.set()
    watching.join(timeout=6 * SECONDS)
    assert f"write {ROOT}r/{first.round}/decision" in _requests(watcher)
    second = _in_threads(
        {"a": lambda: a.form(first.round, 0, (first, False)), "b": lambda: b.form(first.round, 0, (first, False))}
    )["a"]
    votes: dict[str, Any] = {}
    voting = threading.Thread(target=lambda: votes.update(a=a.vote(second, True, 1.0, block=True)))
    voting.start()
    assert wait_until(lambda: f"wait {ROOT}r/{second.round}/decision" in _requests(a), timeout=100.0)
    collect(b.client, second.round + KEEP_ROUNDS)
    voting.join(timeout=6 * SECONDS)
    assert votes == {"a": None}
    assert not server.check([f"{ROOT}r/{second.round}/decision"]), "a decision was written in a deleted round"


def test_a_dropped_mark_written_between_the_leaders_reads_is_not_missed(server: TCPStore) -> None:
    # Replicas a and b commit round 1 on one group. b then drops that group after its vote (a
    # collective failed after `should_commit`): it marks round 1 `dropped`, then joins round 2. a
    # leads round 2; b's mark and join land right after a read round 1's `dropped` key (the seam).
    # A leader that read the mark before the joins would see b's join without its mark and reuse
    # the dropped group; reading the joins first, it sees either neither or both.
    a, b, first = _pair(server)
    assert first.members == ("a", "b") and first.group == first.round
    votes = _in_threads({"a": lambda: a.vote(first, True, SECONDS), "b": lambda: b.vote(first, True, SECONDS)})
    assert votes == {"a": True, "b": True}
    second: dict[str, Any] = {}

    def b_drops_and_joins() -> None:
        b.mark_dropped(first)
        joining = threading.Thread(target=lambda: second.update(b=b.form(first.round, 1, (first, True))))
        joining.start()
        second["b_thread"] = joining
        joins = f"{ROOT}r/{first.round + 1}/joins"
        assert wait_until(lambda: server.check([joins]) and b"\nb|" in b"\n" + server.get(joins), timeout=100.0)

    seam = InterleavingClient(server.port, f"{ROOT}r/{first.round}/dropped", b_drops_and_joins)
    leader = QuorumClient(seam, "a", 0, 1, a.token, a.policy)
    b.client.add(f"{ROOT}r/{first.round + 1}/count", 0)  # nobody has joined round 2 yet
    quorum = leader.form(first.round, 1, (first, True))
    second["b_thread"].join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    assert seam.fired and second["b"] == quorum
    assert quorum.members == ("a", "b") and quorum.round == first.round + 1
    assert quorum.group == quorum.round, "the group b dropped after its vote was reused"


def test_a_heartbeat_that_looks_silent_once_is_confirmed_before_the_step_aborts(server: TCPStore) -> None:
    # A store that stalls holds every heartbeat write back, so the heartbeat b watches (a's) looks
    # older than `heartbeat_timeout` on one read, then the next beat lands. One such read must not
    # abort the step: only a second read, a heartbeat period later, that finds the same heartbeat does.
    a, b = _client(server, "a"), _client(server, "b")
    a.register(0)
    b.register(0)
    quorum = _in_threads({"a": lambda: a.form(0, 0), "b": lambda: b.form(0, 0)})["a"]
    assert quorum.members == ("a", "b")
    watcher = QuorumClient(b.client, "b", 0, 1, b.token, Policy(1, SECONDS, 0.05))
    decision = f"{ROOT}r/{quorum.round}/decision"
    a.beat(0)
    threading.Event().wait(0.1)  # a's heartbeat is now older than the watcher's `heartbeat_timeout`
    assert watcher.check_step(quorum) is None  # seen silent once: not yet
    assert not server.check([decision])
    a.beat(0)  # the stall ends: a's next heartbeat lands
    assert watcher.check_step(quorum) is None
    assert not server.check([decision])
    # Really silent: the same heartbeat read again a period later aborts the step for everyone.
    assert wait_until(lambda: watcher.check_step(quorum) is not None, timeout=100.0)
    assert server.get(decision) == b"abort"
    reason = watcher.check_step(quorum)
    assert reason is not None and "replica 'a' rank 0 of the quorum was silent for" in reason, reason


def _reads(sent: dict[str, list[str]], key: str) -> dict[str, int]:
    """How many times each client in ``sent`` (its requests) read ``key``, for those that did."""
    return {rid: n for rid, keys in sent.items() if (n := keys.count(f"read {key}"))}


def _record_vote(votes: dict[str, Any], voter: QuorumClient, quorum: Quorum, *, block: bool = False) -> None:
    """``voter`` votes ok on ``quorum``'s step; its decision goes into ``votes`` under its replica id."""
    votes[voter.replica_id] = voter.vote(quorum, True, SECONDS, block=block)


def _counted(server: TCPStore, ok: str, n: int) -> bool:
    """Whether at least ``n`` votes are counted in the counter ``ok``."""
    return server.check([ok]) and server.add(ok, 0) >= n


def _votes_in_order(server: TCPStore, quorum: Quorum, voters: tuple[QuorumClient, ...]) -> dict[str, Any]:
    """Every voter of ``voters`` votes ok on ``quorum``'s step, in that order (each in a thread
    once the previous one's vote is counted); their decisions by replica id."""
    got: dict[str, Any] = {}
    threads = []
    for count, voter in enumerate(voters, 1):
        threads.append(threading.Thread(target=partial(_record_vote, got, voter, quorum)))
        threads[-1].start()
        assert wait_until(partial(_counted, server, f"{ROOT}r/{quorum.round}/ok", count), timeout=100.0)
    for thread in threads:
        thread.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    return got


def _decider(clients: tuple[QuorumClient, ...], quorum: Quorum) -> QuorumClient:
    """The client whose vote completed ``quorum``'s count: the one that wrote its decision."""
    deciders = [c for c in clients if f"write {ROOT}r/{quorum.round}/decision" in _requests(c)]
    assert len(deciders) == 1, [c.replica_id for c in deciders]
    return deciders[0]


def test_no_proposal_is_written_into_a_round_whose_keys_were_deleted(server: TCPStore) -> None:
    # The last voter proposes when it enters the next step. Paused until the round's keys were
    # deleted (as when the others closed two more rounds meanwhile), it writes no proposal there:
    # nothing would ever delete it. The next round is then decided by its leader.
    a, b, first = _pair(server)
    votes = _in_threads({"a": lambda: a.vote(first, True, SECONDS), "b": lambda: b.vote(first, True, SECONDS)})
    assert votes == {"a": True, "b": True}
    collect(a.client, first.round + KEEP_ROUNDS)  # round 1's keys are gone
    second = _in_threads({c.replica_id: partial(c.form, first.round, 1, (first, True)) for c in (a, b)})
    assert second["a"] == second["b"] and second["a"].members == ("a", "b"), second
    assert not server.check([f"{ROOT}r/{first.round}/next"]), "a proposal was written into a deleted round"


def test_an_unchanged_quorum_is_proposed_by_the_last_voter_and_published_by_the_last_member_to_join(
    server: TCPStore,
) -> None:
    # After a committed step, the next round is the one the step's last voter proposed when it
    # entered the next step (the vote itself writes no proposal), published by the last member
    # to join it (no leader reads the joins, the registry or the heartbeats); a registration
    # after the proposal voids it, and the leader decides from the joins.
    a, b, first = _pair(server)
    assert _in_threads({"a": lambda: a.vote(first, True, SECONDS), "b": lambda: b.vote(first, True, SECONDS)}) == {
        "a": True,
        "b": True,
    }
    assert not server.check([f"{ROOT}r/{first.round}/next"]), "the vote wrote a proposal"
    proposer = _decider((a, b), first).replica_id
    before = {c.replica_id: len(_requests(c)) for c in (a, b)}
    second = _in_threads({c.replica_id: partial(c.form, first.round, 1, (first, True)) for c in (a, b)})
    assert second["a"] == second["b"] and second["a"].members == ("a", "b") and second["a"].group == first.group
    sent = {c.replica_id: _requests(c)[before[c.replica_id] :] for c in (a, b)}
    assert [rid for rid, keys in sent.items() if f"write {ROOT}r/{first.round}/next" in keys] == [proposer], sent
    proposal = server.get(f"{ROOT}r/{first.round}/next").decode().split("|", 2)[2]
    assert server.get(f"{ROOT}r/{second['a'].round}/result").decode() == proposal
    assert [rid for rid, keys in sent.items() if f"read {ROOT}r/{first.round}/next" in keys], sent
    # The proposal path, not the leader: only the proposal's view read the round's joins, and the
    # last to join wrote its result.
    assert _reads(sent, f"{ROOT}r/{second['a'].round}/joins") == {proposer: 1}, sent
    # Only the last member to join reads the proposal (`_join`): it is the one that wrote the result.
    publishers = [rid for rid, keys in sent.items() if f"write {ROOT}r/{second['a'].round}/result" in keys]
    assert publishers == [rid for rid, keys in sent.items() if f"read {ROOT}r/{first.round}/next" in keys], sent
    # A step that was not committed leaves nothing to propose: the leader decides.
    votes = _in_threads({c.replica_id: partial(c.vote, second["a"], c.replica_id == "a", SECONDS) for c in (a, b)})
    assert votes == {"a": False, "b": False}
    c = _client(server, "c", min_replicas=2)
    c.register(0)
    third = _in_threads(
        {x.replica_id: partial(x.form, second["a"].round, 1, (second["a"], False)) for x in (a, b)}
        | {"c": lambda: c.form(0, 0)}
    )
    assert third["a"] == third["b"] == third["c"] and third["a"].members == ("a", "b", "c"), third
    assert not server.check([f"{ROOT}r/{second['a'].round}/next"])
    # The epoch alone voids a proposal: the last voter proposes and joins, then d registers and
    # leaves before the others join (d never joins, so the round's join count is the
    # proposal's): the leader decides.
    votes = _in_threads({x.replica_id: partial(x.vote, third["a"], True, SECONDS) for x in (a, b, c)})
    assert votes == {"a": True, "b": True, "c": True}
    last = _decider((a, b, c), third["a"])
    before = {x.replica_id: len(_requests(x)) for x in (a, b, c)}
    fourth: dict[str, Any] = {}
    first_in = threading.Thread(
        target=lambda: fourth.update({last.replica_id: last.form(third["a"].round, 2, (third["a"], True))})
    )
    first_in.start()
    joins = f"{ROOT}r/{third['a'].round + 1}/joins"
    assert wait_until(lambda: server.check([joins]), timeout=100.0)
    assert server.check([f"{ROOT}r/{third['a'].round}/next"]), "the last voter joined before it proposed"
    d = _client(server, "d", min_replicas=2)
    d.register(0)
    d.leave()
    others = tuple(x for x in (a, b, c) if x is not last)
    fourth |= _in_threads({x.replica_id: partial(x.form, third["a"].round, 2, (third["a"], True)) for x in others})
    first_in.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    assert fourth["a"] == fourth["b"] == fourth["c"] and fourth["a"].members == ("a", "b", "c"), fourth
    sent = {x.replica_id: _requests(x)[before[x.replica_id] :] for x in (a, b, c)}
    assert sum(_reads(sent, f"{ROOT}r/{fourth['a'].round}/joins").values()) > 1, sent  # the proposal's and a leader's


def test_a_spare_leading_the_next_round_waits_for_the_members_step_then_times_out_from_its_end(
    server: TCPStore,
) -> None:
    # SparesPolicy(2) over a, b and the spare s: s joins round 2 at once and leads it while a and
    # b step, longer than `quorum_timeout`. a joins, and b's join lands right after s read the
    # joins holding a's only (the seam): the round's wait began when a joined, so b is not timed
    # out: the quorum is a and b again, s still a spare.
    timeout = 1.0
    policy = SparesPolicy(2, timeout, SECONDS)
    a, b = (QuorumClient(CountingClient(server.port), r, 0, 1, uuid.uuid4().hex[:16], policy) for r in "ab")
    joined: dict[str, Any] = {}

    def b_joins() -> None:
        joining = threading.Thread(target=lambda: joined.update(b=b.form(first.round, 1, (first, False))))
        joining.start()
        joined["b_thread"] = joining
        joins = f"{ROOT}r/{first.round + 1}/joins"
        assert wait_until(lambda: b"\nb|" in b"\n" + server.get(joins), timeout=100.0)

    seam = InterleavingClient(
        server.port, f"{ROOT}r/2/joins", b_joins, when=lambda value: value is not None and b"\na|" in b"\n" + value
    )
    s = QuorumClient(seam, "s", 0, 1, uuid.uuid4().hex[:16], policy)
    for c in (a, b, s):
        c.register(0)
    # s's `form` returns only at the first round that takes it in.
    waiting = threading.Thread(target=lambda: joined.update(s=s.form(0, 0)))
    waiting.start()
    first = _in_threads({c.replica_id: partial(c.form, 0, 0) for c in (a, b)})["a"]
    assert first.members == ("a", "b") and first.spares == ("s",)
    assert wait_until(lambda: server.check([f"{ROOT}r/2/joins"]), timeout=100.0)
    threading.Event().wait(1.5 * timeout)  # the members' step: s has waited longer than `quorum_timeout`
    assert not server.check([f"{ROOT}r/2/result"])
    second = a.form(first.round, 1, (first, False))
    joined["b_thread"].join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    assert seam.fired and second.members == ("a", "b") and second.spares == ("s",) and second.timed_out == ()
    assert joined["b"] == second and second.round == 2
    # b leaves: the next round takes s in.
    b.leave()
    third = a.form(second.round, 2, (second, False))
    waiting.join(timeout=6 * SECONDS)
    assert third.members == ("a", "s") and joined["s"] == third and third.heal == {"s": "a"}


@pytest.mark.parametrize("pause_after", ["r/1/next", "closed"])
def test_a_publisher_paused_until_its_round_was_deleted_does_not_bring_it_back(
    server: TCPStore, pause_after: str
) -> None:
    # Round 1 of a and b commits, a voting last: a proposes round 2 as it enters it. b is the
    # last member to join round 2 and publishes the proposal. It pauses right after reading the
    # proposal (or `closed`, its last read before its `compare_set`) while a leads round 2,
    # closes rounds 3 and 4 without b (b left meanwhile, and comes back) and deletes round 2's
    # keys. b must not publish round 2 again nor set `closed` back: it goes on to the first open
    # round, 5.
    a, b = _client(server, "a"), _client(server, "b")
    a.register(0)
    b.register(0)
    first = _in_threads({"a": lambda: a.form(0, 0), "b": lambda: b.form(0, 0)})["a"]
    votes = _votes_in_order(server, first, (b, a))
    assert votes == {"a": True, "b": True}
    got: dict[str, Any] = {}

    def a_closes_rounds_2_to_4() -> None:
        got["a_thread"].join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
        b.leave()
        quorum = got["a"]
        for step in (2, 3):
            quorum = a.form(quorum.round, step, (quorum, False))
        for closed in a.take_closed():
            collect(a.client, closed)
        assert quorum.round == 4 and not server.check([f"{ROOT}r/2/result"])
        b.beat(1)

    seam = InterleavingClient(server.port, ROOT + pause_after, a_closes_rounds_2_to_4)
    paused = QuorumClient(seam, "b", 0, 1, b.token, b.policy)
    got["a_thread"] = threading.Thread(target=lambda: got.update(a=a.form(first.round, 1, (first, True))))
    got["a_thread"].start()  # a proposes round 2, then joins it first and leads it
    assert wait_until(lambda: server.check([f"{ROOT}r/2/joins"]), timeout=100.0)
    assert server.check([f"{ROOT}r/1/next"])
    b_thread = threading.Thread(target=lambda: got.update(b=paused.form(first.round, 1, (first, True))))
    b_thread.start()
    assert wait_until(lambda: seam.fired, timeout=100.0)
    assert wait_until(lambda: server.check([f"{ROOT}r/5/joins"]), timeout=100.0)
    assert server.get(f"{ROOT}r/5/joins").startswith(b"b|")
    assert server.get(f"{ROOT}closed") == b"4" and not server.check([f"{ROOT}r/2/result"])
    fifth = a.form(4, 4, (first, False))
    b_thread.join(timeout=6 * SECONDS)
    assert got["b"] == fifth and fifth.round == 5 and fifth.members == ("a", "b")
