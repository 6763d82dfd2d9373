"""Fault injection on ProcessGroupGang: every survivor raises GangError, then closes cleanly.

Each scenario starts its own processes with a short gang timeout and stops every one of them
(`World` kills what is left when it closes). Nothing here reads a clock: the error text proves
which failure a survivor saw ("Timed out" when the gang's timeout fired), and the harness's own
timeout (far above the gang's) turns a survivor left waiting into a failed test. Timings belong
in the benchmarks.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from fault_workers import (
    close_on_error_path,
    exit_before_collective,
    hang,
    hang_in_sub_gang,
    killed_mid_stream,
    killed_while_pending,
    made_and_closed,
    never_arrives,
    store_host_dies,
)

from gang.testing import WorkerDiedError, World, free_port, launch

TIMEOUT = 4.0  # the gangs' collective timeout in these scenarios, in seconds (torch's default: 30 minutes)


def _check_survivor(rank: int, size: int, report: dict[str, Any], op: str, *causes: str) -> None:
    error = report["error"]
    assert error is not None, f"rank {rank} saw no error"
    assert f"`{op}` failed on rank {rank} of a gang of size {size}" in error, error
    assert any(c in error for c in causes), f"rank {rank}: {error!r} names none of {causes}"
    assert report["closed"] is True


def _died(world: World, fn: Any, *args: Any) -> WorkerDiedError:
    with pytest.raises(WorkerDiedError, match=r"died while running") as info:
        world.run(fn, *args, timeout=120)
    return info.value


@pytest.mark.parametrize(("size", "victim"), [(2, 1), (4, 0)])
def test_peer_exits_before_a_collective(size: int, victim: int) -> None:
    with World(size, gang_timeout=TIMEOUT) as world:
        died = _died(world, exit_before_collective, victim)
    assert sorted(died.results) == [r for r in range(size) if r != victim]
    for rank, report in died.results.items():
        _check_survivor(rank, size, report, "all_reduce", "Connection closed", "Timed out", "closed by peer", "reset")


@pytest.mark.parametrize(("size", "victim"), [(2, 0), (4, 2)])
def test_peer_sigkilled_in_a_stream_of_collectives(size: int, victim: int) -> None:
    with World(size, gang_timeout=TIMEOUT) as world:
        died = _died(world, killed_mid_stream, victim, 25)
    assert f"exit codes {{{victim}: -9}}" in str(died)
    assert sorted(died.results) == [r for r in range(size) if r != victim]
    for rank, report in died.results.items():
        _check_survivor(rank, size, report, "all_reduce", "Connection closed", "Timed out", "closed by peer", "reset")


@pytest.mark.parametrize(("size", "victim", "kind"), [(4, 0, "recv"), (4, 2, "all_reduce"), (2, 1, "send_recv")])
def test_peer_sigkilled_while_a_handle_is_pending(size: int, victim: int, kind: str) -> None:
    # Every survivor's handle needs the victim (it receives from it, reduces with it, or shifts a
    # ring of two through it): each gets GangError from `wait()`, naming the operation.
    with World(size, gang_timeout=TIMEOUT) as world:
        died = _died(world, killed_while_pending, victim, kind)
    assert f"exit codes {{{victim}: -9}}" in str(died)
    assert sorted(died.results) == [r for r in range(size) if r != victim]
    for rank, report in died.results.items():
        _check_survivor(rank, size, report, kind, "Connection closed", "Timed out", "closed by peer", "reset")


@pytest.mark.parametrize("size", [2, 3])
def test_peer_hangs(size: int) -> None:
    with World(size, gang_timeout=TIMEOUT) as world:
        results = world.run(hang, size - 1, TIMEOUT + 1, timeout=120)
    for rank, report in enumerate(results[:-1]):
        _check_survivor(rank, size, report, "all_reduce", "Timed out")
    assert results[-1] == {"victim": True}


def test_sub_gang_honours_the_root_timeout() -> None:
    with World(3, gang_timeout=TIMEOUT) as world:
        results = world.run(hang_in_sub_gang, 1, TIMEOUT + 1, timeout=120)
    survivor = results[0]
    _check_survivor(0, 2, survivor, "all_reduce", "Timed out")
    assert survivor["timeout"].total_seconds() == TIMEOUT
    assert results[1] == {"victim": True}
    assert results[2] == {"member": False}


def test_peer_never_arrives_at_rendezvous() -> None:
    with World(3, init_gang=False) as world:
        results = world.run(never_arrives, 2, TIMEOUT + 1, TIMEOUT, timeout=120)
    for report in results[:2]:
        assert report["error"] is not None
        assert "`create_default_process_group` failed during the rendezvous" in report["error"]
        assert "of 3" in report["error"]
    assert results[2] == {"victim": True}


def test_store_host_dies() -> None:
    env = {"TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_PORT": str(free_port())}
    with World(3, init_gang=False, env=env) as world:
        died = _died(world, store_host_dies, 12, TIMEOUT)
    assert sorted(died.results) == [1, 2]
    for rank, report in died.results.items():
        error = report["error"]
        assert error is not None and f"rank {rank} of a gang of size 3" in error, error
        assert report["closed"] is True


def test_close_on_an_error_path_does_not_hang_the_others() -> None:
    with World(4, gang_timeout=TIMEOUT) as world:
        results = world.run(close_on_error_path, 1, timeout=120)
    failing = results[1]
    assert failing["failing"] is True and failing["closed"] is True
    # Rank 3 shares dp gang [1, 3] with the failed rank; it learns of the failure as a GangError.
    assert results[3]["error"] is not None and "rank 1 of a gang of size 2" in results[3]["error"]
    for rank in (0, 2):  # their dp gang [0, 2] is healthy; the root barrier then fails
        report = results[rank]
        assert report["error"] is not None, report
        assert f"`barrier` failed on rank {rank} of a gang of size 4" in report["error"]


def test_a_gang_closed_as_soon_as_it_is_made_does_not_break_a_peer_still_making_it() -> None:
    # The race needs a busy machine to show (the member still inside gloo's constructor must lose
    # the CPU): six spinning processes beside the two ranks. Without the barrier that ends a gloo
    # group's creation (gang._torch_groups.settle) about one pair of fresh processes in eight failed.
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(6)]
    try:
        for _ in range(40):
            assert launch(made_and_closed, 2) == [1, 1]
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
