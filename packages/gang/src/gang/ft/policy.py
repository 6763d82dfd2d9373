"""The quorum decisions of :mod:`gang.ft`, apart from the store: who is live, who is up to date,
who heals from whom, when a process group is reused and when to give up.

:class:`Policy` is a pure function of a :class:`View` (what a round's leader read from the store
at one moment) and the previous :class:`Quorum`; :mod:`gang.ft.quorum` reads the store, asks the
policy and publishes what it decides. Nothing here talks to the store or reads a clock.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

from typing_extensions import override

from gang.extend import check_int


def replica_sort_key(replica_id: str) -> tuple[int, int, str]:
    """Order replica ids numerically when they are numbers, else by text (numbers first)."""
    return (0, int(replica_id), "") if replica_id.isdigit() else (1, 0, replica_id)


Process = tuple[str, int]
"""A process of a replica: (replica id, replica rank)."""


@dataclass(frozen=True)
class Beat:
    """The last heartbeat of one process.

    :ivar token: The incarnation that wrote it (a new one at every ``join``).
    :ivar age: Seconds since it was written.
    :ivar step: The process's step number when it was written.
    :ivar left: Whether the process is gone: it closed its gang, or the process watching it saw
        it die (:mod:`gang.ft.liveness`).
    :ivar died: Whether it is gone because the process watching it saw it die (then ``left`` too).
    :ivar unreachable: The replicas this process could not reach over the network when it last
        tried (their processes of its replica rank; :mod:`gang.ft.reach`), until it reaches them again.
    """

    token: str
    age: float
    step: int
    left: bool = False
    died: bool = False
    unreachable: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Join:
    """One process's join of a round: its incarnation and its step number."""

    token: str
    step: int


@dataclass(frozen=True)
class View:
    """What the leader of a round read from the store.

    :ivar sizes: The number of processes of every registered replica.
    :ivar beats: The heartbeat of every registered process.
    :ivar joins: The joins of the round, by process (a later join of a process replaces its earlier one).
    :ivar waited: Seconds since the leader began to wait for the round, or since the previous
        quorum's step ended if it saw it go on (:meth:`Policy.step_goes_on`).
    :ivar store_age: Seconds since the store started (``inf`` when it does not say).
    """

    sizes: Mapping[str, int]
    beats: Mapping[Process, Beat]
    joins: Mapping[Process, Join]
    waited: float
    store_age: float = float("inf")


@dataclass(frozen=True)
class Quorum:
    """The published result of one quorum round.

    :ivar round: The round number (the quorum id).
    :ivar members: Replica ids in rank order.
    :ivar steps: The step number of each member: the smallest over its processes (a replica is up
        to date only when every one of its processes is).
    :ivar sizes: The number of processes of each member.
    :ivar group: The round whose process group the members use (a new one when membership,
        an incarnation or health changed, else the previous quorum's).
    :ivar incarnations: The incarnation tokens of each member's processes, by replica rank
        (comma-separated).
    :ivar heal: The heal plan: every member that is behind, mapped to the up-to-date member it
        receives the state from (the sending is spread over the up-to-date members).
    :ivar stalled: Live replicas that did not join a round within ``quorum_timeout``: later
        rounds do not wait for them until they join again.
    :ivar timed_out: The live replicas this round waited ``quorum_timeout`` for before closing
        without them (newly stalled; empty for a round that waited for nobody).
    :ivar spares: Live replicas that joined but that the policy left out (:class:`SparesPolicy`):
        they wait, joining the next rounds, until a round takes them in.
    :ivar apart: Live replicas that joined but that cannot reach every member, or that a member
        cannot reach (the partition rule, :meth:`Policy.connected`): they wait as spares do until
        their links are back.
    """

    round: int
    members: tuple[str, ...]
    steps: tuple[int, ...]
    sizes: tuple[int, ...]
    group: int
    incarnations: tuple[str, ...] = ()
    heal: Mapping[str, str] = field(default_factory=dict)
    stalled: tuple[str, ...] = ()
    timed_out: tuple[str, ...] = ()
    spares: tuple[str, ...] = ()
    apart: tuple[str, ...] = ()

    @property
    def max_step(self) -> int:
        """The highest step number among the members."""
        return max(self.steps)

    @property
    def behind(self) -> tuple[str, ...]:
        """The members that heal in this quorum (some process of theirs is behind)."""
        return tuple(m for m in self.members if m in self.heal)

    def describe(self) -> str:
        """A short text naming the quorum, for error messages."""
        return f"quorum {self.round} of replicas {list(self.members)}"

    def to_json(self) -> str:
        """Serialise for the store."""
        return json.dumps(
            {
                "round": self.round,
                "members": self.members,
                "steps": self.steps,
                "sizes": self.sizes,
                "group": self.group,
                "incarnations": self.incarnations,
                "heal": dict(self.heal),
                "stalled": self.stalled,
                "timed_out": self.timed_out,
                "spares": self.spares,
                "apart": self.apart,
            }
        )

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
            tuple(d.get("incarnations", ())),
            {str(k): str(v) for k, v in d.get("heal", {}).items()},
            tuple(d.get("stalled", ())),
            tuple(d.get("timed_out", ())),
            tuple(d.get("spares", ())),
            tuple(d.get("apart", ())),
        )


@dataclass(frozen=True)
class GiveUp:
    """The decision to end a round without a quorum; every process of the round raises ``reason``."""

    reason: str


@dataclass(frozen=True)
class Verdict:
    """What :meth:`Policy.judge_watched` decides about the watched process during a step.

    :ivar reason: Why the step is over (its decision is then ``abort``), or ``None``.
    :ivar suspect: Whether the heartbeat looks silent but is not confirmed yet (read it again).
    """

    reason: str | None
    suspect: bool


def heartbeat_period(heartbeat_timeout: float) -> float:
    """Seconds between two heartbeats of a process: a tenth of ``heartbeat_timeout``, at most 0.1 s."""
    return min(0.1, heartbeat_timeout / 10)


@dataclass(frozen=True)
class Policy:
    """Every decision of :mod:`gang.ft` about liveness and quorums: every live replica takes part.

    The one entry for these decisions (``ReplicaGang.join(policy=...)`` takes one; ``join``
    builds this one from its own arguments when none is given): when a process counts as live,
    when a claimed identity's owner is dead, when a step stops waiting for the process it watches,
    when a process forming a quorum gives up, and what each quorum round decides. Every method is
    a pure function of what it is given (a :class:`View` read at one moment, a heartbeat): no
    store, no clock. Every process of every replica must use an equal policy: ``join`` compares
    :meth:`signature` with every live process's and refuses a newcomer whose policy differs.

    This one is torchft's ``DYNAMIC`` mode: a quorum holds every live replica that joined (at
    least ``min_replicas``). :class:`SparesPolicy` holds a fixed number. Another policy subclasses
    this class and overrides :meth:`choose` (or :meth:`decide`).

    :param min_replicas: The fewest replicas a quorum holds.
    :param quorum_timeout: Seconds a round waits for live replicas that do not join, and the
        longest it waits for ``min_replicas`` joined replicas before giving up.
    :param heartbeat_timeout: The heartbeat age (seconds) after which a process counts as dead.
    :param init_sync: Whether, at the job's first step (every member at step 0), every member
        adopts the state of the first one (the smallest replica id); see :func:`heal_plan`.
        ``False`` by default here, ``True`` in :meth:`gang.ft.ReplicaGang.join` (pass it when
        replicas start from different weights).
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If ``min_replicas`` is below 1 or a timeout is not positive.
    """

    min_replicas: int
    quorum_timeout: float
    heartbeat_timeout: float
    init_sync: bool = False

    def __post_init__(self) -> None:
        check_int("min_replicas", self.min_replicas, minimum=1)
        for name in ("quorum_timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"`{name}` must be a number of seconds, but is {value!r} instead.")
            if not value > 0:
                raise ValueError(f"`{name}` must be positive, but is {value!r} instead.")
        if not isinstance(self.init_sync, bool):
            raise TypeError(f"`init_sync` must be a `bool`, but is {self.init_sync!r} instead.")

    def signature(self) -> str:
        """The class and the parameters of this policy, as every process of a job compares them
        when it joins (:meth:`gang.ft.ReplicaGang.join` refuses a newcomer whose policy differs
        from a live member's, since the decisions would then depend on which process leads)."""
        kind = type(self)
        params = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"{kind.__module__}.{kind.__qualname__}({params})"

    def choose(self, joined: Mapping[str, list[int]], previous: Quorum | None) -> tuple[list[str], list[str]]:
        """Split the live replicas that joined a round into its members and its spares (each in
        replica id order); this policy takes every one.

        :param joined: The step of every process of each joined replica.
        :param previous: The previous round's quorum, if known.
        """
        return sorted(joined, key=replica_sort_key), []

    # -- liveness -------------------------------------------------------------------------------

    def alive(self, beat: Beat | None) -> bool:
        """Whether a process with this last heartbeat counts as live."""
        return beat is not None and not beat.left and beat.age < self.heartbeat_timeout

    @property
    def watch_interval(self) -> float:
        """Seconds between two heartbeats of a process, and between two looks at the watched one
        while a step waits (:func:`heartbeat_period` of ``heartbeat_timeout``)."""
        return heartbeat_period(self.heartbeat_timeout)

    def owner_alive(self, token: str, claimed: float, beat: Beat | None, changed: bool) -> bool | None:
        """Whether the incarnation ``token`` that claimed an identity ``claimed`` seconds ago still lives.

        A live process writes a new heartbeat every :attr:`watch_interval`, so a fresh one that
        never changes is a process that just died (restarted at once by its launcher) or is
        stopped: ``None`` (read again) until its heartbeat changes (alive) or grows older than
        ``heartbeat_timeout`` (dead). A claim whose first heartbeat is not written yet lives for
        ``heartbeat_timeout`` after the claim.

        :param beat: Its heartbeat now (``None`` if there is none).
        :param changed: Whether the heartbeat changed since the first read.
        """
        if beat is None or beat.token != token:  # claimed, first heartbeat not written yet
            return False if claimed >= self.heartbeat_timeout else None
        if not self.alive(beat):
            return False
        return True if changed else None

    def judge_watched(self, process: Process, token: str, beat: Beat | None, silent_for: float | None) -> Verdict:
        """Whether the step goes on, from the heartbeat of the process this one watches.

        The step is over when that process (of incarnation ``token``) left, was marked dead or
        was replaced by another incarnation, or has been silent for ``heartbeat_timeout``. Silence
        counts only when a later read, :attr:`watch_interval` on, found the same heartbeat: a
        store that stalled (or a clock that differs) is not silence. A heartbeat missing from
        the store (a restarted store that the process has not registered with again) does not
        count as silence.

        :param beat: The heartbeat read now (``None`` if missing).
        :param silent_for: Seconds since this same heartbeat was first judged a suspect
            (``None`` if it was not).
        """
        gone = beat is not None and (beat.token != token or beat.left)
        silent = beat is not None and not gone and not self.alive(beat)
        who = f"replica {process[0]!r} rank {process[1]} of the quorum"
        if silent and silent_for is not None and silent_for >= self.watch_interval:
            assert beat is not None
            limit = self.heartbeat_timeout
            return Verdict(f"{who} was silent for {beat.age:.3g} s (`heartbeat_timeout` is {limit:g} s)", False)
        if gone:
            if beat is not None and beat.died:
                return Verdict(f"{who} died (the connection its process held open closed)", False)
            return Verdict(f"{who} is gone (it left, or a new incarnation replaced it)", False)
        return Verdict(None, silent)

    def give_up(self, waited: float, left_out_of: Quorum | None) -> bool:
        """Whether a process that has been forming a quorum for ``waited`` seconds gives up.

        Left out of a published round (``left_out_of``; not every process of its replica joined):
        after ``quorum_timeout`` plus ``heartbeat_timeout``. With no round published: after twice
        ``quorum_timeout`` plus ``heartbeat_timeout`` (a leader gives up within ``quorum_timeout``
        of the previous quorum's step's end, see :meth:`step_goes_on`).
        """
        if left_out_of is not None:
            return waited > self.quorum_timeout + self.heartbeat_timeout
        return waited > 2 * self.quorum_timeout + self.heartbeat_timeout

    # -- quorum rounds ---------------------------------------------------------------------------

    def live(self, view: View) -> set[str]:
        """The replicas every process of which is registered and heartbeats."""
        return {
            rid for rid, size in view.sizes.items() if all(self.alive(view.beats.get((rid, k))) for k in range(size))
        }

    def joined(self, view: View) -> dict[str, list[int]]:
        """The step of every process of the replicas all of whose current incarnations joined."""
        out: dict[str, list[int]] = {}
        for rid, size in view.sizes.items():
            steps = []
            for k in range(size):
                join, beat = view.joins.get((rid, k)), view.beats.get((rid, k))
                if join is None or beat is None or join.token != beat.token:
                    break  # a dead incarnation's join does not count for the live one
                steps.append(join.step)
            else:
                out[rid] = steps
        return out

    def decide(self, n: int, view: View, previous: Quorum | None, committed: bool) -> Quorum | GiveUp | None:
        """Decide round ``n``: the quorum to publish, a :class:`GiveUp`, or ``None`` to wait on.

        :param previous: The result of round ``n - 1`` if known.
        :param committed: Whether ``previous``'s step was committed.
        """
        if view.store_age < self.heartbeat_timeout:
            # A store restarted this recently may not know every live process yet (each registers
            # again at its next heartbeat): closing now could form two quorums at one step.
            return None
        if self.step_goes_on(view, previous):
            return None  # a spare or a late replica leads: it waits for the members, whatever `waited`
        joined, stalled, waiting = self._waiting(view, previous)
        members = sorted(joined, key=replica_sort_key)
        if not waiting and len(members) >= self.min_replicas:
            return self._quorum(n, view, members, joined, previous, committed, stalled, set())
        if view.waited < self.quorum_timeout:
            return None
        where = f"quorum {n}"
        if len(members) < self.min_replicas:
            return GiveUp(
                f"only {len(members)} replica(s) {members} joined {where} within `quorum_timeout` "
                f"({self.quorum_timeout:g} s), fewer than `min_replicas`={self.min_replicas}"
            )
        highest = max((b.step for (rid, _), b in view.beats.items() if rid in waiting), default=0)
        if max(min(s) for s in joined.values()) < highest:
            return GiveUp(
                f"replica(s) {sorted(waiting, key=replica_sort_key)} at step {highest} are live but did not join "
                f"{where} within `quorum_timeout` ({self.quorum_timeout:g} s), and every joined replica "
                f"{members} is behind them"
            )
        return self._quorum(n, view, members, joined, previous, committed, stalled | waiting, waiting)

    def connected(self, members: Sequence[str], view: View) -> tuple[list[str], list[str]]:
        """The partition rule: split the joined replicas ``members`` into the most of them that can
        all reach each other and the rest (each in replica id order).

        A link between two replicas is broken when a process of either reported the other
        unreachable (:attr:`Beat.unreachable`: it tried to reach it and could not, and has not
        reached it since). With no broken link every replica is kept. Otherwise the kept ones are
        the largest set with no broken link among them; among sets of that size, the one whose
        replica ids, in order, come first (so every leader picks the same). The search is exact
        when at most :data:`EXACT_PARTITION` replicas have a broken link; beyond that, the replica
        with the most broken links (the last id among equals) is left out until none is left.
        """
        present = set(members)
        broken: dict[str, set[str]] = {}
        for (rid, _), beat in view.beats.items():
            if rid in present and not beat.left:
                for other in beat.unreachable & present - {rid}:
                    broken.setdefault(rid, set()).add(other)
                    broken.setdefault(other, set()).add(rid)
        if not broken:
            return list(members), []
        involved = sorted(broken, key=replica_sort_key)
        kept = set(_largest_connected(involved, broken))
        apart = [rid for rid in involved if rid not in kept]
        return [m for m in members if m not in apart], apart

    def step_goes_on(self, view: View, previous: Quorum | None) -> bool:
        """Whether the step of ``previous`` (round ``n - 1``'s quorum) still goes on: no process of
        its members joined the round yet and one of them (of the incarnation in ``previous``) is live.

        Until it ends, the round times nobody out and gives up on nothing (:meth:`decide` waits),
        and its leader's :attr:`View.waited` counts from the end of that step: a process that
        joined during it (a spare, a replica that came back or started) waits for the members
        however long their step takes, and does not publish a quorum without them.
        """
        if previous is None or any(rid in previous.members for rid, _ in view.joins):
            return False
        return any(
            (beat := view.beats.get((rid, rank))) is not None and beat.token == token and self.alive(beat)
            for rid, incarnation in zip(previous.members, previous.incarnations, strict=True)
            for rank, token in enumerate(incarnation.split(","))
        )

    def due(self, view: View, previous: Quorum | None) -> float:
        """Seconds after ``view`` was read until time alone can change what :meth:`decide` answers:
        a process of a replica waited for goes silent for ``heartbeat_timeout``, or the round has
        waited ``quorum_timeout``, or a store restarted this recently is ``heartbeat_timeout`` old
        (the leader reads the round again then, not later)."""
        if view.store_age < self.heartbeat_timeout:
            return self.heartbeat_timeout - view.store_age
        _, _, waiting = self._waiting(view, previous)
        # The processes of the replicas waited for (an older, larger incarnation's extra ranks do
        # not count) that are not silent yet.
        terms = [
            left
            for (rid, rank), b in view.beats.items()
            if rid in waiting and rank < view.sizes.get(rid, 0) and (left := self.heartbeat_timeout - b.age) > 0
        ]
        return max(0.0, min([self.quorum_timeout - view.waited, *terms]))

    def _waiting(self, view: View, previous: Quorum | None) -> tuple[dict[str, list[int]], set[str], set[str]]:
        """The live replicas that joined (their processes' steps), the stalled ones still not
        joined, and the live ones the round waits for."""
        live = self.live(view)
        joined = {rid: steps for rid, steps in self.joined(view).items() if rid in live}
        touched = {rid for rid, _ in view.joins}
        stalled = set(() if previous is None else previous.stalled) - touched
        return joined, stalled, live - set(joined) - stalled

    def _quorum(
        self,
        n: int,
        view: View,
        members: list[str],
        joined: Mapping[str, list[int]],
        previous: Quorum | None,
        committed: bool,
        stalled: set[str],
        timed_out: set[str],
    ) -> Quorum | GiveUp:
        members, apart = self.connected(members, view)
        if len(members) < self.min_replicas:
            return GiveUp(
                f"the most replicas of quorum {n} that can all reach each other are {members}, fewer than "
                f"`min_replicas`={self.min_replicas}: replica(s) {apart} cannot reach them over the network "
                "(or they cannot reach those)"
            )
        members, spares = self.choose({rid: joined[rid] for rid in members}, previous)
        steps = tuple(min(joined[rid]) for rid in members)
        sizes = tuple(view.sizes[rid] for rid in members)
        if len(set(sizes)) > 1:
            return GiveUp(
                f"the replicas of quorum {n} must have the same number of processes (the gang links processes "
                f"of equal replica rank), but {dict(zip(members, sizes, strict=True))} have different numbers"
            )
        highest = max(max(joined[rid]) for rid in members)
        if max(steps) < highest:
            # Some process is at `highest` but no replica has every process there: no replica can
            # heal the others, and going on would leave processes of one replica at different steps.
            return GiveUp(
                f"no replica of quorum {n} has every process at the highest step {highest} "
                f"(per process: {dict(joined)}); restore the replicas from a checkpoint"
            )
        incarnations = tuple(",".join(view.joins[(rid, k)].token for k in range(view.sizes[rid])) for rid in members)
        heal = heal_plan(members, steps, init_sync=self.init_sync)
        left_out = tuple(sorted(stalled, key=replica_sort_key))
        waited_for = tuple(sorted(timed_out, key=replica_sort_key))
        quorum = Quorum(
            n, tuple(members), steps, sizes, n, incarnations, heal, left_out, waited_for, tuple(spares), tuple(apart)
        )
        return replace(quorum, group=group_of(quorum, previous, committed))


@dataclass(frozen=True)
class SparesPolicy(Policy):
    """torchft's ``FIXED_WITH_SPARES`` mode: every quorum holds exactly ``min_replicas`` replicas.

    A round waits, as :class:`Policy`'s does, for every live replica and for ``min_replicas`` of
    them (giving up after ``quorum_timeout``), then takes ``min_replicas`` of those that joined
    as its members: the ones at the highest step first, the previous quorum's members before
    others at the same step, then by replica id. The rest are *spares*
    (:attr:`Quorum.spares`): their ``step()`` waits, joining every next round, until a member
    dies or leaves and a round takes one in; it is healed then (it is behind), so a step's
    average always has ``min_replicas`` terms and the job's numerics do not depend on how many
    replicas are live. (torchft keeps its spares in every step's collectives with zeros; here they
    take no part until needed.) A spare joins the next round at once and usually leads it: the
    round waits for the members while their step goes on (:meth:`Policy.step_goes_on`), and times
    out only ``quorum_timeout`` after the first of them joined. A spare waits as long as rounds are
    published without it; its ``step()`` raises, as a member's does, when no round is published
    for twice ``quorum_timeout`` plus ``heartbeat_timeout`` (a step of the members longer than
    that ends its wait), or when a round it joined gives up.
    """

    @override
    def choose(self, joined: Mapping[str, list[int]], previous: Quorum | None) -> tuple[list[str], list[str]]:
        before = () if previous is None else previous.members

        def key(rid: str) -> tuple[int, bool, tuple[int, int, str]]:
            return (-min(joined[rid]), rid not in before, replica_sort_key(rid))

        ranked = sorted(joined, key=key)
        taken = set(ranked[: self.min_replicas])
        order = sorted(joined, key=replica_sort_key)
        return [r for r in order if r in taken], [r for r in order if r not in taken]


EXACT_PARTITION = 16
"""The most replicas with a broken link for which :meth:`Policy.connected` searches every subset."""

PARTITION_ABORTS = 3
"""The most consecutive aborted steps a partition costs before the job commits again with the
largest set of replicas that can all reach each other: a step whose group cannot be built (its
members probe each other first and report who they could not reach, :mod:`gang.ft.reach`), one
more when a member's report reaches the store after the next round was decided, and one when
the link breaks while a group is in use (its collective fails; the next step builds a new one)."""


def _largest_connected(involved: list[str], broken: Mapping[str, set[str]]) -> list[str]:
    """The largest subset of ``involved`` (in replica id order) with no broken link inside, the
    first in id order among equals (exact up to :data:`EXACT_PARTITION` replicas, else greedy)."""
    if len(involved) <= EXACT_PARTITION:
        for size in range(len(involved), 0, -1):
            for chosen in itertools.combinations(involved, size):  # in id order: the first found wins ties
                if all(b not in broken[a] for a, b in itertools.combinations(chosen, 2)):
                    return list(chosen)
        return []
    kept = list(involved)
    while True:
        links = {rid: len(broken[rid] & set(kept)) for rid in kept}
        worst = max(kept, key=lambda rid: (links[rid], replica_sort_key(rid)))
        if links[worst] == 0:
            return kept
        kept.remove(worst)


def heal_plan(
    members: list[str] | tuple[str, ...], steps: tuple[int, ...], *, init_sync: bool = False
) -> dict[str, str]:
    """Map every member behind the highest step to the up-to-date member it heals from.

    The members behind are dealt to the up-to-date ones in turn, so that several senders share
    the work when several replicas are behind. With ``init_sync`` and every member at step 0 (the
    job's first step), the first member (the smallest replica id) is the only sender and every
    other member receives its state, so replicas that start from different weights agree.
    """
    if not steps:
        return {}
    top = max(steps)
    if init_sync and top == 0:
        sources, behind = [members[0]], list(members[1:])
    else:
        sources = [m for m, s in zip(members, steps, strict=True) if s == top]
        behind = [m for m, s in zip(members, steps, strict=True) if s < top]
    return {m: sources[i % len(sources)] for i, m in enumerate(behind)}


def watched(quorum: Quorum, replica_id: str, replica_rank: int) -> tuple[Process, str] | None:
    """The process that (``replica_id``, ``replica_rank``) watches during a step of ``quorum``, with its incarnation.

    Each member watches the process of equal replica rank of the next member in rank order (the
    last one watches the first), so every process of the quorum is watched by one other while a
    single process reads one heartbeat, however many replicas there are. ``None`` for a quorum of
    one replica (or one published without incarnations).
    """
    if len(quorum.members) < 2 or not quorum.incarnations:
        return None
    nxt = (quorum.members.index(replica_id) + 1) % len(quorum.members)
    return (quorum.members[nxt], replica_rank), quorum.incarnations[nxt].split(",")[replica_rank]


def group_of(quorum: Quorum, previous: Quorum | None, committed: bool) -> int:
    """The group round ``quorum`` uses: the previous quorum's when its members are the same
    incarnations, it is the round just before, and it committed; else a new one (its own round)."""
    if (
        previous is not None
        and previous.round == quorum.round - 1
        and committed
        and previous.members == quorum.members
        and previous.incarnations == quorum.incarnations
    ):
        return previous.group
    return quorum.round
