"""ReplicaGang argument checks and misuse: clear errors before any communication."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from gang import GangError, InvalidOperationError, NotSupportedError, ReduceOperation
from gang._torch_groups import TCPStore
from gang.ft import Policy, ReplicaGang, ReplicaStatus, SparesPolicy


def _state() -> Mapping[str, Any]:
    return {}


def _load(state: Mapping[str, Any]) -> None:
    pass


GOOD: dict[str, Any] = {"replica_id": "r0", "store": "127.0.0.1:1", "state_dict": _state, "load_state_dict": _load}


@pytest.mark.parametrize(
    ("changes", "error", "text"),
    [
        ({"replica_id": ""}, ValueError, "`replica_id` must be a non-empty id"),
        ({"replica_id": "a/b"}, ValueError, "but is 'a/b' instead"),
        ({"replica_id": 1.5}, TypeError, "`replica_id` must be a `str` or an `int`, but is 1.5 instead"),
        ({"store": "nohost"}, ValueError, "`store` must have the form 'host:port', but is 'nohost' instead"),
        ({"store": "h:99999"}, ValueError, "but is 'h:99999' instead"),
        ({"store": 5}, TypeError, "`store` must be a `str`"),
        ({"device": "cpu"}, TypeError, "`device` must be a `torch.device`, but is 'cpu' instead"),
        ({"device": torch.device("meta")}, ValueError, "`device` must be of type `cpu` or `cuda`"),
        ({"state_dict": None}, TypeError, "`state_dict` must be callable, but is None instead"),
        ({"load_state_dict": 3}, TypeError, "`load_state_dict` must be callable, but is 3 instead"),
        ({"min_replicas": 0}, ValueError, "`min_replicas` must be at least 1, but is 0 instead"),
        ({"min_replicas": True}, TypeError, "`min_replicas` must be an `int`, but is True of type `bool` instead"),
        ({"timeout": 3}, TypeError, "`timeout` must be a `datetime.timedelta`, but is 3 instead"),
        ({"timeout": timedelta(0)}, ValueError, "`timeout` must be positive"),
        ({"init_sync": 1}, TypeError, "`init_sync` must be a `bool`, but is 1 instead"),
        ({"max_retries": 0}, ValueError, "`max_retries` must be at least 1, but is 0 instead"),
        ({"max_retries": 2.0}, TypeError, "`max_retries` must be an `int`, but is 2.0"),
        ({"quorum_timeout": 3}, TypeError, "`quorum_timeout` must be a `datetime.timedelta`, but is 3 instead"),
        ({"quorum_timeout": timedelta(seconds=-1)}, ValueError, "`quorum_timeout` must be positive, but is"),
        ({"heartbeat_timeout": "5s"}, TypeError, "`heartbeat_timeout` must be a `datetime.timedelta`, but is '5s'"),
        ({"heartbeat_timeout": timedelta(0)}, ValueError, "`heartbeat_timeout` must be positive, but is 0:00:00"),
        ({"replica_rank": -1}, ValueError, "`replica_rank` must be at least 0, but is -1 instead"),
        ({"replica_rank": 1.0}, TypeError, "`replica_rank` must be an `int`"),
        ({"replica_size": 0}, ValueError, "`replica_size` must be at least 1, but is 0 instead"),
        ({"policy": 2}, TypeError, "`policy` must be a `gang.ft.policy.Policy`, but is 2 instead"),
        (
            {"policy": SparesPolicy(2, 5.0, 2.0), "min_replicas": 2},
            ValueError,
            "`min_replicas` must be left out when `policy` is given (the policy carries it), but is 2 instead",
        ),
        (
            {"policy": Policy(1, 5.0, 2.0), "heartbeat_timeout": timedelta(seconds=1)},
            ValueError,
            "`heartbeat_timeout` must be left out when `policy` is given",
        ),
        (
            {"replica_rank": 2, "replica_size": 2},
            ValueError,
            "`replica_rank` must be smaller than `replica_size` (2), but is 2 instead",
        ),
    ],
)
def test_bad_arguments(changes: dict[str, Any], error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=re.escape(text)):
        ReplicaGang.join(**(GOOD | changes))


def test_missing_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GANG_FT_REPLICA_ID", raising=False)
    monkeypatch.delenv("GANG_FT_STORE", raising=False)
    with pytest.raises(ValueError, match="`replica_id` must be given when `GANG_FT_REPLICA_ID` is not set"):
        ReplicaGang.join(state_dict=_state, load_state_dict=_load, store="h:1")
    monkeypatch.setenv("GANG_FT_REPLICA_ID", "x")
    with pytest.raises(ValueError, match="`store` must be given when `GANG_FT_STORE` is not set"):
        ReplicaGang.join(state_dict=_state, load_state_dict=_load)
    monkeypatch.setenv("GANG_FT_STORE", "bad")
    with pytest.raises(ValueError, match="`GANG_FT_STORE` must have the form 'host:port', but is 'bad' instead"):
        ReplicaGang.join(state_dict=_state, load_state_dict=_load)
    monkeypatch.setenv("GANG_FT_STORE", "h:1")
    monkeypatch.setenv("GANG_FT_REPLICA_RANK", "x")
    with pytest.raises(ValueError, match="`GANG_FT_REPLICA_RANK` must be an integer of at least 0, but is 'x' instead"):
        ReplicaGang.join(state_dict=_state, load_state_dict=_load)
    monkeypatch.setenv("GANG_FT_REPLICA_RANK", "1")
    monkeypatch.setenv("GANG_FT_REPLICA_SIZE", "1")
    with pytest.raises(ValueError, match=re.escape("`replica_rank` must be smaller than `replica_size` (1), but is 1")):
        ReplicaGang.join(state_dict=_state, load_state_dict=_load)


@pytest.fixture
def gang() -> Iterator[ReplicaGang]:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    g = ReplicaGang.join(
        replica_id="solo",
        store=f"127.0.0.1:{server.port}",
        state_dict=_state,
        load_state_dict=_load,
        timeout=timedelta(seconds=5),
    )
    try:
        yield g
    finally:
        g.close()


def test_one_replica_trains_alone_and_misuse_is_refused(gang: ReplicaGang, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gang.ft")
    t = torch.ones(3)
    with pytest.raises(InvalidOperationError, match=re.escape("inside `with gang.step():`")):
        gang.all_reduce(t, ReduceOperation.SUM)
    with pytest.raises(InvalidOperationError, match=re.escape("inside `with gang.step():`")):
        gang.should_commit()
    with pytest.raises(NotSupportedError, match="A `ReplicaGang` cannot be split"):
        gang.create_gang([0])
    host, port = gang._address
    with pytest.raises(GangError, match=r"`join` failed: replica 'solo' rank 0 is already taken by a live process at "):
        ReplicaGang.join(replica_id="solo", store=f"{host}:{port}", state_dict=_state, load_state_dict=_load)
    for expected in (1, 2):  # the first process goes on
        with gang.step():
            assert (gang.rank, gang.size, gang.quorum) == (0, 1, ("solo",))
            gang.all_reduce(t, ReduceOperation.SUM)
            with pytest.raises(ValueError, match=re.escape("`op` is `ReduceOperation.MEAN`")):
                gang.all_reduce(torch.ones(2, dtype=torch.int64), ReduceOperation.MEAN)
            with pytest.raises(InvalidOperationError, match="while a step of this gang is running"), gang.step():
                pass
            assert gang.errored() is None
            assert gang.should_commit() and gang.should_commit()
        assert gang.step_number == expected
    with gang.step():
        pass  # never asked to commit: not committed
    assert gang.step_number == 2
    events = [getattr(r, "gang_ft") for r in caplog.records if r.name == "gang.ft"]  # noqa: B009
    assert events[0] == {
        "event": "quorum",
        "replica": "solo",
        "round": 1,
        "members": ["solo"],
        "steps": [0],
        "heal": {},
        "stalled": [],
        "apart": [],
    }
    assert [e["event"] for e in events] == ["quorum", "abort"] and events[1]["step"] == 3, events
    assert gang.current_quorum is not None and gang.current_quorum.members == ("solo",)
    assert torch.equal(t, torch.ones(3))
    gang.close()
    with pytest.raises(InvalidOperationError, match="closed gang"), gang.step():
        pass


def test_replicate_ddp_says_why_the_buckets_cannot_be_fixed(gang: ReplicaGang) -> None:
    def ddp(**options: Any) -> DistributedDataParallel:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        return DistributedDataParallel(model, process_group=gang.as_process_group(), init_sync=False, **options)

    model = ddp()
    gang.replicate_ddp(model)
    with pytest.raises(ValueError, match=r"must not have assigned its gradient buckets .* already ran on it\."):
        gang.replicate_ddp(model)
    with pytest.raises(ValueError, match=re.escape("must be built without `find_unused_parameters=True`")):
        gang.replicate_ddp(ddp(find_unused_parameters=True))
    gang.replicate_ddp(ddp(find_unused_parameters=True, static_graph=True))
    # A torch whose reducer lacks the private calls: not the caller's mistake, and it says so.
    changed = ddp()
    changed.reducer = torch.nn.Module()  # type: ignore[assignment]  # a reducer without `_push_all_rebuilt_params`
    with pytest.raises(NotSupportedError, match=re.escape(f"cannot be fixed on torch {torch.__version__}")):
        gang.replicate_ddp(changed)


def test_old_rounds_are_deleted_from_the_store(gang: ReplicaGang) -> None:
    # Round n's keys go once round n + KEEP_ROUNDS closed: the store does not grow with the steps.
    from gang.ft.quorum import KEEP_ROUNDS, ROOT, ROUND_KEYS

    host, port = gang._address
    client = TCPStore(host, port, is_master=False, wait_for_workers=False)
    for _ in range(12):
        with gang.step():
            assert gang.should_commit()

    def round_keys(n: int) -> list[str]:
        return [f"{ROOT}r/{n}/{part}" for part in ROUND_KEYS]

    last = 12
    deadline = time.monotonic() + 30  # the heartbeat thread deletes them within a beat or two
    while any(client.check([key]) for n in range(1, last - KEEP_ROUNDS + 1) for key in round_keys(n)):
        assert time.monotonic() < deadline, "old rounds' keys were never deleted"
        time.sleep(0.05)
    for n in range(last - KEEP_ROUNDS + 1, last + 1):  # and the ones still read are kept
        assert client.check(round_keys(n)), f"round {n} is still needed"


def test_state_dict_round_trip_status_and_bad_values(gang: ReplicaGang) -> None:
    assert gang.status() == ReplicaStatus("solo", (), None, 0, None, 0)
    with gang.step():
        assert gang.should_commit()
        with pytest.raises(InvalidOperationError, match=re.escape("`load_state_dict` cannot be called inside")):
            gang.load_state_dict({"step_number": 3})
    assert gang.state_dict() == {"step_number": 1}
    gang.load_state_dict({"step_number": 41})
    with gang.step():
        assert gang.should_commit()
    assert gang.step_number == 42 and gang.state_dict() == {"step_number": 42}
    status = gang.status()
    assert (status.quorum, status.step, status.last_error, status.aborted_in_a_row) == (("solo",), 42, None, 0)
    bad: Any
    for bad, error, text in [
        ([1], TypeError, "`state_dict` must be a mapping, but is [1] instead."),
        ({}, ValueError, "`state_dict` must have a 'step_number', but is {} instead."),
        ({"step_number": -1}, ValueError, "`state_dict['step_number']` must be at least 0, but is -1 instead"),
        ({"step_number": "3"}, TypeError, "`state_dict['step_number']` must be an `int`, but is '3'"),
    ]:
        with pytest.raises(error, match=re.escape(text)):
            gang.load_state_dict(bad)
    assert gang.step_number == 42


_NEWCOMER = """
import sys
from datetime import timedelta
from gang.ft import ReplicaGang, SparesPolicy
kind, store = sys.argv[1], sys.argv[2]
extra = {
    "equal": {"timeout": timedelta(seconds=5)},
    "other timeout": {"timeout": timedelta(seconds=5), "quorum_timeout": timedelta(seconds=7)},
    "other class": {"timeout": timedelta(seconds=5), "policy": SparesPolicy(1, 5.0, 5.0)},
}[kind]
try:
    g = ReplicaGang.join(replica_id="newcomer", store=store, state_dict=dict, load_state_dict=lambda s: None, **extra)
except ValueError as ex:
    print("refused:", ex)
else:
    print("joined:", g.policy.signature())
    g.close()
"""


@pytest.mark.parametrize(
    ("kind", "theirs"),
    [
        ("equal", None),
        ("other timeout", "gang.ft.policy.Policy(min_replicas=1, quorum_timeout=7.0, "),
        ("other class", "gang.ft.policy.SparesPolicy(min_replicas=1, quorum_timeout=5.0, heartbeat_timeout=5.0, "),
    ],
)
def test_a_newcomer_with_another_policy_is_refused_naming_both(
    gang: ReplicaGang, kind: str, theirs: str | None
) -> None:
    # The newcomer is another process (a real join over the same store); the member goes on.
    host, port = gang._address
    done = subprocess.run(
        [sys.executable, "-c", _NEWCOMER, kind, f"{host}:{port}"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    mine = gang.policy.signature()
    if theirs is None:
        assert done.stdout.strip() == f"joined: {mine}"
    else:
        assert done.stdout.startswith("refused: `policy` must equal the live members' policy: "), done.stdout
        assert theirs in done.stdout and f"but the live replica 'solo' rank 0 uses {mine}" in done.stdout
    with gang.step():
        assert gang.should_commit()
