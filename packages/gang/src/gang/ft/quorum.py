"""The store side of :mod:`gang.ft`: registration, heartbeats, quorum rounds and the commit vote.

The decisions (who is live, who heals from whom, when to give up) are :class:`gang.ft.policy.Policy`'s;
this module only reads and writes the coordination store (torch's ``TCPStore``), under :data:`ROOT`:

- ``id/<replica>/<rank>``: the incarnation that owns process (replica id, replica rank):
  ``"<token> <host>:<pid> <unix time> <address>"``, where ``address`` is the ``host:port`` its
  death signal listens on (:mod:`gang.ft.liveness`; ``-`` if none). Every ``join`` makes a new
  token; a process claims the key with ``compare_set`` and is refused while the owner heartbeats
  (a duplicate).
- ``hb/<replica>/<rank>``: its heartbeat ``"<unix time> <step> <token>"``, followed by
  ``" <replica>,<replica>..."`` while it reports replicas it could not reach (:mod:`gang.ft.reach`)
  (``"left <token>"``
  once it closed), written by a background thread that first checks it still owns the claim;
  ``"dead <token>"`` once the process watching it saw its death signal (a live process that was
  taken for dead writes its next heartbeat over it).
- ``reg``: every incarnation appends ``replica|rank|size`` once.
- ``started``: the time ``python -m gang.ft.store`` started. A leader closes no round until
  ``heartbeat_timeout`` after it: a restarted store learns the live processes only as each
  registers again.
- ``r/<n>/joins``, ``r/<n>/count``, ``r/<n>/leader``, ``r/<n>/result``: round ``n`` of the quorum.
  A process appends ``replica|rank|token|step`` and adds one to ``count``; the process that makes
  it 1 is the round's *leader*. Only the leader reads the round's joins, the registry and the
  heartbeats (when ``count`` changes, when a heartbeat it waits for is due to go stale, and at
  least every 50 ms), asks the policy and publishes the result
  (a :class:`Quorum`, or a reason to give up) with an atomic ``compare_set``; everyone else
  polls ``result`` (one key), and takes the lead over with ``compare_set`` when the leader's
  heartbeat goes silent. So one process's requests per step do not grow with the number of
  replicas. A published round sets ``closed`` = ``n``.
- ``r/<n>/ok`` and ``r/<n>/decision``: the commit vote. A process votes "fail" by writing the
  decision ``abort`` with ``compare_set``, "ok" by adding one to ``ok``; the process whose add
  completes the count writes ``commit`` (and reads the decision back from that one request).
  Everyone else waits for ``decision`` until the vote's deadline: a :class:`~gang.ft.ReplicaGang`
  in one blocking request (``TCPStore.get``: the store answers it the moment the decision is
  written) while its heartbeat thread watches the vote (:meth:`QuorumClient.watch_vote`),
  otherwise by polling. During a step, a process that sees the member it watches go silent
  writes ``abort`` too; so does the watching heartbeat thread once the vote's deadline passed.
- ``r/<n>/next``: the next round as proposed by the last "ok" voter of round ``n`` (the one
  whose vote completed the count) when it enters the next step, before it joins round ``n + 1``
  (``"<epoch>|<joins>|<quorum>"``, with the joins of the next round by other processes it
  saw): the policy's decision from the store as it is then, every member taken as joined at
  the next step (none if a member marked ``dropped`` first; one written after the round's keys
  were deleted is deleted again by its writer). When the step commits, the members join
  round ``n + 1`` as usual, adding ``2**20`` (not 1) to its ``count``, and the last of them to
  join publishes the proposal as the round's result (``compare_set``; a leader's result
  published first wins) unless ``epoch`` changed or another process joined the round since:
  so the round closes as soon as every member joined, without a leader's reads and polls. A
  leader that joined as a member of the proposal's quorum, but not as its last one, waits
  ``_RECHECK``, 50 ms, before it reads the round, whether or not the proposal is still valid (it
  reads neither the proposal nor ``epoch``). Otherwise the leader decides from the joins.
- ``epoch``: a counter every registration, ``leave``, death seen and ``dropped`` mark adds one to.
- ``r/<n>/dropped``: set by a process that dropped the round's group after its vote (a collective
  failed after ``should_commit``); the next round then builds a new group instead of reusing it.
- Round ``n``'s keys are deleted once round ``n + 2`` closed (by the heartbeat thread of the
  process that published round ``n + 2``: its leader or its last member). A result written to a
  round already deleted (by a process paused before its ``compare_set``) is deleted again, and
  ``closed`` only moves forward. A process that comes back from a pause to a deleted round joins the next open round;
  the vote of a deleted round is lost for it (see :meth:`QuorumClient.vote`).

:class:`StoreClient` retries a store that stopped answering for ``retry`` seconds, reconnecting
to the same address: a store restarted there holds none of the keys above (they are soft state),
so a process re-registers (its heartbeat thread, on finding its claim gone) and re-joins the round
it waits in (on seeing :attr:`StoreClient.generation` change); a vote in flight is lost (a decision
is taken only from the store the vote began in). A view that spans the restart is read again from
the new store: its registry came from the old one, and the heartbeat read would wait for processes
that never register again (:class:`StoreRestartedError`). A write decided from reads of the old
store (a round's result, a proposal, a vote's decision) is never sent to the new one
(``compare_set(..., since=generation)``): the new store's leader decides the round.

Heartbeat ages compare wall clocks of different hosts, so the hosts' clocks must agree to well
within ``heartbeat_timeout`` (NTP does).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

from torch.distributed import DistStoreError

from gang._torch_groups import TCPStore
from gang.errors import BACKEND_ERRORS
from gang.ft.policy import Beat, Join, Policy, Process, Quorum, View, heartbeat_period, watched

ROOT = "gang.ft/"
"""The prefix of every key :mod:`gang.ft` writes in the coordination store."""

KEEP_ROUNDS = 2
"""Round ``n``'s keys are deleted when round ``n + KEEP_ROUNDS`` closes."""

EPOCH = ROOT + "epoch"
"""A counter every registration, leave, death seen and dropped group adds one to: a proposed quorum
(:meth:`QuorumClient.form`) computed before the last change is not used."""

STARTED = ROOT + "started"
"""The key where ``python -m gang.ft.store`` writes the time it started (a restarted store is empty)."""

ROUND_KEYS = ("joins", "count", "leader", "result", "ok", "decision")
"""The keys every round writes, under ``r/<n>/`` (``dropped`` is written only when a group is
dropped after the vote; :func:`collect` deletes it too)."""

_POLL_MIN = 0.0001
_POLL_MAX = 0.001  # while a wait is young (`_FAST` seconds): a step's members arrive close together
_POLL_SLOW = 0.01  # afterwards: waiting for a slow or dead replica should not load the store
_FAST = 0.05
_RECHECK = 0.05  # the most seconds between the leader's reads of the round while its count does not change
_MEMBER = 1 << 20  # what a member of a proposed round adds to its join count (see `_join`)
_ABSENT = "\x00"  # never a value of ours: `compare_set` returns it for a key that does not exist
_T = TypeVar("_T")


class QuorumTimeoutError(Exception):
    """Forming a quorum did not succeed; the message says why."""


class IdentityError(Exception):
    """Another live process owns this process's (replica id, replica rank); the message names both."""


class PolicyMismatchError(Exception):
    """A process joined with a policy that differs from a live process's (the message names both)."""


class StoreUnreachableError(RuntimeError):
    """The coordination store did not answer for the whole retry time."""


class StepDeadlineError(RuntimeError):
    """A request was cut short by the deadline of the step attempt it belongs to
    (:attr:`StoreClient.deadline`): the step ends, but the store is not given up on (its
    retries go on at the next request, within the same ``timeout + retry``)."""


class StoreRestartedError(Exception):
    """The store restarted under a request that depends on what the caller read before it (a
    ``since`` generation): the request is not sent to the new store. A
    :meth:`StoreClient.multi_get` of keys learnt from the old store (the new one may never hold
    them), or a :meth:`StoreClient.compare_set` decided from reads of the old store."""


def _key(*parts: object) -> str:
    return ROOT + "/".join(str(p) for p in parts)


def bound_unacknowledged(host: str, port: int, seconds: float, *, known: set[str] | None = None) -> list[socket.socket]:
    """Make every TCP connection of this process to the store at ``host:port`` fail once data it
    sent stays unacknowledged for ``seconds`` (``TCP_USER_TIMEOUT``; Linux, else nothing).

    torch's store client waits for an answer without a bound of its own: over a link that was cut
    (no reset ever comes) a request would wait until the kernel gives the connection up, many
    minutes later. With the bound, the request fails after ``seconds`` and :class:`StoreClient`
    retries it. A store that is merely slow to answer is not affected (its kernel acknowledges
    the request at once). The store client's socket is not reachable from Python, so the
    process's open sockets are looked up (``/proc/self/fd``) by their peer's address.

    :param known: The sockets open before the connection (:func:`socket_links`): the connection's
        own sockets, those not among them, are returned as second descriptors, left open for the
        caller (to bound one request by less, :meth:`StoreClient._bound`); none without ``known``.
    """
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    own: list[socket.socket] = []
    if option is None:
        return own
    try:
        peers = {(str(a[4][0]), port) for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        names = os.listdir("/proc/self/fd")
    except OSError:
        return own
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))  # a second descriptor of the same socket
        except (OSError, ValueError):
            continue
        keep = False
        with contextlib.suppress(OSError):
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                peer, peer_port = sock.getpeername()[:2]
                # torch connects over IPv6 when it can: an IPv4 store is then a mapped address.
                if (str(peer).removeprefix("::ffff:"), peer_port) in peers:
                    sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(seconds * 1000)))
                    keep = known is not None and link not in known
        if keep:
            own.append(sock)
        else:
            sock.close()
    return own


def socket_links() -> set[str]:
    """The sockets this process has open (``socket:[inode]``; empty where ``/proc`` is missing)."""
    links: set[str] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:"):
                    links.add(link)
    return links


def _lines(raw: bytes | None) -> list[list[str]]:
    return [line.split("|") for line in (raw or b"").decode().splitlines() if line]


_C = TypeVar("_C")


def _by(make: Callable[[], tuple[_C, list[socket.socket]]], end: float, where: str) -> tuple[_C, list[socket.socket]]:
    """Run ``make`` on a thread of its own and return what it returns by the monotonic time ``end``.

    :raises TimeoutError: If it is not done by then; it goes on, and when it ends its sockets are
        closed and what it made is dropped (the thread is not a daemon: an exit waits for it).
    :raises Exception: What ``make`` raised.
    """
    lock = threading.Lock()
    done = threading.Event()
    outcome: list[tuple[_C, list[socket.socket]] | BaseException] = []
    abandoned = False

    def run() -> None:
        result: tuple[_C, list[socket.socket]] | BaseException
        try:
            result = make()
        except BaseException as ex:  # handed to the caller
            result = ex
        with lock:
            if abandoned:
                if not isinstance(result, BaseException):
                    for sock in result[1]:
                        sock.close()
                return
            outcome.append(result)
        done.set()

    threading.Thread(target=run, name="gang-ft-store-connect").start()
    done.wait(max(0.0, end - time.monotonic()))
    with lock:
        if not outcome:
            abandoned = True
            raise TimeoutError(f"the connection to the store at {where} was not made by the step attempt's deadline")
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


class StoreClient:
    """A client of the coordination store that retries and reconnects when the store stops answering.

    Used by one thread. Every request goes through :meth:`_call` (a benchmark counts them there).

    :param host: The store's host.
    :param port: The store's port.
    :param retry: Seconds to keep reconnecting before a request raises :class:`StoreUnreachableError`.
    :param timeout: The timeout of one request.
    """

    def __init__(self, host: str, port: int, *, retry: float, timeout: timedelta) -> None:
        self.host, self.port, self.retry, self.timeout = host, port, retry, timeout
        self.generation = 0
        """How many times the client reconnected (a store restarted meanwhile lost every key)."""
        self.deadline: float | None = None
        """A monotonic time no request waits past (the deadline of the step attempt it is made
        for); ``None``: none. A request cut short by it raises :class:`StepDeadlineError`."""
        self._retry_end: float | None = None  # when the retries of the store that stopped answering end
        self._own: list[socket.socket] = []  # second descriptors of the current connection's sockets
        self._broken = False  # a request on the current connection was cut short: its answer may still come
        self._store = self._connect(timeout)

    @property
    def raw(self) -> TCPStore:
        """The current connection (a new one after a reconnect), for torch's own use of the store."""
        return self._store

    def _connect(self, timeout: timedelta, *, own: bool = True) -> TCPStore:
        """Connect to the store, torch's connect given ``timeout``; by :attr:`deadline` at the latest.

        torch's connect runs past the timeout it is given (it retries, with pauses, and a cut link
        answers nothing): before a deadline it runs on a thread of its own, and an attempt not done
        by then raises here and is abandoned to its thread, which drops what it made.
        """
        known = socket_links() if own else None

        def connect() -> tuple[TCPStore, list[socket.socket]]:
            store = TCPStore(self.host, self.port, is_master=False, timeout=timeout, wait_for_workers=False)
            return store, bound_unacknowledged(self.host, self.port, self.timeout.total_seconds(), known=known)

        store, sockets = connect() if self.deadline is None else _by(connect, self.deadline, f"{self.host}:{self.port}")
        if own:
            for old in self._own:
                old.close()
            self._own = sockets
        return store

    def _bound(self, seconds: float, *, answer: bool = True) -> None:
        """Bound the current connection's next request by ``seconds``: its answer (the store's
        timeout) and the acknowledgement of what it sends (``TCP_USER_TIMEOUT``, see
        :func:`bound_unacknowledged`), and, with ``answer``, the wait for its answer on the socket
        itself (``SO_RCVTIMEO``: the kernel checks ``TCP_USER_TIMEOUT`` only when it retransmits,
        a quarter to half a second late for short bounds, and the store's timeout does not bound
        every request's answer). Without ``answer`` the socket's wait has no bound of its own, as
        torch leaves it: a store that is merely slow to answer is waited for."""
        self._store.set_timeout(timedelta(seconds=seconds))
        option = getattr(socket, "TCP_USER_TIMEOUT", None)
        if option is None:
            return
        whole, fraction = divmod(max(0.001, seconds), 1.0) if answer else (0.0, 0.0)
        timeval = struct.pack("ll", int(whole), int(fraction * 1e6))
        for sock in self._own:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(seconds * 1000)))
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)

    def _call(self, request: Callable[[TCPStore], _T], since: int | None = None) -> _T:
        """Send ``request``, reconnecting while the store does not answer (for ``retry`` seconds).

        :param since: The :attr:`generation` the request was decided in: it is not sent on any
            other connection (:class:`StoreRestartedError` instead).
        """
        if since is not None and since != self.generation:
            raise StoreRestartedError(f"the store was restarted since generation {since}")
        began = time.monotonic()
        # The first try waits at most until the step's deadline or the end of the retries of a
        # store that stopped answering, whichever comes first (at least 0.1 s).
        ends = [t for t in (self.deadline, self._retry_end) if t is not None]
        first_wait = min([self.timeout.total_seconds(), *(max(0.1, t - began) for t in ends)])
        try:
            if self._broken:
                raise RuntimeError("the last request on this connection was cut short")
            if first_wait < self.timeout.total_seconds():
                self._bound(first_wait)
                try:
                    value = request(self._store)
                finally:
                    self._bound(self.timeout.total_seconds(), answer=False)
            else:
                value = request(self._store)
            self._retry_end = None
            return value
        except BACKEND_ERRORS as first:
            # A request fails within `timeout` (`bound_unacknowledged`, give or take the kernel's
            # retransmission timer); the retries end `retry` after the first failure, and at most
            # `timeout + retry` after the first unanswered request began (a request cut short by
            # the step's deadline leaves that end for the next one). Each connection attempt and
            # the request on it are bounded by what is left (torch's connect tries twice, a delay
            # apart: about three times the timeout it is given).
            if self._retry_end is None:
                self._retry_end = min(time.monotonic(), began + self.timeout.total_seconds()) + self.retry
            retry_end = self._retry_end
            deadline = retry_end if self.deadline is None else min(retry_end, self.deadline)
            pause = 0.05
            while True:
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, 0.5)
                if deadline < retry_end and time.monotonic() >= deadline:  # no connection attempt past it
                    self._broken = True
                    raise StepDeadlineError(f"{first}; the step attempt's deadline passed") from first
                left = max(0.05, deadline - time.monotonic())
                try:
                    self._store = self._connect(timedelta(seconds=min(1.0, self.timeout.total_seconds(), left) / 3))
                    self._broken = False
                    self.generation += 1
                    if since is not None:
                        self._store.set_timeout(self.timeout)
                        raise StoreRestartedError(f"the store was restarted since generation {since}")
                    self._bound(min(self.timeout.total_seconds(), left))
                    try:
                        value = request(self._store)
                    finally:
                        self._bound(self.timeout.total_seconds(), answer=False)
                    self._retry_end = None
                    return value
                except BACKEND_ERRORS as ex:
                    if time.monotonic() >= deadline:
                        self._broken = True
                        if deadline < retry_end:
                            raise StepDeadlineError(f"{first}; the step attempt's deadline passed: {ex}") from ex
                        raise StoreUnreachableError(f"{first}; retried for {self.retry:g} s: {ex}") from ex

    def connection(self) -> TCPStore:
        """A new connection to the store, of its own (a process group's rendezvous waits on it
        while this client's requests go on); its connection attempts end by :attr:`deadline`."""
        seconds = self.timeout.total_seconds()
        if self.deadline is not None:  # torch's connect tries twice: about three times the timeout given
            seconds = min(seconds, max(0.05, (self.deadline - time.monotonic()) / 3))
        store = self._connect(timedelta(seconds=seconds), own=False)
        store.set_timeout(self.timeout)
        return store

    def set(self, key: str, value: str) -> None:
        """Set ``key``."""
        self._call(lambda s: s.set(key, value))

    def peek(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` if it does not exist, in one round trip.

        ``compare_set`` with an expected value that is never stored returns the current value and
        changes nothing (or, for a missing key, returns the expected value and creates nothing).
        """
        value = self.compare_set(key, _ABSENT, _ABSENT)
        return None if value == _ABSENT.encode() else value

    def read(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` if it does not exist, without waking a :meth:`wait` for
        it: one request while it is missing (``TCPStore.check``), two once it exists (then
        :meth:`peek`). For a key that processes wait for (a vote's decision): :meth:`peek` of a
        missing key wakes every request waiting for it (see :meth:`wait`)."""
        return self.peek(key) if self._call(lambda s: s.check([key])) else None

    def compare_set(self, key: str, expected: str, desired: str, *, since: int | None = None) -> bytes:
        """``TCPStore.compare_set``: set ``key`` to ``desired`` if it holds ``expected`` (or is
        missing and ``expected`` is empty); return the value it holds afterwards.

        :param since: The :attr:`generation` whose reads decided ``desired``: a store restarted
            since never gets the write.
        :raises StoreRestartedError: If the store restarted since ``since``.
        """
        return self._call(lambda s: s.compare_set(key, expected, desired), since)

    def append(self, key: str, value: str) -> None:
        """Append ``value`` to ``key`` atomically (``TCPStore.append``; torch's stubs omit it)."""

        def request(store: TCPStore) -> None:
            appender: Any = store
            appender.append(key, value)

        self._call(request)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key``; return its new value."""
        return self._call(lambda s: s.add(key, amount))

    def multi_get(self, keys: list[str], *, since: int | None = None) -> list[bytes]:
        """The values of ``keys``, which must exist (a missing one waits for the timeout).

        :param since: The :attr:`generation` whose reads named ``keys``: a store restarted since
            is not asked (it may never hold them: a key of a process that is gone never comes).
        :raises StoreRestartedError: If the store restarted since ``since``.
        """
        return self._call(lambda s: s.multi_get(keys), since) if keys else []

    def delete(self, key: str) -> None:
        """Delete ``key``."""
        self._call(lambda s: s.delete_key(key))

    def wait(self, key: str, seconds: float, *, since: int | None = None) -> bytes | None:
        """The value of ``key`` once it exists, in one blocking request (the store answers the
        moment it is written); ``None`` after ``seconds`` without it (torch then logs a timeout
        warning).

        torch's store also wakes a waiting request when another client's ``compare_set`` finds
        the key missing (every :meth:`peek` of it; :meth:`read` does not): it then answers an
        empty value, and the key is checked: read again if it was written since, else waited for
        again. The protocol reads the keys that processes wait for with :meth:`read`.

        :param since: As for :meth:`multi_get`: a store restarted since is not asked.
        :raises StoreRestartedError: If the store restarted since ``since``.
        """
        end = time.monotonic() + seconds

        def request(store: TCPStore) -> bytes | None:
            while (left := end - time.monotonic()) > 0:
                store.set_timeout(timedelta(seconds=left))
                try:
                    value = store.get(key)
                except DistStoreError:  # the request's own timeout (a lost connection is a DistNetworkError)
                    return None
                finally:
                    store.set_timeout(self.timeout)
                if value:
                    return value
                self._woken(key)
                if store.check([key]):  # written since the wake-up (or empty): its value now
                    return store.get(key)
            return None

        return self._call(request, since)

    def _woken(self, key: str) -> None:
        """Called when a :meth:`wait` for ``key`` was answered an empty value, before the key is
        checked (a test-only seam; does nothing)."""


class QuorumClient:
    """The store protocol of one process (replica id, replica rank) of one incarnation.

    :param client: A store client used by the calling thread only.
    :param replica_id: This replica's id.
    :param replica_rank: This process's rank inside its replica.
    :param replica_size: The number of processes of the replica.
    :param token: This incarnation's token (unique per ``join``).
    :param policy: The quorum decisions.
    :param address: ``host:port`` of this process's death signal (:mod:`gang.ft.liveness`), ``-`` if none.
    """

    def __init__(
        self,
        client: StoreClient,
        replica_id: str,
        replica_rank: int,
        replica_size: int,
        token: str,
        policy: Policy,
        address: str = "-",
    ) -> None:
        self.client = client
        self.replica_id, self.replica_rank, self.replica_size = replica_id, replica_rank, replica_size
        self.token = token
        self.policy = policy
        self.closed_round = 0
        """The last round this process published (as its leader or as the last member to join it)."""
        self._closed: deque[int] = deque()
        self._suspect: tuple[bytes, float] | None = None  # a heartbeat seen silent, and when
        self._others_publish = False  # whether a later member may publish the round this process joined
        # A round's result as `_publish` found it, and the store's generation then (saves reading it back).
        self._published: tuple[int, bytes, int] | None = None
        self._step_goes_on = False  # whether the last view `_lead` read saw the previous quorum's step go on
        self._proposes: int | None = None  # the round whose vote this process completed: it proposes the next
        self._me = f"{replica_id}|{replica_rank}|{token}"
        self._address = address
        self.began = 0.0
        """The monotonic time the last :meth:`form` began, or last found this replica kept
        outside a published quorum (a spare, or apart): where the step attempt it forms for began."""
        self.outside = 0.0
        """The seconds the last :meth:`form` waited with this replica kept outside the quorum (0: none)."""

    def describe(self) -> str:
        """Name this process for messages."""
        return f"replica {self.replica_id!r} rank {self.replica_rank}"

    # -- identity and heartbeats ------------------------------------------------------------------

    def register(self, step: int, *, compare_policy: bool = False) -> None:
        """Claim this process's identity, write a first heartbeat and enter the registry.

        :param compare_policy: First compare this process's policy with every live registered
            process's (what ``join`` does; a re-registration after a store restart does not).
        :raises IdentityError: If a live process of another incarnation owns the identity.
        :raises PolicyMismatchError: If ``compare_policy`` and a live process's policy differs.
        """
        if compare_policy:
            self._compare_policy()
        claim = _key("id", self.replica_id, self.replica_rank)
        mine = f"{self.token} {socket.gethostname()}:{os.getpid()} {time.time():.6f} {self._address}"
        current = self.client.peek(claim)
        while True:
            if current is not None and self._owner_alive(current.decode()):
                _, who, *_ = current.decode().split(" ")
                raise IdentityError(
                    f"{self.describe()} is already taken by a live process at {who}; "
                    f"this process at {socket.gethostname()}:{os.getpid()} is a duplicate"
                )
            got = self.client.compare_set(claim, "" if current is None else current.decode(), mine)
            if got == mine.encode():
                break
            current = got
        self.client.set(_key("policy", self.replica_id, self.replica_rank), self.policy.signature())
        self.beat(step)
        self.client.append(_key("reg"), f"{self.replica_id}|{self.replica_rank}|{self.replica_size}\n")
        self.client.add(EPOCH, 1)

    def _compare_policy(self) -> None:
        """Raise :class:`PolicyMismatchError` if a live registered process (another identity) uses
        a policy whose :meth:`~gang.ft.policy.Policy.signature` differs from this one's.

        Two requests whatever the number of processes: the registry, then every process's policy
        and heartbeat in one ``multi_get``. A process that is dead or left does not count, so a
        job restarted with another policy against a store that outlived it is not refused.
        """
        mine = self.policy.signature()
        others = sorted(
            {(rid, int(rank)) for rid, rank, _ in _lines(self.client.peek(_key("reg")))}
            - {(self.replica_id, self.replica_rank)}
        )
        if not others:
            return
        keys = [k for rid, rank in others for k in (_key("policy", rid, rank), _key("hb", rid, rank))]
        values = self.client.multi_get(keys)
        now = time.time()
        for (rid, rank), theirs, beat in zip(others, values[::2], values[1::2], strict=True):
            if theirs and theirs.decode() != mine and self.policy.alive(_parse_beat(beat, now)):
                raise PolicyMismatchError(
                    f"{self.describe()} joined with the policy {mine}, but the live replica {rid!r} rank "
                    f"{rank} uses {theirs.decode()} (every process of a job must use an equal policy)"
                )

    def _owner_alive(self, claim: str) -> bool:
        """Whether the incarnation that claimed this identity still lives (:meth:`Policy.owner_alive`
        decides from its heartbeat, read every 20 ms until it does)."""
        token, _, since, *_ = claim.split(" ")
        key = _key("hb", self.replica_id, self.replica_rank)
        first = self.client.peek(key)
        while True:
            value = self.client.peek(key)
            now = time.time()
            verdict = self.policy.owner_alive(token, now - float(since), _parse_beat(value, now), value != first)
            if verdict is not None:
                return verdict
            time.sleep(0.02)

    def beat(self, step: int, unreachable: frozenset[str] = frozenset()) -> None:
        """Write this process's heartbeat, first checking that it still owns its identity.

        :param unreachable: The replicas this process reports it could not reach (:mod:`gang.ft.reach`).

        A claim that is gone (the store was restarted) is claimed and registered again.

        :raises IdentityError: If another incarnation took the identity over (this one was
            silent for longer than ``heartbeat_timeout``).
        """
        claim = self.client.peek(_key("id", self.replica_id, self.replica_rank))
        if claim is None:
            self.register(step)
            return
        owner, who, *_ = claim.decode().split(" ")
        if owner != self.token:
            raise IdentityError(
                f"{self.describe()} was taken over by a new incarnation at {who} after this process "
                f"was silent for longer than `heartbeat_timeout` ({self.policy.heartbeat_timeout:g} s)"
            )
        reports = f" {','.join(sorted(unreachable))}" if unreachable else ""
        self.client.set(
            _key("hb", self.replica_id, self.replica_rank), f"{time.time():.6f} {step} {self.token}{reports}"
        )

    def address_of(self, process: Process, token: str) -> str | None:
        """Where the death signal of ``process``'s incarnation ``token`` listens, if it owns its claim."""
        claim = self.client.peek(_key("id", *process))
        if claim is None:
            return None
        owner, _, _, *address = claim.decode().split(" ")
        return address[0] if owner == token and address else None

    def mark_dead(self, process: Process, token: str) -> bool:
        """Mark ``process``'s incarnation ``token`` dead (its death signal fired), so no round waits
        for its heartbeat to go silent; whether this call marked it (not if it left or was replaced)."""
        key = _key("hb", *process)
        raw = self.client.peek(key)
        beat = _parse_beat(raw, time.time())
        if raw is None or beat is None or beat.token != token or beat.left:
            return False
        marked = self.client.compare_set(key, raw.decode(), f"dead {token}") == f"dead {token}".encode()
        if marked:
            self.client.add(EPOCH, 1)
        return marked

    def leave(self) -> None:
        """Mark this process as gone, so the next round does not wait for its replica."""
        self.client.set(_key("hb", self.replica_id, self.replica_rank), f"left {self.token}")
        self.client.add(EPOCH, 1)

    # -- quorum rounds ------------------------------------------------------------------------------

    def first_round(self) -> int:
        """The first round that is not closed yet."""
        closed = self.client.peek(_key("closed"))
        return (0 if closed is None else int(closed)) + 1

    def form(self, last_round: int, step: int, previous: tuple[Quorum, bool] | None = None) -> Quorum:
        """Join rounds from ``last_round + 1`` on until one publishes a quorum holding this replica.

        :param previous: The last quorum this process was a member of and whether its step was
            committed (saves reading them back when this process leads the next round).
        :raises QuorumTimeoutError: If the round's leader gave up (the policy's reason), or this
            replica was left out of every round for ``quorum_timeout`` (one of its processes did
            not join), or no round was published for twice ``quorum_timeout`` plus ``heartbeat_timeout``.
        """
        # After a committed step, the last of its members to join publishes the round proposed by
        # the step's last voter before it joined (`_propose`), unless a process registered, left,
        # died or dropped its group since.
        proposed = previous[0] if previous is not None and previous[1] and previous[0].round == last_round else None
        if proposed is not None and self._proposes == proposed.round:
            self._propose(proposed)
        self._proposes = None
        self._published = None
        entered = start = self.began = time.monotonic()
        self.outside = 0.0
        first = last_round + 1 if last_round > 0 else self.first_round()
        # `append` is not acknowledged: one sent to a store that just died is lost unnoticed, and
        # the reconnect of the next request tells it. So the generation is read right before
        # joining (after reading `closed`, which may itself have reconnected to a restarted store).
        generation, poll = self.client.generation, _POLL_MIN
        n, leader = self._join(first, step, proposed)
        round_start, count, due, checked = start, -1, 0.0, start
        # A leader of a proposed round leaves its last member `_RECHECK` to publish the proposal.
        defer = start + _RECHECK if self._others_publish else 0.0
        while True:
            now = time.monotonic()
            result = self._take_published(n)
            if result is None:
                result = self.client.peek(_key("r", n, "result"))
            if self.client.generation != generation:  # the store was restarted: its rounds are gone
                generation = self.client.generation
                # Unless the new store published the round already (a join replayed there by the
                # reconnect was taken in, or not: read below), join it (or a later one) there.
                if result is None:
                    (n, leader), round_start, count = self._join(max(n, self.first_round()), step), now, -1
                    continue
            if result is not None:
                quorum = _parse_result(result)
                if self.replica_id in quorum.members:
                    return quorum
                if self.replica_id in quorum.spares or self.replica_id in quorum.apart:
                    # A spare, or apart (a link is broken): it waits on, from this round on.
                    start = self.began = now
                    self.outside = now - entered
                if self.policy.give_up(now - start, quorum):
                    raise QuorumTimeoutError(
                        f"{self.describe()} was left out of every quorum for {now - start:.3g} s: not every "
                        f"process of the replica joined (quorum {n} is of replicas {list(quorum.members)})"
                    )
                # Closed without us: the next round.
                (n, leader), round_start, count = self._join(max(n + 1, self.first_round()), step), now, -1
                continue
            if self.policy.give_up(now - start, None):
                raise QuorumTimeoutError(f"no quorum was published for {now - start:.3g} s while forming quorum {n}")
            if now - checked > min(0.5, self.policy.heartbeat_timeout / 4):
                checked = now
                if self._deleted(n):  # the round closed long ago (this process was paused)
                    (n, leader), round_start, count = self._join(self.first_round(), step), now, -1
                    continue
                leader = leader or self._take_lead_if_silent(n)
            if leader and now >= defer:
                seen = self.client.add(_key("r", n, "count"), 0)
                if seen != count or now >= due:
                    count = seen
                    wait = self._lead(n, now - round_start, previous)
                    if wait is None:
                        continue  # published: read it back at the top
                    if self._step_goes_on:  # the round's wait begins when the previous quorum's step ends
                        round_start = now
                    due = now + min(_RECHECK, wait)
            poll = _backoff(poll, start)

    def _join(self, n: int, step: int, proposed: Quorum | None = None) -> tuple[int, bool]:
        """Join round ``n`` at ``step``; return ``n`` and whether this process leads it (it joined first).

        :param proposed: The quorum of round ``n - 1``, whose step committed, if this process was
            in it: joining as the last of its processes, this one publishes the proposal.
        """
        self.client.append(_key("r", n, "joins"), f"{self._me}|{step}\n")
        # A member of the proposal's quorum counts `_MEMBER`, any other process 1: the count
        # tells both the first process to join and the last member.
        unit = _MEMBER if proposed is not None and proposed.round == n - 1 else 1
        count = self.client.add(_key("r", n, "count"), unit)
        self._others_publish = proposed is not None and unit == _MEMBER and count // _MEMBER < sum(proposed.sizes)
        if proposed is not None and unit == _MEMBER and count // _MEMBER == sum(proposed.sizes):
            self._publish_proposal(proposed, count % _MEMBER)
        if count == unit:
            return n, self.client.compare_set(_key("r", n, "leader"), "", self._me) == self._me.encode()
        return n, False

    def _take_lead_if_silent(self, n: int) -> bool:
        """Whether this process leads round ``n`` (taking over from a leader that went silent)."""
        key = _key("r", n, "leader")
        leader = self.client.peek(key)
        if leader is not None:
            if leader.decode() == self._me:
                return True
            rid, rank, token = leader.decode().split("|")
            beat = _parse_beat(self.client.peek(_key("hb", rid, rank)), time.time())
            if beat is not None and beat.token == token and self.policy.alive(beat):
                return False
        return self.client.compare_set(key, "" if leader is None else leader.decode(), self._me) == self._me.encode()

    def _lead(self, n: int, waited: float, previous: tuple[Quorum, bool] | None) -> float | None:
        """Read round ``n`` and publish the policy's decision if it has one.

        :returns: ``None`` once published (or deleted), else the seconds until time alone can
            change the decision (:meth:`Policy.due`).
        """
        generation = self.client.generation
        prev, committed = self._previous(n, previous)
        view = self._view(n, waited)
        self._step_goes_on = self.policy.step_goes_on(view, prev)
        # Read after the joins: a member marks `dropped` before it joins this round, so a join in
        # the view comes with its mark.
        if committed and self.client.peek(_key("r", n - 1, "dropped")) is not None:
            committed = False  # a member dropped the group after the vote: the next one is new
        decision = self.policy.decide(n, view, prev, committed)
        if decision is None:
            return self.policy.due(view, prev)
        text = (
            decision.to_json() if isinstance(decision, Quorum) else json.dumps({"round": n, "failed": decision.reason})
        )
        return None if self._publish(n, text, generation) else _RECHECK

    def _publish(self, n: int, text: str, generation: int) -> bool:
        """Publish ``text`` as round ``n``'s result unless a result is published already; whether
        the round has one now (``False`` when its keys were deleted: it closed long ago).

        A process paused between its reads and its ``compare_set`` must not bring a deleted round
        back: the round is checked before, and a result written after its deletion (``closed``
        had reached ``n + KEEP_ROUNDS`` already) is deleted again. ``closed`` only moves forward.
        A result decided from reads of a store that restarted since (:attr:`StoreClient.generation`
        is no longer ``generation``) is never written: the new store's leader decides the round.
        """
        result = _key("r", n, "result")
        closed = self.client.peek(_key("closed"))
        if (0 if closed is None else int(closed)) >= n and self.client.peek(result) is None:
            return False  # round `n` closed and its keys were deleted (as `_deleted`)
        try:
            published = self.client.compare_set(result, "", text, since=generation)
        except StoreRestartedError:
            return False
        if published != text.encode():
            self._published = (n, published, generation)
            return True  # another process published it first
        if closed is not None and int(closed) >= n:
            # It may have reached `n + KEEP_ROUNDS` since. Below `n` (a round being published,
            # the usual case) the value read serves as the `compare_set`'s expected one: any later
            # value is returned by it, and checked.
            closed = self.client.peek(_key("closed"))
        while closed is None or int(closed) < n:
            closed = self.client.compare_set(_key("closed"), "" if closed is None else closed.decode(), str(n))
        if int(closed) >= n + KEEP_ROUNDS:  # round `n` closed and was deleted before this `compare_set`
            self.client.delete(result)
            return False
        self.closed_round = n
        self._closed.append(n)
        self._published = (n, published, generation)
        return True

    def _take_published(self, n: int) -> bytes | None:
        """Round ``n``'s result as this process's last :meth:`_publish` found it in the current
        store (then forgotten), else ``None``."""
        published, self._published = self._published, None
        if published is not None and published[0] == n and published[2] == self.client.generation:
            return published[1]
        return None

    def take_closed(self) -> list[int]:
        """The rounds this process published since the last call: their collection
        (:func:`collect`) is due. A round's result is written by one ``compare_set`` that succeeds
        once (its leader's or its last member's), so each round is collected once, by its publisher."""
        rounds: list[int] = []
        while self._closed:
            rounds.append(self._closed.popleft())
        return rounds

    def _view(self, n: int, waited: float) -> View:
        while True:
            generation = self.client.generation
            sizes: dict[str, int] = {}
            registered: set[Process] = set()
            for rid, rank, size in _lines(self.client.peek(_key("reg"))):
                sizes[rid] = int(size)  # the latest incarnation's size counts
                registered.add((rid, int(rank)))
            processes = sorted(registered)
            now = time.time()
            try:
                keys = [_key("hb", rid, rank) for rid, rank in processes]
                values = self.client.multi_get(keys, since=generation)
                break
            except StoreRestartedError:  # the store restarted after the registry was read: read the new one
                continue
        beats = {p: b for p, v in zip(processes, values, strict=True) if (b := _parse_beat(v, now)) is not None}
        joins = {
            (rid, int(rank)): Join(token, int(step))
            for rid, rank, token, step in _lines(self.client.peek(_key("r", n, "joins")))
        }
        started = self.client.peek(STARTED)
        return View(sizes, beats, joins, waited, float("inf") if started is None else now - float(started))

    def _previous(self, n: int, previous: tuple[Quorum, bool] | None) -> tuple[Quorum | None, bool]:
        if previous is not None and previous[0].round == n - 1:
            return previous
        result, decision = self.client.peek(_key("r", n - 1, "result")), self.client.read(_key("r", n - 1, "decision"))
        if result is None:
            return None, False
        try:
            return _parse_result(result), decision == b"commit"
        except QuorumTimeoutError:
            return None, False

    def _deleted(self, n: int) -> bool:
        """Whether round ``n`` closed and its keys were already deleted."""
        # A result is published before `closed` is set: a missing result after `closed` >= n is deleted.
        return self.first_round() > n and self.client.peek(_key("r", n, "result")) is None

    def _propose(self, quorum: Quorum) -> None:
        """Decide the round after ``quorum``'s as if its step commits, and store it as the proposal.

        The view is the store as it is now, with every process of every member joined at the
        step after the quorum's (what each will join with if the step commits, with the
        incarnation it has now); the policy decides from it as a leader would. A proposal is
        stored only when the policy publishes a quorum at once (nobody live still to wait for).
        The last member process to join the next round publishes it (:meth:`_join`), so the
        round closes as soon as every member joined, without its leader's reads.
        """
        n = quorum.round + 1
        generation = self.client.generation
        epoch = self.client.add(EPOCH, 0)  # before the view: a later registration, leave or death voids it
        # A member that dropped the group after the vote marks `dropped` before it adds to the
        # epoch: a mark not seen here comes with an epoch that voids the proposal.
        if self.client.peek(_key("r", quorum.round, "dropped")) is not None:
            return  # the next round builds a new group: its leader decides it
        view = self._view(n, 0.0)
        joins = dict(view.joins)
        # Joins of the round by other processes (spares, stalled or new replicas): another one
        # later voids the proposal (see `_publish_proposal`).
        others = sum(1 for rid, _ in joins if rid not in quorum.members)
        for rid, incarnation in zip(quorum.members, quorum.incarnations, strict=True):
            for rank, token in enumerate(incarnation.split(",")):
                joins[(rid, rank)] = Join(token, quorum.max_step + 1)
        decision = self.policy.decide(n, replace(view, joins=joins), quorum, True)
        if isinstance(decision, Quorum):
            text = decision.to_json()
            key = _key("r", quorum.round, "next")
            # A store restarted meanwhile does not get it: its `epoch` began again at 0 (it could match later).
            with contextlib.suppress(StoreRestartedError):
                self.client.compare_set(key, "", f"{epoch}|{others}|{text}", since=generation)
                # A round whose keys were deleted meanwhile (this process was paused; `result` goes
                # before `next`) keeps no proposal: nothing else would delete it.
                if self.client.peek(_key("r", quorum.round, "result")) is None:
                    self.client.delete(key)

    def _publish_proposal(self, previous: Quorum, others: int) -> None:
        """Publish the round after ``previous``'s as its last voter proposed it, unless it is void
        (a process registered, left, died or dropped its group since, or ``others``, the joins of
        the round by processes not in ``previous``, are not those the proposal saw) or the round
        is published already."""
        generation = self.client.generation
        epoch = self.client.add(EPOCH, 0)
        proposal = self.client.peek(_key("r", previous.round, "next"))
        if proposal is None:
            return
        proposed_at, joined, text = proposal.decode().split("|", 2)
        if int(proposed_at) != epoch or int(joined) != others:
            return  # the round's leader decides from the joins
        self._publish(previous.round + 1, text, generation)

    # -- during a step ---------------------------------------------------------------------------------

    @property
    def watch_interval(self) -> float:
        """Seconds between two checks of :meth:`check_step` while a step waits (the heartbeat period)."""
        return self.policy.watch_interval

    def check_step(self, quorum: Quorum) -> str | None:
        """Why the step of ``quorum`` cannot go on, or ``None``; three reads (one more once the
        decision is written), whatever the quorum's size.

        The step is over when its decision is already ``abort``, when a member dropped its group
        after the vote (:meth:`mark_dropped`), or when the process this one
        watches (:func:`gang.ft.policy.watched`) has been silent for ``heartbeat_timeout`` (or was
        marked dead by the heartbeat thread watching its death signal, replaced by another
        incarnation, or left): its decision is then set to ``abort``, so every
        member that checks learns it from one key. Silence is confirmed by a second read a
        heartbeat period later that finds the same heartbeat, so a stalled store or clocks that
        differ between hosts are not taken for it. A heartbeat missing from the store (a restarted
        store that the process has not registered with again) does not count as silence.
        """
        decision_key = _key("r", quorum.round, "decision")
        target = watched(quorum, self.replica_id, self.replica_rank)
        if target is not None:
            process, token = target
            raw = self.client.peek(_key("hb", *process))
            now = time.monotonic()
            suspect = self._suspect
            silent_for = None if raw is None or suspect is None or suspect[0] != raw else now - suspect[1]
            verdict = self.policy.judge_watched(process, token, _parse_beat(raw, time.time()), silent_for)
            if verdict.reason is not None:
                self._abort(quorum)
                return verdict.reason
            if not verdict.suspect or raw is None:
                self._suspect = None
            elif silent_for is None:
                self._suspect = (raw, now)
        if self.client.read(decision_key) == b"abort":  # `read`: members may be waiting for it
            return "a member of the quorum aborted the step"
        if self.client.peek(_key("r", quorum.round, "dropped")) is not None:
            return "a member of the quorum dropped the step's group after the vote"
        return None

    def mark_dropped(self, quorum: Quorum) -> None:
        """Record that this process dropped the group of ``quorum`` after its vote, so the next
        round builds a new group even when the step was committed (nothing is written once the
        round's keys are deleted)."""
        if self.client.peek(_key("r", quorum.round, "result")) is not None:
            self.client.set(_key("r", quorum.round, "dropped"), "1")
            self.client.add(EPOCH, 1)  # a proposal of the next round reuses the group: void it

    def _abort(self, quorum: Quorum) -> None:
        """Set the decision of ``quorum``'s step to ``abort`` unless it is decided or its keys are deleted."""
        if self.client.peek(_key("r", quorum.round, "result")) is not None:
            self.client.compare_set(_key("r", quorum.round, "decision"), "", "abort")

    # -- the commit vote ------------------------------------------------------------------------------

    def vote(self, quorum: Quorum, ok: bool, deadline: float, *, block: bool = False) -> bool | None:
        """Vote on committing the step of ``quorum``; return the decision shared by every member.

        ``None`` when the decision is lost: the round's keys are gone (this process was paused
        until they were deleted two rounds later, or the store was restarted) before it read the
        decision. It is then not committed here, whatever the others decided, and nothing is
        left written for the lost round (a vote counter created in it is deleted again, and no
        decision is sent to a restarted store). A decision is taken only from the store the vote
        began in.

        :param deadline: Seconds after which a vote still incomplete is decided ``abort``.
        :param block: Wait for the decision in one blocking request (the store answers the moment
            it is written) instead of polling it; only for a caller whose other thread watches
            the quorum meanwhile (:meth:`watch_vote`: it writes ``abort`` when a member goes
            silent or the deadline passes, which ends the wait). After ``deadline`` without a
            decision (the round's keys were deleted before the wait reached the store: this
            process was paused), the vote goes on as without ``block``.
        """
        result_key, decision_key = _key("r", quorum.round, "result"), _key("r", quorum.round, "decision")
        ok_key = _key("r", quorum.round, "ok")
        generation = self.client.generation
        # One request for a voter that is neither the first nor the last, two for the last (whose
        # `compare_set` returns the decision): the round's keys are checked only by the first
        # voter (a process paused until they were deleted counts first in the counter it creates).
        if not ok:
            if self.client.peek(result_key) is None:
                return None
            return self._decide(decision_key, "abort", generation)
        count = self.client.add(ok_key, 1)
        if count == 1 and self.client.peek(result_key) is None:
            self.client.delete(ok_key)  # the counter this vote created in a deleted round
            return None
        if count == sum(quorum.sizes):
            decided = self._decide(decision_key, "commit", generation)
            # The last voter learns the decision first: it proposes the next round when it
            # enters the next step (`form`), inside the step's own time, not during the vote.
            self._proposes = quorum.round if decided else None
            return decided
        start = checked = time.monotonic()
        poll = _POLL_MIN
        if block:
            try:
                decision = self.client.wait(decision_key, deadline + self.watch_interval, since=generation)
            except StoreRestartedError:
                return None
            if decision is not None:
                return decision == b"commit"
            if self.client.peek(result_key) is None:  # the round's keys were deleted
                return None
        while True:
            decision = self.client.read(decision_key)
            if self.client.generation != generation:
                # The store restarted since this vote began: a decision in the new one was not
                # this vote's (the old one may have held `abort`).
                return None
            if decision is not None:
                return decision == b"commit"
            now = time.monotonic()
            if now - start > deadline:
                return self._decide(decision_key, "abort", generation)
            if now - checked > self.watch_interval:  # a silent member never votes: abort on its silence
                checked = now
                if self.client.peek(result_key) is None:  # the round's keys were deleted meanwhile
                    return None
                self.check_step(quorum)
            poll = _backoff(poll, start)

    def watch_vote(self, quorum: Quorum, deadline: float) -> None:
        """Watch the vote of ``quorum``'s step while a member waits for it in one blocking request
        (:meth:`vote` with ``block``): :meth:`check_step` (``abort`` when the member this process
        watches went silent or died), and ``abort`` once the monotonic time ``deadline`` passed.
        Called by another thread of the waiting process, on its own connection, once per
        heartbeat; nothing is written once the round's keys are deleted."""
        if self.check_step(quorum) is None and time.monotonic() > deadline:
            self._abort(quorum)

    def _decide(self, key: str, decision: str, generation: int) -> bool | None:
        """Write ``decision`` as the vote's unless one is written; whether the step commits.

        ``None`` when the store restarted since the vote began (``generation``): the new store is
        not the vote's, and gets nothing.
        """
        try:
            return self.client.compare_set(key, "", decision, since=generation) == b"commit"
        except StoreRestartedError:
            return None


def collect(client: StoreClient, closed_round: int) -> None:
    """Delete the keys of the round ``KEEP_ROUNDS`` before ``closed_round`` (call once per closed round)."""
    old = closed_round - KEEP_ROUNDS
    if old > 0:
        for part in (*ROUND_KEYS, "dropped", "next"):
            client.delete(_key("r", old, part))


def _parse_beat(value: bytes | None, now: float) -> Beat | None:
    if value is None:
        return None
    parts = value.decode().split(" ")
    if parts[0] in ("left", "dead"):
        return Beat(parts[1], 0.0, 0, left=True, died=parts[0] == "dead")
    unreachable = frozenset(parts[3].split(",")) if len(parts) > 3 else frozenset()
    return Beat(parts[2], now - float(parts[0]), int(parts[1]), unreachable=unreachable)


def _parse_result(text: bytes) -> Quorum:
    """The published quorum; :class:`QuorumTimeoutError` with the leader's reason if it gave up."""
    failed = json.loads(text).get("failed")
    if failed is not None:
        raise QuorumTimeoutError(str(failed))
    return Quorum.from_json(text)


def _backoff(poll: float, start: float) -> float:
    """Sleep ``poll`` seconds; return the next interval (doubling, capped by how long we waited)."""
    time.sleep(poll)
    return min(poll * 2, _POLL_MAX if time.monotonic() - start < _FAST else _POLL_SLOW)


__all__ = [
    "KEEP_ROUNDS",
    "ROOT",
    "ROUND_KEYS",
    "IdentityError",
    "PolicyMismatchError",
    "Quorum",
    "QuorumClient",
    "QuorumTimeoutError",
    "StepDeadlineError",
    "StoreClient",
    "StoreRestartedError",
    "StoreUnreachableError",
    "heartbeat_period",
]
