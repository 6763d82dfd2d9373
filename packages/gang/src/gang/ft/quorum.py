"""The store-side protocol of :mod:`gang.ft`: liveness, quorum rounds and the commit vote.

Everything lives in the coordination store (torch's ``TCPStore``) under :data:`ROOT`:

- ``reg``: every process appends ``replica|local_rank|local_world_size`` once, when it joins.
- ``hb/<replica>/<local_rank>``: a heartbeat, ``"<unix time> <step>"`` written by a background
  thread of every process (``"left"`` once it closed). A replica is *live* while the heartbeat of
  each of its local ranks is younger than the timeout; in the round being formed, a replica all
  of whose processes joined counts as live without its heartbeats being read.
- ``r/<n>/joins``: round ``n`` of the quorum; each process appends ``replica|local_rank|step``.
  The first process that sees the round complete publishes ``r/<n>/result`` with an atomic
  ``compare_set`` (so every process reads the same member list), and ``closed`` = ``n``.
  A round is complete when every live replica joined (all its local ranks), or when twice the
  timeout passed (a live replica may be finishing a collective that fails at the timeout) and the
  joined live replicas include one at the highest step.
- ``r/<n>/votes`` and ``r/<n>/decision``: the commit vote of round ``n``. Each process appends
  ``replica|local_rank|ok`` (or ``fail``); the first process that sees every member's vote, a
  ``fail`` or its deadline writes the decision with ``compare_set``; everyone reads that one.
- Round ``n``'s keys are deleted once round ``n + 2`` closed (by the heartbeat thread of a
  process that closed round ``n + 2`` or a later one), so the store does not grow with the
  number of steps. A process that comes back from a pause to a deleted round reads ``closed``
  and joins the next open round (it never publishes a result for a round that closed); the vote
  of a deleted round is lost for it (see :meth:`Protocol.vote`). Such a process leaves the one
  or two keys it appended to the deleted round behind.

Waiting processes poll: each read returns at once whether or not the key exists (one round trip;
``TCPStore.get`` waits for a missing key and costs two), with sleeps of 0.1 ms doubling up to
1 ms for the first 50 ms of a wait, then doubling on up to 10 ms.

Heartbeat ages compare wall clocks of different hosts, so the hosts' clocks must agree to well
within the timeout (NTP does).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from gang._torch_groups import TCPStore

ROOT = "gang.ft/"
"""The prefix of every key :mod:`gang.ft` writes in the coordination store."""

_POLL_MIN = 0.0001
_POLL_MAX = 0.001  # while a wait is young (`_FAST` seconds): a step's members arrive close together
_POLL_SLOW = 0.01  # afterwards: waiting for a slow or dead replica should not load the store
_FAST = 0.05
_RECHECK = 0.02  # seconds between liveness checks while the joins of a round do not change
_ABSENT = "\x00"  # never a value of ours: `compare_set` returns it for a key that does not exist
KEEP_ROUNDS = 2
"""Round ``n``'s keys are deleted when round ``n + KEEP_ROUNDS`` closes."""


def replica_sort_key(replica_id: str) -> tuple[int, int, str]:
    """Order replica ids numerically when they are numbers, else by text (numbers first)."""
    return (0, int(replica_id), "") if replica_id.isdigit() else (1, 0, replica_id)


@dataclass(frozen=True)
class Quorum:
    """The published result of one quorum round.

    :ivar round: The round number (the quorum id).
    :ivar members: Replica ids in rank order.
    :ivar steps: The step number each member had when it joined.
    :ivar sizes: The number of processes of each member.
    :ivar group: The round whose process group the members use (a new one when membership or
        health changed, else the previous quorum's).
    """

    round: int
    members: tuple[str, ...]
    steps: tuple[int, ...]
    sizes: tuple[int, ...]
    group: int

    @property
    def max_step(self) -> int:
        """The highest step number among the members."""
        return max(self.steps)

    @property
    def heal_source(self) -> int:
        """The rank of the member that sends its state to members that are behind."""
        return self.steps.index(self.max_step)

    def describe(self) -> str:
        """A short text naming the quorum, for error messages."""
        return f"quorum {self.round} of replicas {list(self.members)}"

    def to_json(self) -> str:
        """Serialise for the store."""
        fields = {"round": self.round, "members": self.members, "steps": self.steps, "sizes": self.sizes}
        return json.dumps(fields | {"group": self.group})

    @staticmethod
    def from_json(text: bytes | str) -> Quorum:
        """Parse what :meth:`to_json` wrote."""
        d = json.loads(text)
        return Quorum(
            int(d["round"]),
            tuple(d["members"]),
            tuple(int(s) for s in d["steps"]),
            tuple(int(s) for s in d["sizes"]),
            int(d["group"]),
        )


class QuorumTimeoutError(Exception):
    """Forming a quorum did not succeed in time; the message says why."""


def _key(*parts: object) -> str:
    return ROOT + "/".join(str(p) for p in parts)


def _lines(raw: bytes) -> list[list[str]]:
    return [line.split("|") for line in raw.decode().splitlines() if line]


class Protocol:
    """The store protocol of one process of one replica.

    :param store: A client of the coordination store used by the calling thread only.
    :param replica_id: This replica's id.
    :param local_rank: This process's rank inside its replica.
    :param local_world_size: The number of processes of the replica.
    :param timeout: The heartbeat age after which a replica counts as dead, and the wait bound.
    """

    def __init__(self, store: TCPStore, replica_id: str, local_rank: int, local_world_size: int, timeout: timedelta):
        self.store = store
        self.replica_id = replica_id
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.timeout = timeout.total_seconds()
        self.closed_round = 0
        """The last round whose result this process published (its keys' collection is due)."""

    # -- membership -------------------------------------------------------------------------

    def register(self, step: int) -> None:
        """Write a first heartbeat and add this process to the registry."""
        write_heartbeat(self.store, self.replica_id, self.local_rank, step)
        _append(self.store, _key("reg"), f"{self.replica_id}|{self.local_rank}|{self.local_world_size}\n")

    def live_replicas(self, joined: dict[str, dict[int, int]] | None = None) -> tuple[set[str], dict[str, int]]:
        """Return the live replica ids and the number of processes of every registered replica.

        :param joined: The local ranks (and steps) of each replica that joined the current round:
            a replica all of whose processes joined is live without reading its heartbeats.
        """
        sizes = _sizes(_lines(peek(self.store, _key("reg")) or b""))
        joined = joined or {}
        live = {rid for rid, size in sizes.items() if len(joined.get(rid, ())) >= size}
        keys = [(rid, lr) for rid, size in sizes.items() if rid not in live for lr in range(size)]
        if not keys:
            return live, sizes
        # A process writes its heartbeat before it registers, so every registered key exists.
        values = dict(zip(keys, self.store.multi_get([_key("hb", *k) for k in keys]), strict=True))
        now = time.time()
        for rid, size in sizes.items():
            beats = [values.get((rid, lr)) for lr in range(size)]
            if all(b is not None and b != b"left" and now - float(b.split()[0]) < self.timeout for b in beats):
                live.add(rid)
        return live, sizes

    # -- quorum rounds --------------------------------------------------------------------------

    def first_round(self, last_round: int) -> int:
        """The round to join next: after the last one this process took part in and the last closed one."""
        closed = peek(self.store, _key("closed"))
        return max(last_round, 0 if closed is None else int(closed)) + 1

    def form(
        self, last_round: int, step: int, min_replicas: int, previous: tuple[Quorum, bool] | None = None
    ) -> Quorum:
        """Join rounds from ``last_round + 1`` on until one publishes a quorum holding this replica.

        :param previous: The last quorum this process was a member of and whether its step was
            committed (saves reading them back when this process closes the next round).
        :raises QuorumTimeoutError: If fewer than ``min_replicas`` replicas stay live for the
            timeout, or this replica itself loses a process before that process joined.
        """
        # After a round it took part in, a process joins the next one (the loop below moves on if
        # that one closed without it); a new process starts after the last closed round.
        n = self._join(last_round + 1 if last_round > 0 else self.first_round(0), step)
        start = time.monotonic()
        poll = _POLL_MIN
        seen: bytes | None = None
        checked = 0.0
        while True:
            result = peek(self.store, _key("r", n, "result"))
            if result is not None:
                quorum = Quorum.from_json(result)
                if self.replica_id in quorum.members:
                    return quorum
                n = self._join(max(n + 1, self.first_round(0)), step)  # closed without us: the next round
                seen, checked = None, 0.0
                continue
            # One cheap poll (two reads) while nothing changes; liveness is re-read when the joins
            # change and every `_RECHECK` seconds.
            joins = peek(self.store, _key("r", n, "joins")) or b""
            now = time.monotonic()
            if joins == seen and now - checked < _RECHECK:
                poll = _backoff(poll, start)
                continue
            if joins == seen and self._deleted(n):
                # The round closed long ago and its keys were deleted (this process was paused).
                n = self._join(self.first_round(0), step)
                seen, checked = None, 0.0
                continue
            seen, checked = joins, now
            joined = _joined(joins)
            live, sizes = self.live_replicas(joined)
            waited = now - start
            if waited > self.timeout:
                if self.replica_id not in live:
                    raise QuorumTimeoutError(
                        f"replica {self.replica_id!r} lost one of its {self.local_world_size} processes "
                        f"(no heartbeat for {self.timeout:g} s) while forming quorum {n}"
                    )
                if len(live) < min_replicas:
                    raise QuorumTimeoutError(
                        f"only {len(live)} live replica(s) {sorted(live, key=replica_sort_key)} for "
                        f"{self.timeout:g} s while forming quorum {n}, fewer than `min_replicas`={min_replicas}"
                    )
            # A live replica that has not joined may still be inside a collective that fails only
            # at the timeout: wait twice as long before going on without it.
            timed_out = waited > 2 * self.timeout
            proposal = self._try_close(
                n, joined, live, sizes, timed_out=timed_out, min_replicas=min_replicas, previous=previous
            )
            if proposal is not None:
                if self._deleted(n):  # closed long ago (this process was paused): never publish it again
                    n = self._join(self.first_round(0), step)
                    seen, checked = None, 0.0
                    continue
                published = self.store.compare_set(_key("r", n, "result"), "", proposal.to_json())
                if published == proposal.to_json().encode():
                    self.store.set(_key("closed"), str(n))
                    self.closed_round = n
                    return proposal
                continue  # another process published first: read its result at the top of the loop
            poll = _backoff(poll, start)

    def _join(self, n: int, step: int) -> int:
        """Join round ``n`` at ``step``; return ``n``."""
        _append(self.store, _key("r", n, "joins"), f"{self.replica_id}|{self.local_rank}|{step}\n")
        return n

    def _deleted(self, n: int) -> bool:
        """Whether round ``n`` closed and its keys were already deleted."""
        # A result is published before `closed` is set: a missing result after `closed` >= n is deleted.
        return self.first_round(0) > n and peek(self.store, _key("r", n, "result")) is None

    def _try_close(
        self,
        n: int,
        joined: dict[str, dict[int, int]],
        live: set[str],
        sizes: dict[str, int],
        *,
        timed_out: bool,
        min_replicas: int,
        previous: tuple[Quorum, bool] | None,
    ) -> Quorum | None:
        complete = {rid for rid, ranks in joined.items() if len(ranks) >= sizes.get(rid, 1)}
        members = sorted(complete & live, key=replica_sort_key)
        if len(members) < min_replicas:
            return None
        steps = [max(joined[rid].values()) for rid in members]
        if not live <= complete:
            # A live replica has not joined: close without it only after the timeout, and only
            # when a replica at the highest live step can heal the others.
            highest = max(self._steps_of(live))
            if not timed_out or max(steps) < highest:
                return None
        member_sizes = tuple(sizes.get(rid, 1) for rid in members)
        group = self._group_round(n, tuple(members), previous)
        return Quorum(n, tuple(members), tuple(steps), member_sizes, group)

    def _steps_of(self, replicas: set[str]) -> list[int]:
        keys = [_key("hb", rid, 0) for rid in replicas]
        values = self.store.multi_get(keys) if keys else []
        return [int(v.split()[1]) for v in values if v != b"left"] or [0]

    def _group_round(self, n: int, members: tuple[str, ...], previous: tuple[Quorum, bool] | None) -> int:
        """Reuse the previous quorum's group when it has the same members and committed."""
        if previous is not None and previous[0].round == n - 1:
            prev, committed = previous
        else:
            result, decision = (
                peek(self.store, _key("r", n - 1, "result")),
                peek(self.store, _key("r", n - 1, "decision")),
            )
            if result is None or decision is None:
                return n
            prev, committed = Quorum.from_json(result), decision == b"commit"
        return prev.group if prev.members == members and committed else n

    # -- the commit vote -------------------------------------------------------------------------

    def vote(self, quorum: Quorum, ok: bool) -> bool | None:
        """Vote on committing the step of ``quorum``; return the decision shared by every member.

        ``None`` when the decision is lost: this process was paused until the round's keys were
        deleted (two rounds later), before it read the decision. It is then not committed here,
        whatever the others decided, and nothing is written for the deleted round.
        """
        votes_key, decision_key = _key("r", quorum.round, "votes"), _key("r", quorum.round, "decision")
        _append(self.store, votes_key, f"{self.replica_id}|{self.local_rank}|{'ok' if ok else 'fail'}\n")
        expected = {(rid, lr) for rid, size in zip(quorum.members, quorum.sizes, strict=True) for lr in range(size)}
        start = time.monotonic()
        deadline = start + self.timeout
        poll = _POLL_MIN
        while True:
            votes = {(rid, int(lr)): v for rid, lr, v in _lines(peek(self.store, votes_key) or b"")}
            decision = None
            if "fail" in votes.values() or time.monotonic() > deadline:
                decision = "abort"
            elif expected <= votes.keys():
                decision = "commit"
            if decision is not None:
                if decision == "abort" and peek(self.store, _key("r", quorum.round, "result")) is None:
                    return None  # the round was deleted: its votes and decision are gone
                return self.store.compare_set(decision_key, "", decision) == b"commit"
            poll = _backoff(poll, start)
            published = peek(self.store, decision_key)
            if published is not None:
                return published == b"commit"

    def leave(self) -> None:
        """Mark this process as gone, so the next round does not wait for its replica."""
        self.store.set(_key("hb", self.replica_id, self.local_rank), "left")


def collect(store: TCPStore, closed_round: int) -> None:
    """Delete the keys of the round ``KEEP_ROUNDS`` before ``closed_round`` (call once per closed round)."""
    old = closed_round - KEEP_ROUNDS
    if old > 0:
        for part in ("joins", "result", "votes", "decision"):
            store.delete_key(_key("r", old, part))


def peek(store: TCPStore, key: str) -> bytes | None:
    """Return the value of ``key``, or ``None`` if it does not exist, in one round trip.

    ``compare_set`` with an expected value that is never stored returns the current value and
    changes nothing (or, for a missing key, returns the expected value and creates nothing).
    """
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else value


def _backoff(poll: float, start: float) -> float:
    """Sleep ``poll`` seconds; return the next interval (doubling, capped by how long we waited)."""
    time.sleep(poll)
    return min(poll * 2, _POLL_MAX if time.monotonic() - start < _FAST else _POLL_SLOW)


def _joined(joins: bytes) -> dict[str, dict[int, int]]:
    """The step of every joined process of a round, by replica id and local rank."""
    joined: dict[str, dict[int, int]] = {}
    for rid, lr, step in _lines(joins):
        joined.setdefault(rid, {})[int(lr)] = int(step)
    return joined


def _sizes(registry: list[list[str]]) -> dict[str, int]:
    """The number of processes of each registered replica."""
    sizes: dict[str, int] = {}
    for rid, _, lws in registry:
        sizes[rid] = max(sizes.get(rid, 1), int(lws))
    return sizes


def _append(store: TCPStore, key: str, value: str) -> None:
    """Append ``value`` to ``key`` atomically (``TCPStore.append``; torch's stubs omit it)."""
    appender: Any = store
    appender.append(key, value)


def write_heartbeat(store: TCPStore, replica_id: str, local_rank: int, step: int) -> None:
    """Write the heartbeat of one process: the current time and its step number."""
    store.set(_key("hb", replica_id, local_rank), f"{time.time():.6f} {step}")
