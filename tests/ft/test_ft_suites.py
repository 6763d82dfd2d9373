"""A real ReplicaGang of 2 and 4 replicas: a step aborted everywhere at once, healing, init sync,
``max_retries``, ``close()`` after a failed collective, DDP's buckets each averaged, and the
``stalled`` record logged once per member replica.

Every rank of a gloo :class:`~gang.testing.World` is one replica; the store runs in the test
process. The conformance matrix and the bad-call catalogue run on a ReplicaGang as one entry of
the conformance table (``tests/conformance_workers.py``, ``tests/test_conformance.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import ft_suite_workers as fw
import pytest
import torch
from pg_workers import ordered_mean

from gang._torch_groups import TCPStore
from gang.testing import World


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"replicas{n}")
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[World, str]]:
    """A world of 2 or 4 ranks, each its own replica, and the store they join."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}"
    with World(request.param, env={"OMP_NUM_THREADS": "1"}) as world:
        try:
            yield world, address
        finally:
            world.run(fw.close, address)


def _released(error: str) -> bool:
    """Whether a peer's collective failed because the failing member dropped its group or voted to
    abort (the peer checks the decision while it waits), not at the timeout."""
    released = ("closed", "reset", "Broken pipe", "a member of the quorum aborted the step")
    return "Timed out" not in error and any(text in error for text in released)


def test_a_failure_of_one_member_aborts_the_step_everywhere_at_once(cluster: tuple[World, str]) -> None:
    # Step 1: the last rank's own code raises; step 2: its all_reduce fails (the test-only seam)
    # while every member lives to vote; step 3 commits. The peers waiting in the all_reduce are
    # released by the failing member dropping its group, not at the gang timeout (20 s). Step 4:
    # its all_reduce fails after a committed vote, which drops its group: step 5 must build a new
    # group and commit (reusing the dropped one would abort it).
    world, store = cluster
    results = world.run(fw.run_aborts, store)
    last = len(results) - 1
    steps = {r["step"] for outcome in results for r in outcome[:3]}
    assert len({tuple(o[2]["step"] for o in results)}) == 1, steps
    for rank, (raised, failed, fine, after, again, status) in enumerate(results):
        assert raised["committed"] is not True and failed["committed"] is False, (rank, raised, failed)
        assert fine["committed"] is True and fine["step"] == raised["step"] + 1, (rank, fine)
        assert after["committed"] is True and after["step"] == fine["step"] + 1, (rank, after)
        assert again["committed"] is True and again["step"] == after["step"] + 1, (rank, again)
        if rank == last:
            assert raised["raised"] == "KeyError: 'a bug in the training loop'", raised
            assert "the caller's code raised KeyError" in raised["error"], raised
            assert "injected failure" in failed["error"], failed
        else:
            assert raised["raised"] == "" and raised["committed"] is False, raised
            assert _released(raised["error"]) and _released(failed["error"]), (rank, raised, failed)
        assert status["quorum"] == tuple(str(r) for r in range(len(results))) and status["step"] == again["step"]
        assert status["last_error"] == after["error"], status


def test_handles_inside_a_step(cluster: tuple[World, str]) -> None:
    # Step 1: the last rank's async all_reduce fails to start (the seam): its peers' pending
    # handles are released by its dropped group, `wait()` records the failure as a blocking
    # collective's is, and no member commits. Step 2: handles never waited for are waited for by
    # the vote, which commits with their results. Step 3: P2P is refused by name, the step commits.
    world, store = cluster
    results = world.run(fw.run_async_steps, store)
    size, last = len(results), len(results) - 1
    for rank, (failed, unwaited, p2p) in enumerate(results):
        assert failed["committed"] is False and failed["raised"] == "", (rank, failed)
        assert "injected failure" in failed["error"] if rank == last else _released(failed["error"]), (rank, failed)
        assert unwaited["committed"] is True and unwaited["step"] == failed["step"] + 1, (rank, unwaited)
        assert unwaited["sum"] == [float(sum(range(size)))] * 3, unwaited
        assert unwaited["gathered"] == [[float(r)] * 2 for r in range(size)], unwaited
        assert p2p["committed"] is True and p2p["refused"].startswith("`send` is not supported by `ReplicaGang`")


def test_healing_sends_chunks_to_the_members_behind_only(cluster: tuple[World, str]) -> None:
    # The lower half holds one multi-dtype state, each rank of the upper half one of its own; the
    # upper half restores step 0 and is healed point to point (with 4 ranks, both senders share the work).
    world, store = cluster
    results = world.run(fw.run_heal, store)
    half = len(results) // 2
    assert all(r["committed"] for r in results), results
    assert len({r["step"] for r in results}) == 1
    assert {r["digest"] for r in results} == {results[0]["digest"]}, "states differ after the heal"
    for rank, r in enumerate(results):
        assert r["in_place"], rank
        if rank < half:
            assert r["received"] == 0 and r["sent"] > 0, (rank, r)
        else:
            assert r["start"] == 0 and r["received"] > 0 and r["sent"] == 0, (rank, r)
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results)


def test_init_sync_and_max_retries_after_a_refused_heal(cluster: tuple[World, str]) -> None:
    # A fresh gang (max_retries=2) whose ranks start from different states: step 1 makes every
    # rank adopt rank 0's. Then the last rank restores step 0 and its `load_state_dict` raises:
    # the two next steps abort on every member at once, and the second raises GangError everywhere.
    world, _ = cluster
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = world.run(fw.run_start_and_retries, f"127.0.0.1:{server.port}")
    last = len(results) - 1
    for rank, (first, second, third) in enumerate(results):
        assert first["committed"] and first["step"] == 1 and first["digest"] == first["reference"], (rank, first)
        assert second["committed"] is False and second["raised"] == "", (rank, second)
        assert third["committed"] is False and "`max_retries`=2" in third["raised"], (rank, third)
        assert third["raised"].startswith("GangError: Replica"), third
        if rank == last:
            assert "the shapes do not match this model" in second["error"], second
            assert third["raised"].count("the shapes do not match this model") == 2, third
        else:
            assert _released(second["error"]), (rank, second)


# With 2 replicas every member waits on the failing one itself, so only 4 can show it: the test
# is collected for the world of 4 only.
@pytest.mark.parametrize("cluster", [4], ids=["replicas4"], indirect=True)
def test_close_after_a_failed_collective_does_not_wait_for_the_timeout(cluster: tuple[World, str]) -> None:
    # The gang timeout is an hour: had a failed collective's error kept its work (and with it the
    # group's connections) alive, a member waiting on that peer in the all_reduce would stay there,
    # and its `close()` would wait for its dropped group the whole hour (the run would time out).
    world, _ = cluster
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = world.run(fw.run_close_after_a_failed_collective, f"127.0.0.1:{server.port}")
    last = len(results) - 1
    for rank, outcome in enumerate(results):
        assert outcome["committed"] is False and outcome["raised"] == "", (rank, outcome)
        assert "injected failure" in outcome["error"] if rank == last else _released(outcome["error"]), outcome


def test_ddp_averages_every_bucket(cluster: tuple[World, str]) -> None:
    # Every parameter of the model is its own DDP bucket (`bucket_cap_mb` of about 10 bytes): each
    # gradient DDP leaves is the mean over the replicas of their own gradients, summed in rank order.
    world, store = cluster
    results = world.run(fw.run_ddp_buckets, store)
    buckets = len(results[0]["ddp"])
    assert buckets == 6
    for rank, r in enumerate(results):
        assert r["committed"] is True, (rank, r)
        for i, grad in enumerate(r["ddp"]):
            rows = [other["plain"][i] for other in results]
            assert torch.equal(grad, ordered_mean(rows)), (rank, i)
        assert r["gathers"] == ["all_gather"] * buckets, (rank, r["gathers"])  # one average per bucket


@pytest.mark.parametrize("cluster", [4], ids=["replicas4"], indirect=True)  # two replicas of two processes
def test_a_stalled_replica_is_logged_once_per_member_replica(cluster: tuple[World, str]) -> None:
    # Replicas a and b of two processes each; b is live but does not join: a's quorum waits
    # `quorum_timeout` for it. Both processes of a learn that quorum; only a's replica rank 0
    # logs the `stalled` record on the `gang.ft` logger, and b (not a member) logs nothing.
    world, _ = cluster
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    a0, a1, b0, b1 = world.run(fw.run_stalled_log, f"127.0.0.1:{server.port}")
    assert [(r["replica"], r["timed_out"]) for r in a0] == [("a", ["b"])], a0
    assert a1 == [] and b0 == [] and b1 == [], (a1, b0, b1)
