"""The store-free quorum decisions of gang.ft (gang.ft.policy): pure functions of what a leader read."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from gang.ft.policy import (
    EXACT_PARTITION,
    Beat,
    GiveUp,
    Join,
    Policy,
    Quorum,
    SparesPolicy,
    View,
    group_of,
    heal_plan,
    watched,
)

POLICY = Policy(min_replicas=2, quorum_timeout=10.0, heartbeat_timeout=5.0)


def view(
    replicas: dict[str, int],
    joins: dict[tuple[str, int], int],
    *,
    waited: float = 0.0,
    ages: dict[tuple[str, int], float] | None = None,
    steps: dict[tuple[str, int], int] | None = None,
    tokens: dict[tuple[str, int], str] | None = None,
    join_tokens: dict[tuple[str, int], str] | None = None,
    unregistered: tuple[tuple[str, int], ...] = (),
) -> View:
    """A view of replicas (id -> size) whose processes all heartbeat unless told otherwise."""
    procs = [(rid, k) for rid, size in replicas.items() for k in range(size) if (rid, k) not in unregistered]
    tok = {p: f"t{p[0]}{p[1]}" for p in procs} | (tokens or {})
    beats = {p: Beat(tok[p], (ages or {}).get(p, 0.1), (steps or {}).get(p, 0)) for p in procs}
    jt = tok | (join_tokens or {})
    return View(replicas, beats, {p: Join(jt[p], s) for p, s in joins.items()}, waited)


def test_waits_for_every_live_replica_then_closes() -> None:
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 3, ("1", 0): 3})
    assert POLICY.decide(1, v, None, False) is None
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 3, ("1", 0): 3, ("2", 0): 3})
    q = POLICY.decide(1, v, None, False)
    assert isinstance(q, Quorum) and q.members == ("0", "1", "2") and q.heal == {} and q.group == 1


def test_a_silent_replica_is_dead_and_not_waited_for() -> None:
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 3, ("1", 0): 3}, ages={("2", 0): 5.5})
    q = POLICY.decide(4, v, None, False)
    assert isinstance(q, Quorum) and q.members == ("0", "1")


def test_a_process_that_never_registered_blocks_only_its_own_replica() -> None:
    # Replica 1 has 2 processes; rank 1 never reached join: 1 is not live, 0 and 2 go on at once.
    v = view({"0": 1, "1": 2, "2": 1}, {("0", 0): 0, ("1", 0): 0, ("2", 0): 0}, unregistered=(("1", 1),))
    q = POLICY.decide(1, v, None, False)
    assert isinstance(q, Quorum) and q.members == ("0", "2")


def test_up_to_date_means_every_process() -> None:
    # Replica 1's rank 0 was healed to step 7, its rank 1 not (the healer died midway): it heals again.
    v = view({"0": 2, "1": 2}, {("0", 0): 7, ("0", 1): 7, ("1", 0): 7, ("1", 1): 4})
    q = POLICY.decide(9, v, None, False)
    assert isinstance(q, Quorum) and q.steps == (7, 4) and q.heal == {"1": "0"} and q.behind == ("1",)


def test_a_dead_incarnations_join_does_not_count() -> None:
    # Replica 1 restarted: its new process heartbeats with token "new"; the join in the round is
    # the dead one's, so replica 1 has not joined and is waited for.
    v = view({"0": 1, "1": 1}, {("0", 0): 5, ("1", 0): 5}, tokens={("1", 0): "new"}, join_tokens={("1", 0): "old"})
    assert POLICY.decide(3, v, None, False) is None


def test_group_reuse_needs_the_same_incarnations() -> None:
    v = view({"0": 1, "1": 1}, {("0", 0): 5, ("1", 0): 5})
    first = POLICY.decide(3, v, None, False)
    assert isinstance(first, Quorum) and first.group == 3
    again = POLICY.decide(4, v, first, True)
    assert isinstance(again, Quorum) and again.group == 3
    assert group_of(again, first, committed=False) == 4  # an aborted step may have broken the group
    restarted = view(
        {"0": 1, "1": 1}, {("0", 0): 5, ("1", 0): 0}, tokens={("1", 0): "new"}, join_tokens={("1", 0): "new"}
    )
    q = POLICY.decide(4, restarted, first, True)
    assert isinstance(q, Quorum) and q.group == 4 and q.heal == {"1": "0"}


def test_a_stuck_replica_delays_one_quorum_then_is_left_out_until_it_joins() -> None:
    # Replica 2 heartbeats but does not join.
    joins = {("0", 0): 5, ("1", 0): 5}
    assert POLICY.decide(6, view({"0": 1, "1": 1, "2": 1}, joins, waited=9.9), None, False) is None
    q = POLICY.decide(6, view({"0": 1, "1": 1, "2": 1}, joins, waited=10.1), None, False)
    assert isinstance(q, Quorum) and q.members == ("0", "1") and q.stalled == ("2",) and q.timed_out == ("2",)
    later = POLICY.decide(7, view({"0": 1, "1": 1, "2": 1}, {("0", 0): 6, ("1", 0): 6}), q, True)
    assert isinstance(later, Quorum) and later.members == ("0", "1") and later.stalled == ("2",)
    assert later.timed_out == ()  # not waited for again
    # Replica 2 joins again: it is waited for and taken in (and heals).
    back = {("0", 0): 7, ("1", 0): 7, ("2", 0): 5}
    again = POLICY.decide(8, view({"0": 1, "1": 1, "2": 1}, back), later, True)
    assert isinstance(again, Quorum) and again.members == ("0", "1", "2") and again.stalled == ()
    assert again.heal == {"2": "0"}


def test_never_hangs_fewer_than_min_replicas_joined() -> None:
    # Replica 1 heartbeats and never joins; min_replicas=2: give up after quorum_timeout, naming it.
    v = view({"0": 1, "1": 1}, {("0", 0): 0}, waited=10.5)
    decision = POLICY.decide(5, v, None, False)
    assert isinstance(decision, GiveUp)
    assert "quorum 5" in decision.reason and "`min_replicas`=2" in decision.reason and "['0']" in decision.reason


def test_never_goes_on_without_the_only_replica_at_the_highest_step() -> None:
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 4, ("1", 0): 4}, waited=10.5, steps={("2", 0): 5})
    decision = POLICY.decide(5, v, None, False)
    assert isinstance(decision, GiveUp) and "['2'] at step 5" in decision.reason


def test_heal_plan_spreads_over_the_up_to_date_replicas() -> None:
    plan = heal_plan(("0", "1", "2", "3", "4"), (9, 3, 9, 0, 8))
    assert plan == {"1": "0", "3": "2", "4": "0"}
    assert heal_plan(("a", "b"), (2, 2)) == {}


def test_quorum_round_trips_through_json() -> None:
    v = view({"0": 2, "1": 2}, {("0", 0): 7, ("0", 1): 7, ("1", 0): 7, ("1", 1): 4})
    q = POLICY.decide(9, v, None, False)
    assert isinstance(q, Quorum) and Quorum.from_json(q.to_json()) == q


def test_a_restarted_store_closes_nothing_until_every_live_process_could_register_again() -> None:
    v = view({"0": 1, "1": 1}, {("0", 0): 3, ("1", 0): 3})
    fresh = View(v.sizes, v.beats, v.joins, waited=0.0, store_age=4.9)
    assert POLICY.decide(4, fresh, None, False) is None
    settled = View(v.sizes, v.beats, v.joins, waited=0.0, store_age=5.1)
    q = POLICY.decide(4, settled, None, False)
    assert isinstance(q, Quorum) and q.members == ("0", "1")


def test_no_replica_wholly_at_the_highest_step_gives_up_rather_than_drift() -> None:
    # A vote lost to a store restart: in every replica one process committed step 8, the other
    # did not. No replica can heal the others; going on would leave one replica's processes at
    # different steps for good, so the quorum gives up and says why.
    v = view({"0": 2, "1": 2}, {("0", 0): 8, ("0", 1): 7, ("1", 0): 7, ("1", 1): 8})
    decision = POLICY.decide(3, v, None, False)
    assert isinstance(decision, GiveUp) and "has every process at the highest step 8" in decision.reason
    # One replica wholly at step 8 heals the other, as usual.
    v = view({"0": 2, "1": 2}, {("0", 0): 8, ("0", 1): 8, ("1", 0): 7, ("1", 1): 8})
    q = POLICY.decide(3, v, None, False)
    assert isinstance(q, Quorum) and q.heal == {"1": "0"}


def test_replicas_of_different_sizes_give_up_naming_the_sizes() -> None:
    v = view({"0": 2, "1": 1}, {("0", 0): 0, ("0", 1): 0, ("1", 0): 0})
    decision = POLICY.decide(1, v, None, False)
    assert isinstance(decision, GiveUp) and "{'0': 2, '1': 1}" in decision.reason


def test_each_process_watches_the_same_rank_of_the_next_member() -> None:
    q = Quorum(3, ("0", "1", "2"), (4, 4, 4), (2, 2, 2), 3, ("a0,a1", "b0,b1", "c0,c1"))
    assert watched(q, "0", 1) == (("1", 1), "b1")
    assert watched(q, "2", 0) == (("0", 0), "a0")  # the last watches the first: everyone is watched
    assert watched(Quorum(3, ("0",), (4,), (1,), 3, ("a0",)), "0", 0) is None


def test_due_is_when_a_waited_for_heartbeat_goes_stale_or_the_quorum_timeout() -> None:
    # Replica 2 is live (its beat 4.5 s old of 5 s) and not joined: read the round again in 0.5 s.
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 3, ("1", 0): 3}, ages={("2", 0): 4.5}, waited=1.0)
    assert POLICY.decide(4, v, None, False) is None
    assert abs(POLICY.due(v, None) - 0.5) < 1e-9
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 3, ("1", 0): 3}, ages={("2", 0): 0.5}, waited=9.75)
    assert abs(POLICY.due(v, None) - 0.25) < 1e-9  # quorum_timeout comes first


def test_due_ignores_an_older_larger_incarnations_extra_ranks() -> None:
    # Replica 2 was of 2 processes and restarted as 1: its rank 1's old beat is silent for good and
    # must not make the leader read the round again at once (a tight loop until quorum_timeout).
    v = view({"0": 1, "1": 1, "2": 2}, {("0", 0): 3, ("1", 0): 3}, ages={("2", 0): 1.0, ("2", 1): 60.0})
    v = View({"0": 1, "1": 1, "2": 1}, v.beats, v.joins, v.waited)
    assert POLICY.decide(4, v, None, False) is None
    assert abs(POLICY.due(v, None) - 4.0) < 1e-9


SPARES = SparesPolicy(min_replicas=2, quorum_timeout=10.0, heartbeat_timeout=5.0)


def test_spares_policy_takes_a_fixed_number_and_a_spare_steps_in_when_a_member_dies() -> None:
    # All at step 0: the first two ids step, the third waits as a spare (it joined: no waiting).
    first = SPARES.decide(1, view({"0": 1, "1": 1, "2": 1}, {("0", 0): 0, ("1", 0): 0, ("2", 0): 0}), None, False)
    assert isinstance(first, Quorum) and first.members == ("0", "1") and first.spares == ("2",)
    assert first.heal == {}
    # Membership unchanged: the same members, the spare still behind, the group reused.
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 4, ("1", 0): 4, ("2", 0): 0})
    same = SPARES.decide(2, v, first, True)
    assert isinstance(same, Quorum) and same.members == ("0", "1") and same.spares == ("2",) and same.group == 1
    # Replica 1 dies: the spare steps in, healed by the survivor.
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 4, ("2", 0): 0}, ages={("1", 0): 6.0})
    q = SPARES.decide(3, v, same, True)
    assert isinstance(q, Quorum) and q.members == ("0", "2") and q.spares == () and q.heal == {"2": "0"}
    # Fewer than `min_replicas` live: wait, then give up as `Policy` does.
    v = view({"0": 1, "1": 1}, {("0", 0): 4}, ages={("1", 0): 6.0})
    assert SPARES.decide(4, v, q, True) is None
    assert isinstance(SPARES.decide(4, replace(v, waited=11.0), q, True), GiveUp)
    # `Policy` takes every live replica.
    everyone = POLICY.decide(1, view({"0": 1, "1": 1, "2": 1}, {("0", 0): 0, ("1", 0): 0, ("2", 0): 0}), None, False)
    assert isinstance(everyone, Quorum) and everyone.members == ("0", "1", "2") and everyone.spares == ()


def test_spares_policy_keeps_the_most_advanced_then_the_previous_members() -> None:
    # A replica ahead of the previous members is never a spare (its progress would be lost).
    previous = Quorum(1, ("1", "2"), (3, 3), (1, 1), 1, ("t10", "t20"))
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 5, ("1", 0): 3, ("2", 0): 3})
    q = SPARES.decide(2, v, previous, True)
    assert isinstance(q, Quorum) and q.members == ("0", "1") and q.spares == ("2",) and q.heal == {"1": "0"}
    # At equal steps the previous members stay, whatever their ids.
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 3, ("1", 0): 3, ("2", 0): 3})
    q = SPARES.decide(2, v, previous, True)
    assert isinstance(q, Quorum) and q.members == ("1", "2") and q.spares == ("0",) and q.group == 1
    assert Quorum.from_json(q.to_json()) == q


def test_policies_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match=re.escape("`min_replicas` must be at least 1, but is 0 instead.")):
        SparesPolicy(0, 1.0, 1.0)
    with pytest.raises(ValueError, match=re.escape("`heartbeat_timeout` must be positive, but is 0.0 instead.")):
        Policy(1, 1.0, 0.0)
    with pytest.raises(TypeError, match=re.escape("`quorum_timeout` must be a number of seconds, but is '1'")):
        Policy(1, "1", 1.0)  # type: ignore[arg-type]


def test_a_round_led_by_a_spare_waits_for_the_members_step_however_long() -> None:
    # Round 2's members a and b step (fresh heartbeats at step 3, not joined); the spares joined
    # round 3 at once and lead it. Past `quorum_timeout` the round neither gives up (one spare is
    # fewer than `min_replicas`) nor publishes a quorum of spares: it waits for the members.
    spares = SparesPolicy(2, 5.0, 1.0)
    previous = Quorum(2, ("a", "b"), (3, 3), (1, 1), 2, ("ta0", "tb0"), spares=("s", "t"))
    stepping = {("a", 0): 3, ("b", 0): 3}
    one = view({"a": 1, "b": 1, "s": 1}, {("s", 0): 0}, waited=60.0, steps=stepping)
    two = view({"a": 1, "b": 1, "s": 1, "t": 1}, {("s", 0): 0, ("t", 0): 0}, waited=60.0, steps=stepping)
    for policy in (spares, POLICY):
        assert policy.step_goes_on(one, previous) and policy.decide(3, one, previous, True) is None
        assert policy.decide(3, two, previous, True) is None
    # The step ended for a (it joined): the round waits `quorum_timeout` from then, as usual.
    joined = view({"a": 1, "b": 1, "s": 1}, {("s", 0): 0, ("a", 0): 4}, waited=6.0, steps=stepping)
    assert not spares.step_goes_on(joined, previous)
    q = spares.decide(3, joined, previous, True)
    assert isinstance(q, Quorum) and q.members == ("a", "s") and q.timed_out == ("b",) and q.heal == {"s": "a"}
    # Members that died, or a new incarnation of them, are not a step going on: the round decides.
    dead = view({"a": 1, "b": 1, "s": 1}, {("s", 0): 0}, waited=6.0, ages={("a", 0): 2.0, ("b", 0): 2.0})
    assert not spares.step_goes_on(dead, previous) and isinstance(spares.decide(3, dead, previous, True), GiveUp)
    new = replace(one, beats={**one.beats, ("a", 0): Beat("new", 0.1, 0), ("b", 0): Beat("new", 0.1, 0)})
    assert not spares.step_goes_on(new, previous) and isinstance(spares.decide(3, new, previous, True), GiveUp)


def test_a_waiting_replica_at_the_joined_replicas_step_is_left_out_not_given_up_on() -> None:
    # Replica 2 heartbeats at step 4 and does not join; the joined ones are at step 4 too: nobody
    # is behind it, so the round closes without it (giving up is only for a waiting replica ahead).
    v = view({"0": 1, "1": 1, "2": 1}, {("0", 0): 4, ("1", 0): 4}, waited=10.5, steps={("2", 0): 4})
    q = POLICY.decide(5, v, None, False)
    assert isinstance(q, Quorum) and q.members == ("0", "1") and q.timed_out == ("2",)


def reports(v: View, unreachable: dict[tuple[str, int], set[str]]) -> View:
    """``v`` with processes reporting replicas they could not reach."""
    beats = {p: replace(b, unreachable=frozenset(unreachable.get(p, ()))) for p, b in v.beats.items()}
    return replace(v, beats=beats)


def test_the_partition_rule_keeps_the_most_replicas_that_all_reach_each_other() -> None:
    three = {"0": 1, "1": 1, "2": 1}
    joins = {("0", 0): 5, ("1", 0): 5, ("2", 0): 5}
    # 0 and 1 cannot reach each other, both reach 2: either report alone breaks the link; of the
    # two largest sets, {0, 2} and {1, 2}, the one with the first ids wins; 1 waits apart.
    for who in (("0", 0), ("1", 0)):
        other = "1" if who[0] == "0" else "0"
        q = POLICY.decide(6, reports(view(three, joins), {who: {other}}), None, False)
        assert isinstance(q, Quorum) and q.members == ("0", "2") and q.apart == ("1",) and q.spares == ()
    # The largest set wins over the first ids: 0 reaches neither 1 nor 2.
    q = POLICY.decide(6, reports(view(three, joins), {("0", 0): {"1", "2"}}), None, False)
    assert isinstance(q, Quorum) and q.members == ("1", "2") and q.apart == ("0",)
    # Two broken links among four: {0, 2} comes first among the sets of two.
    four = {"0": 1, "1": 1, "2": 1, "3": 1}
    v = reports(view(four, {(r, 0): 5 for r in four}), {("0", 0): {"1"}, ("3", 0): {"2"}})
    q = POLICY.decide(6, v, None, False)
    assert isinstance(q, Quorum) and q.members == ("0", "2") and q.apart == ("1", "3")
    # A report about a replica that did not join (or of a process that left) breaks nothing.
    v = reports(view(three, joins), {("0", 0): {"7"}})
    assert POLICY.decide(6, v, None, False) == POLICY.decide(6, view(three, joins), None, False)


def test_a_replica_apart_is_healed_in_once_nobody_reports_its_link_broken() -> None:
    three = {"0": 1, "1": 1, "2": 1}
    cut = POLICY.decide(6, reports(view(three, {(r, 0): 5 for r in three}), {("1", 0): {"0"}}), None, False)
    assert isinstance(cut, Quorum) and cut.apart == ("1",)
    # 0 and 2 committed two steps; 1 waited apart at step 5; its link is back: taken in, healed.
    back = POLICY.decide(9, view(three, {("0", 0): 7, ("2", 0): 7, ("1", 0): 5}), cut, True)
    assert isinstance(back, Quorum) and back.members == ("0", "1", "2") and back.apart == ()
    assert back.heal == {"1": "0"}
    assert Quorum.from_json(cut.to_json()) == cut


def test_the_partition_rule_gives_up_below_min_replicas_naming_the_replicas_apart() -> None:
    two = {"0": 1, "1": 1}
    decision = POLICY.decide(3, reports(view(two, {("0", 0): 1, ("1", 0): 1}), {("0", 0): {"1"}}), None, False)
    assert isinstance(decision, GiveUp)
    assert "['0']" in decision.reason and "['1'] cannot reach" in decision.reason
    assert "`min_replicas`=2" in decision.reason


def test_the_partition_rule_beyond_the_exact_search_leaves_out_the_most_cut_off_first() -> None:
    many = {str(r): 1 for r in range(EXACT_PARTITION + 2)}
    # Replica 0 reaches nobody, and 1 cannot reach 2: 0 goes first (most broken links), then 2
    # (the last id of the two with one broken link left).
    unreach = {("0", 0): set(many) - {"0"}, ("1", 0): {"2"}}
    q = POLICY.decide(6, reports(view(many, {(r, 0): 5 for r in many}), unreach), None, False)
    assert isinstance(q, Quorum) and q.apart == ("0", "2") and len(q.members) == len(many) - 2
