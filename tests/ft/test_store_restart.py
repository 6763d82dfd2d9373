"""The store protocol of gang.ft when the coordination store restarts in the middle of one call.

A real ``TCPStore`` is killed (every connection to it closes) and a new, empty one starts on the
same port between two requests of one protocol call (a test-only seam on the caller's store
client runs the restart right after a given request returned); the clients reconnect to it by
themselves, as they do to a restarted ``python -m gang.ft.store``. Replicas are threads driving
:class:`~gang.ft.quorum.QuorumClient` directly, as in ``test_quorum.py``.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import pytest

from gang._torch_groups import TCPStore, serve_store
from gang.ft.group import wait_until
from gang.ft.policy import Policy
from gang.ft.quorum import ROOT, STARTED, QuorumClient, StepDeadlineError, StoreClient

SECONDS = 20.0
"""Heartbeat and quorum timeouts long enough that heartbeats written once stay fresh on a busy machine."""


class RestartableStore:
    """A real ``TCPStore`` server on a fixed port of 127.0.0.1 that :meth:`restart` replaces.

    Only this object holds the server, so dropping it closes the server's socket and every
    connection to it, as killing ``python -m gang.ft.store`` does.
    """

    def __init__(self) -> None:
        self.server: TCPStore = serve_store("127.0.0.1")  # listens on 127.0.0.1 only
        self.port = self.server.port
        self.restarts = 0

    def restart(self) -> None:
        """Stop the store and start a new, empty one on the same port."""
        del self.server
        gc.collect()
        self.server = serve_store("127.0.0.1", self.port)
        self.restarts += 1

    def has(self, key: str) -> bool:
        """Whether the current store holds ``gang.ft/<key>``."""
        return self.server.check([ROOT + key])


def _nothing() -> None:
    pass


def _always() -> bool:
    return True


class SeamClient(StoreClient):
    """A store client that, once armed, runs ``then()`` once, right after its next ``add`` or
    ``compare_set`` (which ``peek`` is) on ``key`` returned (a test-only seam: every request goes
    to the real store).

    :param timeout: The timeout of one request (how long a read of a missing key waits).
    """

    def __init__(self, port: int, *, timeout: float = SECONDS) -> None:
        super().__init__("127.0.0.1", port, retry=timeout, timeout=timedelta(seconds=timeout))
        self._key = ""
        self._then: Callable[[], None] = _nothing
        self._when: Callable[[], bool] = _always
        self.fired = False
        self.values: dict[str, bytes] = {}
        """The value each key held after this client's last ``compare_set`` (or ``peek``) on it."""

    def arm(self, key: str, then: Callable[[], None], when: Callable[[], bool] | None = None) -> None:
        """Run ``then()`` right after the next request on ``key`` after which ``when()`` holds."""
        self._key, self._then, self._when, self.fired = key, then, when or _always, False

    def _after(self, key: str) -> None:
        if key == self._key and not self.fired and self._when():
            self.fired = True
            self._then()

    def compare_set(self, key: str, expected: str, desired: str, *, since: int | None = None) -> bytes:
        value = super().compare_set(key, expected, desired, since=since)
        self.values[key] = value
        self._after(key)
        return value

    def add(self, key: str, amount: int) -> int:
        value = super().add(key, amount)
        self._after(key)
        return value


@pytest.fixture
def store() -> RestartableStore:
    return RestartableStore()


def _client(
    store: RestartableStore, replica_id: str, *, timeout: float = SECONDS, heartbeat: float = SECONDS
) -> QuorumClient:
    """Process 0 of replica ``replica_id`` (of one process), its requests sent through a :class:`SeamClient`."""
    policy = Policy(2, SECONDS, heartbeat)
    return QuorumClient(SeamClient(store.port, timeout=timeout), replica_id, 0, 1, uuid.uuid4().hex[:16], policy)


def _seam(process: QuorumClient) -> SeamClient:
    assert isinstance(process.client, SeamClient)
    return process.client


def _beats(store: RestartableStore, process: QuorumClient) -> QuorumClient:
    """The protocol client of ``process``'s heartbeat thread: the same incarnation, on its own connection."""
    client = StoreClient("127.0.0.1", store.port, retry=SECONDS, timeout=timedelta(seconds=SECONDS))
    p = process
    return QuorumClient(client, p.replica_id, p.replica_rank, p.replica_size, p.token, p.policy)


def _heartbeat(store: RestartableStore, process: QuorumClient, step: int) -> None:
    """What ``process``'s heartbeat thread does at its next beat: in a restarted store, register again."""
    _beats(store, process).beat(step)


def _in_thread(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        try:
            results[name] = fn()
        except Exception as ex:
            results[name] = ex

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _form_both(
    store: RestartableStore, a: QuorumClient, b: QuorumClient, last: int, step: int, previous: Any = None
) -> dict[str, Any]:
    """a and b form the next quorum, a's join landing first (a leads the round)."""
    got: dict[str, Any] = {}
    thread = _in_thread(got, "a", lambda: a.form(last, step, previous))
    # a's count landed (after its join): b's join counts second, so a leads.
    assert wait_until(lambda: store.server.check([f"{ROOT}r/{last + 1}/count"]), timeout=100.0)
    got["b"] = b.form(last, step, previous)
    thread.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    return got


def test_a_proposal_written_across_a_store_restart_is_not_left_in_the_new_store(store: RestartableStore) -> None:
    # Replicas a and b step in round 1 and vote, b last: the step commits, and b proposes round 2
    # (`_propose`) as it enters the next step, from the store as it is: epoch 2 (a's and b's
    # registrations), then the view. Right after its last read of the view, the store is killed
    # and restarted empty. b's proposal (`r/1/next`) may not land in the new store: it would be
    # checked against an epoch that began again at 0, and once a and b registered again, it is 2
    # again and would match. a and b form round 2 in the new store from their joins.
    a, b = _client(store, "a"), _client(store, "b")
    a.register(0)
    b.register(0)
    first = _form_both(store, a, b, 0, 0)["a"]
    assert first.members == ("a", "b") and first.round == 1
    votes: dict[str, Any] = {}
    a_votes = _in_thread(votes, "a", lambda: a.vote(first, True, SECONDS))
    assert wait_until(lambda: store.server.add(f"{ROOT}r/1/ok", 0) == 1, timeout=100.0)
    votes["b"] = b.vote(first, True, SECONDS)
    a_votes.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    assert votes == {"a": True, "b": True}, votes
    assert not store.has("r/1/next")  # the vote proposes nothing: b proposes as it enters step 2
    _seam(b).arm(STARTED, store.restart)
    got: dict[str, Any] = {}
    b_forms = _in_thread(got, "b", lambda: b.form(first.round, 1, (first, True)))
    assert wait_until(lambda: store.restarts == 1, timeout=100.0)  # the seam ran in b's thread
    # The replicas go on from step 1: their heartbeat threads register them again, and they form round 2.
    for process in (a, b):
        _heartbeat(store, process, 1)
    assert store.server.add(ROOT + "epoch", 0) == 2
    got["a"] = a.form(first.round, 1, (first, True))
    b_forms.join(timeout=6 * SECONDS)
    assert not store.has("r/1/next"), "a proposal written across the restart was left in the new store"
    assert got["a"] == got["b"], got
    assert got["a"].round == 2 and got["a"].members == ("a", "b") and got["a"].steps == (1, 1)


def test_a_leader_whose_view_spans_a_store_restart_reads_the_new_store_again(store: RestartableStore) -> None:
    # Replica x registered and left: the registry still lists it. a leads round 1: it reads the
    # registry, then the store is restarted and a and b register again (their heartbeat threads),
    # then a reads the heartbeats of the processes in the registry it read, from the new store:
    # x's is not there and never will be. A read that waits for it waits for the request's
    # timeout, reconnects and waits again until the store counts as unreachable, and a's `form`
    # fails; a must read the new store's registry instead, and a and b form round 1. b's first
    # request after the restart (reading `closed`) reconnects, and b joins round 1 in the new
    # store; a leads it and publishes it before b looks for its result (the seam): b must take
    # that round, not join round 2 as if its join had been lost with the old store.
    x = _client(store, "x")
    x.register(0)
    x.leave()
    a, b = _client(store, "a", timeout=2.0), _client(store, "b")
    a.register(0)
    b.register(0)
    restarted = threading.Event()

    def restart_and_register_again() -> None:
        store.restart()
        for process in (a, b):
            _heartbeat(store, process, 0)
        restarted.set()

    _seam(a).arm(f"{ROOT}reg", restart_and_register_again)
    got: dict[str, Any] = {}
    thread = _in_thread(got, "a", lambda: a.form(0, 0))
    assert restarted.wait(timeout=100.0)  # a harness bound against a hang, not a timing claim
    assert wait_until(lambda: store.has("r/1/count"), timeout=100.0)  # a joined the new store's round first

    def until_a_published() -> None:
        assert wait_until(lambda: store.has("r/1/result"), timeout=100.0)

    _seam(b).arm(f"{ROOT}r/1/count", until_a_published)
    got["b"] = b.form(0, 0)
    thread.join(timeout=6 * SECONDS)
    assert _seam(b).fired and b.client.generation == 1
    assert got["a"] == got["b"], got
    assert got["a"].round == 1 and got["a"].members == ("a", "b") and got["a"].heal == {}


def test_a_last_vote_counted_before_a_store_restart_commits_no_step_another_member_aborted(
    store: RestartableStore,
) -> None:
    # a and b step in round 1. a watches b, finds it silent (b's heartbeat is older than a's
    # `heartbeat_timeout` of 0.05 s) and aborts the step; a votes and reads `abort`. b was only
    # stalled: it votes ok last, its count completes the vote, and the store is restarted before
    # b writes the decision, which lands in the new, empty store where nothing says `abort`. b
    # must not commit the step a aborted: its vote is lost (not committed), and it leaves no
    # decision in the new store. Then both go on from the same step.
    a, b = _client(store, "a"), _client(store, "b")
    a.register(0)
    b.register(0)
    first = _form_both(store, a, b, 0, 0)["a"]
    watcher = QuorumClient(a.client, "a", 0, 1, a.token, Policy(2, SECONDS, 0.05))
    assert wait_until(lambda: watcher.check_step(first) is not None, timeout=100.0)
    assert store.server.get(ROOT + "r/1/decision") == b"abort"
    votes = {"a": a.vote(first, True, SECONDS)}
    _seam(b).arm(f"{ROOT}r/1/ok", store.restart)
    votes["b"] = b.vote(first, True, SECONDS)
    assert _seam(b).fired and store.restarts == 1
    assert votes == {"a": False, "b": None}, votes
    assert not store.has("r/1/decision"), "a decision was written for a round the new store does not hold"
    for process in (a, b):
        _heartbeat(store, process, 0)
    second = _form_both(store, a, b, first.round, 0, (first, False))
    assert second["a"] == second["b"], second
    assert second["a"].round == 2 and second["a"].members == ("a", "b") and second["a"].steps == (0, 0)


def test_no_voter_takes_a_decision_from_a_store_restarted_during_the_vote(store: RestartableStore) -> None:
    # a, b and c step in round 1; a and c voted ok and wait for the decision. b votes last: its
    # count completes the vote, then the store restarts, and the new store holds a `commit` for
    # round 1 (planted: whatever a new store holds is not the vote's). b's `commit` is never sent
    # to the new store, and a and c, reconnecting, read the planted one there after b returned.
    # The vote is lost on all three: none takes a decision from a store the vote did not begin in.
    clients = {rid: _client(store, rid) for rid in "abc"}
    for process in clients.values():
        process.register(0)
    got: dict[str, Any] = {}
    threads = [_in_thread(got, rid, partial(p.form, 0, 0)) for rid, p in clients.items()]
    for thread in threads:
        thread.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    first = got["a"]
    assert got["b"] == got["c"] == first and first.members == ("a", "b", "c")
    votes: dict[str, Any] = {}
    ok, decision = f"{ROOT}r/1/ok", f"{ROOT}r/1/decision"
    waiting = [_in_thread(votes, "a", partial(clients["a"].vote, first, True, SECONDS))]
    assert wait_until(lambda: store.server.check([ok]), timeout=100.0)
    waiting.append(_in_thread(votes, "c", partial(clients["c"].vote, first, True, SECONDS)))
    assert wait_until(lambda: store.server.add(ok, 0) == 2, timeout=100.0)
    counted, b_returned = threading.Event(), threading.Event()
    held = {"a": threading.Event(), "c": threading.Event()}

    def hold(rid: str) -> Callable[[], None]:
        # Right after the voter's periodic check read the round's result from the old store (no
        # decision there yet), until b's vote returned: the voter's next reads (the rest of its
        # check, then the decision) reconnect, to the new store.
        def then() -> None:
            held[rid].set()
            assert b_returned.wait(timeout=100.0)

        return then

    for rid in "ac":
        _seam(clients[rid]).arm(f"{ROOT}r/1/result", hold(rid), when=counted.is_set)

    def restart() -> None:
        counted.set()
        assert all(event.wait(timeout=100.0) for event in held.values())
        store.restart()
        store.server.set(decision, "commit")

    _seam(clients["b"]).arm(ok, restart)
    try:
        votes["b"] = clients["b"].vote(first, True, SECONDS)
    finally:
        b_returned.set()
        for thread in waiting:
            thread.join(timeout=6 * SECONDS)
    assert _seam(clients["b"]).fired and store.restarts == 1
    assert votes == {"a": None, "b": None, "c": None}, votes
    # The case this test is for: the waiting voters read a `commit` in the new store, and did not take it.
    read = {rid: _seam(clients[rid]).values.get(decision) for rid in "ac"}
    assert read == {"a": b"commit", "c": b"commit"}, read


def test_a_round_decided_from_a_store_before_its_restart_is_not_published_in_the_new_one(
    store: RestartableStore,
) -> None:
    # a leads round 1 and reads it, a's and b's joins, from the store. The store is then restarted
    # (writing the time it started, as `python -m gang.ft.store` does), and a publishes its decision:
    # it lands in the new store, and must be deleted again. A restarted store closes no round until
    # `heartbeat_timeout` after it started (not every live process may have registered again), and
    # then its leader decides from the new store. The heartbeat threads of a and b beat meanwhile.
    heartbeat = 2.0
    a, b = (_client(store, rid, heartbeat=heartbeat) for rid in "ab")
    for process in (a, b):
        process.register(0)
    stop = threading.Event()

    def beat(process: QuorumClient) -> None:
        own = _beats(store, process)
        while not stop.wait(heartbeat / 10):
            own.beat(0)

    beaters = [threading.Thread(target=beat, args=(p,)) for p in (a, b)]
    for thread in beaters:
        thread.start()
    started: list[float] = []

    def restart() -> None:
        store.restart()
        started.append(time.time())
        store.server.set(STARTED, f"{started[0]:.6f}")

    got: dict[str, Any] = {}
    thread = _in_thread(got, "a", partial(a.form, 0, 0))
    joins = f"{ROOT}r/1/joins"
    assert wait_until(lambda: store.server.check([f"{ROOT}r/1/count"]), timeout=100.0)  # a joined first: it leads
    seam = _seam(a)
    seam.arm(STARTED, restart, when=lambda: b"b|" in seam.values.get(joins, b""))  # after a's view held b's join
    try:
        got["b"] = b.form(0, 0)
        thread.join(timeout=6 * SECONDS)  # a harness bound against a hang, not a timing claim
    finally:
        stop.set()
        for beater in beaters:
            beater.join(timeout=6 * SECONDS)
    closed = time.time()
    assert seam.fired and got["a"] == got["b"], got
    assert got["a"].round == 1 and got["a"].members == ("a", "b")
    # The protocol's rule, not a timing claim: nothing published round 1 in the new store before
    # it was `heartbeat_timeout` old, so neither form returned earlier.
    assert closed - started[0] >= heartbeat, "a round decided from the old store was published in the new one"


def test_a_request_past_the_step_attempts_deadline_ends_with_step_deadline_error(store: RestartableStore) -> None:
    # The store stops answering (its server is gone, nothing listens on the port). A request whose
    # client has a step deadline ends there with StepDeadlineError, leaving the store's own retries
    # (SECONDS) to a later request; without a deadline it would retry until StoreUnreachableError.
    client = StoreClient("127.0.0.1", store.port, retry=SECONDS, timeout=timedelta(seconds=SECONDS))
    assert client.peek("k") is None
    del store.server
    gc.collect()
    client.deadline = time.monotonic() + 0.5
    with pytest.raises(StepDeadlineError, match="the step attempt's deadline passed"):
        client.peek("k")
