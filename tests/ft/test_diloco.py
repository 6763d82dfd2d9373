"""``gang.ft.DiLoCo`` on real processes, judged by state: kills between syncs and mid-exchange,
a restart and a brand-new replica that heal, ``min_replicas`` unmet, FSDP2 inside a replica.

Each scenario runs ``diloco_workers.py`` replicas through the ``test_ft`` harness (a store
process, replica processes or torchruns, real SIGKILLs at points the replicas report). After every
committed sync each member logs its global parameters, its local parameters and its outer
momentum; the test checks that every member of a sync logged the same, and that they equal
``diloco_workers.replay`` (DiLoCo from its definition, plain torch, one process) of the committed
syncs with the same data and membership schedule, bit for bit in float64.
"""

from __future__ import annotations

import logging
import re
import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_workers import digest, procs_of, replay
from test_ft import Cluster
from torch import nn

from gang import InvalidOperationError
from gang._torch_groups import TCPStore
from gang.ft import DiLoCo, LocalSGD, ReplicaGang

DILOCO_WORKER = Path(__file__).parent / "diloco_workers.py"


class DiLoCoCluster(Cluster):
    """The ``test_ft`` cluster, running ``diloco_workers.py MODE`` instead of ``ft_workers.py``."""

    bulky = ("global", "local", "momentum", "fragment_params")

    def __init__(self, root: Path, mode: str) -> None:
        self.mode = mode
        self.script = (str(DILOCO_WORKER), mode)
        super().__init__(root)

    def syncs(self) -> tuple[list[dict[str, Any]], dict[int, list[tuple[str, int, dict[str, Any]]]]]:
        """The committed syncs in step order (as the first member logged them) and, per step, every
        ``(replica, process, event)`` that logged it; checks that the members agree on everything."""
        by_step: dict[int, list[tuple[str, int, dict[str, Any]]]] = {}
        for rid, logs in self.logs.items():
            for log in logs:
                process = int(log.name.rpartition(".rr")[2]) if ".rr" in log.name else 0
                for e in self.events(log):
                    if e["event"] == "sync":
                        by_step.setdefault(e["step"], []).append((rid, process, e))
        assert sorted(by_step) == list(range(1, len(by_step) + 1)), sorted(by_step)
        same = ("quorum", "healed", "averaged", "fragments", "local_steps", "fragment_params")
        for step, events in by_step.items():
            first = events[0][2]
            for rid, process, e in events:
                assert {k: e[k] for k in same} == {k: first[k] for k in same}, (step, rid, e, first)
                twin = next(o for _, p, o in events if p == process)
                for key in ("global", "momentum"):  # processes of equal replica rank hold the same shards
                    assert e[key] == twin[key], f"step {step}: {key} of replica {rid} differs"
            logged = sorted((rid, p) for rid, p, _ in events)
            procs = procs_of(self.mode)
            assert logged == sorted((m, p) for m in first["quorum"] for p in range(procs)), (step, logged)
        return [by_step[s][0][2] for s in sorted(by_step)], by_step

    def check_replay(self, *, delay: int, alpha: float, quantize: str | None = None) -> list[dict[str, Any]]:
        """Check every member's parameters after every sync against the replay; return the syncs."""
        syncs, by_step = self.syncs()
        procs = procs_of(self.mode)
        history = replay(
            syncs,
            procs=procs,
            delay=delay,
            alpha=alpha,
            local_sgd=self.mode.endswith("localsgd"),
            jax_replicas=self.mode.startswith("jax"),
            quantize=quantize,
        )
        for sync, expected in zip(syncs, history, strict=True):
            for rid, process, e in by_step[sync["step"]]:
                want_global = _shard(expected["global"], process, procs)
                assert _same(e["global"], want_global), (
                    f"step {sync['step']}: global parameters of replica {rid} process {process} differ from the replay"
                )
                want_local = _shard(expected["local"][rid], process, procs)
                assert _same(e["local"], want_local), (
                    f"step {sync['step']}: local parameters of replica {rid} process {process} differ from the replay"
                )
        return syncs


def _same(logged: list[float] | str, want: torch.Tensor) -> bool:
    """Whether logged parameters (values, or their digest: ``FT_HIDDEN``) are ``want``, bit for bit."""
    if isinstance(logged, str):
        return logged == digest(want)
    return torch.equal(torch.tensor(logged, dtype=torch.float64), want)


def _shard(params: list[torch.Tensor], process: int, procs: int) -> torch.Tensor:
    """Process ``process``'s flat local shards of ``params`` (FSDP2 shards dim 0 in ``procs`` chunks)."""
    if not params:  # LocalSGD has no global parameters
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([p.chunk(procs)[process].reshape(-1) for p in params])


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Any]:
    clusters: list[DiLoCoCluster] = []

    def make(mode: str) -> DiLoCoCluster:
        clusters.append(DiLoCoCluster(tmp_path, mode))
        return clusters[-1]

    try:
        yield make
        leftovers = [pid for c in clusters for pid in c.leftovers()]
    finally:
        for c in clusters:
            c.close()
    assert not leftovers, leftovers


# Streaming DiLoCo: 2 fragments synced every 4 local steps (fragment 0 after local steps 1, 5, 9,
# ...; fragment 1 after 3, 7, 11, ...), applied one local step later, half local and half global.
STREAMING = {"FT_SYNC_EVERY": "4", "FT_FRAGMENTS": "2", "FT_DELAY": "1", "FT_ALPHA": "0.5"}
TIMEOUTS = {"FT_TIMEOUT": "30", "FT_QUORUM_TIMEOUT": "20", "FT_HEARTBEAT_TIMEOUT": "3"}


QUANTIZE = [None, "int8", "float8"]


def _quantize_env(quantize: str | None) -> dict[str, str]:
    return {"FT_QUANTIZE": quantize} if quantize else {}


@pytest.mark.parametrize(
    ("mode", "quantize"), [("one", None), ("one", "int8"), ("one", "float8"), ("jax", None), ("jax", "int8")]
)
def test_streaming_diloco_kills_restart_new_replica_and_min_replicas(
    make_cluster: Any, mode: str, quantize: str | None
) -> None:
    # Three one-process replicas (min_replicas=2). Each exchange starts through async handles and
    # is voted on and applied one local step later. Replica 1 is SIGKILLed between syncs (before
    # local step 7, with nothing in flight) and restarted while the others wait before local step
    # 8: it heals at their next sync (after local step 9: global parameters, outer momentum,
    # counters), is left out of its average and receives it. Replica 2 is SIGKILLed inside the
    # exchange started after local step 11: that sync is aborted on 0 and 1 (after local step 12)
    # and retried after local step 13, together with the fragment due then. Brand-new replica 3
    # joins at the sync after local step 17. Replicas 1 and 3 stop after 21 local steps; replica
    # 0, alone, cannot form its next quorum: GangError. Quantized (int8, float8), every member
    # gets the same bits as the replay that quantizes alike. `jax`: the same with JAX replicas
    # (gang_jax.ft.DiLoCo over pytrees, optax outside), judged by the replay of the same in JAX.
    cluster = make_cluster(mode)
    env = STREAMING | TIMEOUTS | _quantize_env(quantize)
    plan = {"0": ("step:8,step:16", 24), "1": ("step:7", 21), "2": ("step:8,exchange:11", 24)}
    for rid, (pause, steps) in plan.items():
        cluster.start(rid, pause=pause, steps=steps, min_replicas=2, env=env)
    for rid in plan:
        cluster.wait(rid, "paused", 1)
    for rid in plan:
        cluster.release(rid, "enter", 1)
    cluster.wait("1", "paused", 7)
    cluster.signal("1", signal.SIGKILL)
    for rid in ("0", "2"):
        cluster.wait(rid, "paused", 8)
    cluster.start("1", pause="step:16", steps=21, min_replicas=2, env=env)
    cluster.wait("1", "paused", 1)
    cluster.release("1", "enter", 1)
    for rid in ("0", "2"):
        cluster.release(rid, "step", 8)
    cluster.wait("2", "paused", 11)
    cluster.signal("2", signal.SIGKILL)
    for rid in ("0", "1"):
        cluster.wait(rid, "paused", 16)
    cluster.start("3", steps=21, min_replicas=2, env=env)
    cluster.wait("3", "paused", 1)
    cluster.release("3", "enter", 1)
    for rid in ("0", "1"):
        cluster.release(rid, "step", 16)
    cluster.finish({"0": 3, "1": 0, "3": 0})
    error = cluster.wait("0", "error")["error"]
    assert "min_replicas" in error, error

    syncs = cluster.check_replay(delay=1, alpha=0.5, quantize=quantize)
    got = [(s["local_steps"], s["fragments"], s["quorum"], sorted(s["healed"]), s["averaged"]) for s in syncs]
    all3, survivors, late = ["0", "1", "2"], ["0", "2"], ["0", "1", "3"]
    assert got == [
        (0, [], all3, ["1", "2"], ["0"]),  # entering: every replica adopts replica 0's parameters
        (2, [0], all3, [], all3),
        (4, [1], all3, [], all3),
        (6, [0], all3, [], all3),
        (8, [1], survivors, [], survivors),  # replica 1 was killed before local step 7
        (10, [0], all3, ["1"], survivors),  # the restarted replica 1 heals and is left out of the average
        # the exchange after local step 11 failed (replica 2 killed in it): retried after step 13
        (14, [0, 1], ["0", "1"], [], ["0", "1"]),
        (16, [1], ["0", "1"], [], ["0", "1"]),
        (18, [0], late, ["3"], ["0", "1"]),  # brand-new replica 3 heals
        (20, [1], late, [], late),
    ], got
    assert syncs[0]["fragment_params"] == [[0], [1, 2, 3]]  # 1024 bytes, then 128 + 512 + 32
    # Fragment 0, the first weight: 128 float64 values, or quantized one chunk of 128 codes and a
    # 4-byte scale per member (the chunks are whole blocks of 128: padding included).
    assert syncs[1]["bytes"] == (16 * 8 * 8 if quantize is None else 3 * (128 + 4)), syncs[1]
    assert all(s["applied_after"] == s["local_steps"] + 1 for s in syncs[1:]), syncs  # one step later
    for rid in ("1", "3"):  # the new incarnations healed before their first sync
        events = [e["event"] for e in cluster.events(cluster.current(rid)[0])]
        assert "healed" in events and events.index("healed") < events.index("sync"), (rid, events)
    # The aborted exchange was logged as an aborted step on the survivors, and nothing of it applied.
    for rid in ("0", "1"):
        aborts = [
            e["ft"]
            for e in cluster.events(cluster.current(rid)[0])
            if e["event"] == "ft_log" and e["ft"]["event"] == "abort"
        ]
        assert aborts, rid


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_streaming_diloco_uneven_schedule_and_asymmetric_alpha(make_cluster: Any, quantize: str | None) -> None:
    # Streaming DiLoCo with a schedule that 2 fragments do not divide (sync_every=5: fragment 0
    # after local steps t % 5 == 5 // 2 - 1 == 1, fragment 1 after t % 5 == 10 // 2 - 1 == 4) and
    # an asymmetric alpha (a quarter local, three quarters global) on 3 replicas, without faults.
    cluster = make_cluster("one")
    env = {"FT_SYNC_EVERY": "5", "FT_FRAGMENTS": "2", "FT_DELAY": "1", "FT_ALPHA": "0.25"} | _quantize_env(quantize)
    cluster.start_all(dict.fromkeys(("0", "1", "2"), ""), steps=dict.fromkeys(("0", "1", "2"), 11), env=env)
    cluster.finish(dict.fromkeys(("0", "1", "2"), 0))
    syncs = cluster.check_replay(delay=1, alpha=0.25, quantize=quantize)
    got = [(s["local_steps"], s["fragments"], s["applied_after"]) for s in syncs]
    assert got == [(0, [], 0), (2, [0], 3), (5, [1], 6), (7, [0], 8), (10, [1], 11)], got


@pytest.mark.parametrize(("mode", "quantize"), [("fsdp", None), ("fsdp", "int8"), ("jaxfsdp", None)])
def test_diloco_fsdp2_replicas_kill_restart_and_kill_in_exchange(
    make_cluster: Any, mode: str, quantize: str | None
) -> None:
    # Three replicas of 2 processes (one torchrun each), each sharding the model with fully_shard
    # on gang_mesh.fsdp_mesh; each process averages its own shards with the process of equal
    # replica rank. Replica rank 1 of replica 1 is SIGKILLed between syncs (before local step 6;
    # its torchrun ends the replica) and the replica restarted: each of its processes heals from
    # the process of equal replica rank (shards of the global parameters and of the outer
    # momentum). Replica rank 0 of replica 2 is SIGKILLed inside the exchange after local step 11.
    # Brand-new replica 3 (2 processes) joins at the last sync, after local step 15. Quantized, each
    # process quantizes the flat concatenation of its own shards. `jaxfsdp`: the same with JAX
    # replicas of 2 processes, which average their gradients through the replica's JaxGang and each
    # give only their own shard to their own gang_jax.ft.DiLoCo (its optax state heals shard by
    # shard), judged by the replay of the same in JAX.
    cluster = make_cluster(mode)
    env = {"FT_SYNC_EVERY": "4", "FT_FRAGMENTS": "2"} | TIMEOUTS | _quantize_env(quantize)
    plan = {"0": "step:8,step:14", "1": "step:6", "2": "step:8,exchange:11@0"}
    for rid, pause in plan.items():
        cluster.start(rid, pause=pause, steps=16, nproc=2, env=env)
    for rid in plan:
        cluster.wait(rid, "paused", 1)
    for rid in plan:
        cluster.release(rid, "enter", 1)
    cluster.wait("1", "paused", 6)
    cluster.signal("1", signal.SIGKILL, rank=1)
    for rid in ("0", "2"):
        cluster.wait(rid, "paused", 8)
    cluster.start("1", pause="step:14", steps=16, nproc=2, env=env)
    cluster.wait("1", "paused", 1)
    cluster.release("1", "enter", 1)
    for rid in ("0", "2"):
        cluster.release(rid, "step", 8)
    cluster.wait("2", "paused", 11, rank=0)
    cluster.signal("2", signal.SIGKILL, rank=0)
    for rid in ("0", "1"):
        cluster.wait(rid, "paused", 14)
    cluster.start("3", steps=16, nproc=2, env=env)
    cluster.wait("3", "paused", 1)
    cluster.release("3", "enter", 1)
    for rid in ("0", "1"):
        cluster.release(rid, "step", 14)
    cluster.finish({"0": 0, "1": 0, "3": 0})

    syncs = cluster.check_replay(delay=0, alpha=0.0, quantize=quantize)
    got = [(s["local_steps"], s["fragments"], s["quorum"], sorted(s["healed"]), s["averaged"]) for s in syncs]
    all3, survivors, pair = ["0", "1", "2"], ["0", "2"], ["0", "1"]
    assert got == [
        (0, [], all3, ["1", "2"], ["0"]),
        (2, [0], all3, [], all3),
        (4, [1], all3, [], all3),
        (6, [0], all3, [], all3),
        (8, [1], survivors, [], survivors),
        (10, [0], all3, ["1"], survivors),
        (13, [1], pair, [], pair),
        (14, [0], pair, [], pair),
        (16, [1], ["0", "1", "3"], ["3"], pair),  # brand-new replica 3 heals and is left out
    ], got
    for rid in ("1", "3"):  # every process of the new incarnations healed before its first sync
        for log in cluster.current(rid):
            events = [e["event"] for e in cluster.events(log)]
            assert "healed" in events and events.index("healed") < events.index("sync"), (log.name, events)


@pytest.mark.parametrize(("mode", "quantize"), [("localsgd", None), ("localsgd", "int8"), ("jaxlocalsgd", None)])
def test_local_sgd_replica_killed_in_the_exchange(make_cluster: Any, mode: str, quantize: str | None) -> None:
    # LocalSGD over 3 one-process replicas, averaging their parameters every 3 local steps.
    # Replica 2 is SIGKILLed inside the exchange after local step 5: the sync is aborted on 0 and
    # 1, which keep their local progress and retry it after local step 6 (`jaxlocalsgd`: the same
    # with gang_jax.ft.LocalSGD over JAX pytrees).
    cluster = make_cluster(mode)
    env = {"FT_SYNC_EVERY": "3"} | TIMEOUTS | _quantize_env(quantize)
    plan = {"0": "", "1": "", "2": "exchange:5"}
    for rid, pause in plan.items():
        cluster.start(rid, pause=pause, steps=9, env=env)
    for rid in plan:
        cluster.wait(rid, "paused", 1)
    for rid in plan:
        cluster.release(rid, "enter", 1)
    cluster.wait("2", "paused", 5)
    cluster.signal("2", signal.SIGKILL)
    cluster.finish({"0": 0, "1": 0})
    syncs = cluster.check_replay(delay=0, alpha=0.0, quantize=quantize)
    got = [(s["local_steps"], s["fragments"], s["quorum"], sorted(s["healed"]), s["averaged"]) for s in syncs]
    all3, pair = ["0", "1", "2"], ["0", "1"]
    assert got == [
        (0, [], all3, ["1", "2"], ["0"]),
        (3, [0], all3, [], all3),
        (7, [0], pair, [], pair),  # retried one local step after the failed exchange
        (9, [0], pair, [], pair),
    ], got


def test_torch_and_jax_replicas_train_one_model(make_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Streaming DiLoCo (2 fragments, delay 1, alpha 0.5) over replicas 0 and 1 in torch
    # (gang.ft.DiLoCo) and replica 2 in JAX (gang_jax.ft.DiLoCo), from the same weights, on the
    # same batches, outer plain SGD in both (torch's and the jitted optax update round alike), 17
    # local steps (the last sync, after local step 15, is applied after local step 16).
    # After every sync every member's global parameters are bit-identical (checked by `syncs`),
    # and equal to the same schedule run all in torch (the replay) within 1e-12.
    monkeypatch.setenv("FT_SAME_START", "1")
    monkeypatch.setenv("FT_OUTER", "sgd")
    cluster = make_cluster("one")
    env = STREAMING | TIMEOUTS
    for rid in ("0", "1", "2"):
        cluster.start(rid, steps=17, env=env | ({"FT_MODE": "jax"} if rid == "2" else {}))
    for rid in ("0", "1", "2"):
        cluster.wait(rid, "paused", 1)
    for rid in ("0", "1", "2"):
        cluster.release(rid, "enter", 1)
    cluster.finish({"0": 0, "1": 0, "2": 0})
    syncs, by_step = cluster.syncs()
    assert [(s["local_steps"], s["fragments"], s["quorum"], s["healed"]) for s in syncs] == [
        (0, [], ["0", "1", "2"], {}),
        *((t, [(t // 2 - 1) % 2], ["0", "1", "2"], {}) for t in range(2, 17, 2)),
    ], syncs
    history = replay(syncs, procs=1, delay=1, alpha=0.5)
    worst = 0.0
    for sync, expected in zip(syncs, history, strict=True):
        for rid, _, e in by_step[sync["step"]]:
            want_global, want_local = _shard(expected["global"], 0, 1), _shard(expected["local"][rid], 0, 1)
            for got, want in ((e["global"], want_global), (e["local"], want_local)):
                worst = max(worst, (torch.tensor(got, dtype=torch.float64) - want).abs().max().item())
    assert worst <= 1e-12, worst


@pytest.fixture
def solo() -> Iterator[ReplicaGang]:
    """One replica alone, with its store in this process: argument checks and the schedule without faults."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    g = ReplicaGang.join(
        replica_id="solo",
        store=f"127.0.0.1:{server.port}",
        state_dict=dict,
        load_state_dict=lambda state: None,
        timeout=timedelta(seconds=30),
    )
    try:
        yield g
    finally:
        g.close()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)).double()


def test_bad_arguments_are_refused_before_any_sync(solo: ReplicaGang) -> None:
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    good: dict[str, Any] = {"sync_every": 4}
    cases: list[tuple[dict[str, Any], tuple[Any, ...], type[Exception], str]] = [
        ({}, (object(), model, sgd, outer), TypeError, "`rg` must be a `ReplicaGang`, but is of type `object`"),
        ({}, (solo, "m", sgd, outer), TypeError, "`module` must be a `torch.nn.Module`, but is of type `str`"),
        ({}, (solo, model, None, outer), TypeError, "`inner_optimizer` must be a `torch.optim.Optimizer`"),
        ({}, (solo, model, sgd, 1), TypeError, "`outer_optimizer` must be a `torch.optim.Optimizer`, but is of type"),
        ({}, (solo, model, sgd, sgd), ValueError, "`outer_optimizer` must not be `inner_optimizer`"),
        ({}, (solo, nn.Tanh(), sgd, outer), ValueError, "`module` must have parameters, but Tanh has none"),
        ({"sync_every": 0}, (), ValueError, "`sync_every` must be at least 1, but is 0 instead"),
        ({"sync_every": True}, (), TypeError, "`sync_every` must be an `int`, but is True"),
        ({"fragments": 5}, (), ValueError, "`fragments` must be at most `sync_every` (4) and the number of parameters"),
        ({"fragments": 2, "fragment_sync_delay": 2}, (), ValueError, "`fragment_sync_delay` must be less than"),
        ({"fragment_sync_delay": -1}, (), ValueError, "`fragment_sync_delay` must be at least 0, but is -1"),
        ({"fragment_update_alpha": 1.5}, (), ValueError, "`fragment_update_alpha` must be in [0, 1], but is 1.5"),
        ({"fragment_update_alpha": "0"}, (), TypeError, "`fragment_update_alpha` must be a `float`, but is '0'"),
        ({"quantize": "int4"}, (), ValueError, '`quantize` must be None, "int8" or "float8", but is \'int4\' instead'),
        ({"quantize": 8}, (), ValueError, '`quantize` must be None, "int8" or "float8", but is 8 instead'),
    ]
    for changes, args, error, text in cases:
        with pytest.raises(error, match=re.escape(text)):
            DiLoCo(*(args or (solo, model, sgd, outer)), **(good | changes))
    foreign = torch.optim.SGD(_model().parameters(), lr=0.7)
    with pytest.raises(ValueError, match=re.escape("must be built over `module.parameters()`, but holds 4 parameter")):
        DiLoCo(solo, model, sgd, foreign, sync_every=4)
    with pytest.raises(
        TypeError, match=re.escape("`optimizer` must be a `torch.optim.Optimizer`, but is of type `int`")
    ):
        LocalSGD(solo, model, 3, sync_every=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape('`quantize` must be None, "int8" or "float8", but is \'FP8\'')):
        LocalSGD(solo, model, sgd, sync_every=4, quantize="FP8")
    with pytest.raises(ValueError, match=re.escape("`state_dict` must have the keys ['global', 'outer']")):
        DiLoCo(solo, model, sgd, outer, sync_every=4).load_state_dict({"local_step": 0, "due": [], "pending": []})
    assert solo.step_number == 0  # nothing ran a step


def test_schedule_alone_state_dict_and_local_sgd(solo: ReplicaGang, caplog: pytest.LogCaptureFixture) -> None:
    # One replica: the schedule of 2 fragments every 4 local steps, the outer step from its
    # definition (against a twin model trained without DiLoCo), the sync log, a checkpoint round
    # trip, and LocalSGD's syncs.
    caplog.set_level(logging.INFO, logger="gang.ft")
    model, twin = _model(), _model()
    sgd, twin_sgd = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    outer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def train(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()

    diloco = DiLoCo(solo, model, sgd, outer, sync_every=4, fragments=2)
    with diloco:
        assert diloco.fragments == [[0, 1], [2, 3]] and solo.step_number == 1  # entering is one step
        with pytest.raises(InvalidOperationError, match="already entered"):
            diloco.__enter__()
        start = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            train(model, sgd)
            train(twin, twin_sgd)
        assert solo.step_number == 2 and diloco.local_step == 2  # fragment 0 after local step 1
        after = [p.detach() for p in model.parameters()]
        for i, (g, local) in enumerate(zip(start, twin.parameters(), strict=True)):
            expected = g.clone().add_(g - local.detach(), alpha=-0.5) if i < 2 else local.detach()
            assert torch.equal(after[i], expected), i
        saved = diloco.state_dict()
        assert torch.equal(saved["global"][0], after[0]) and torch.equal(saved["global"][2], start[2])
    train(model, sgd)  # outside `with`: no hook, no count
    assert diloco.local_step == 2 and solo.step_number == 2
    restored = DiLoCo(solo, model, sgd, torch.optim.SGD(model.parameters(), lr=0.5), sync_every=4, fragments=2)
    restored.load_state_dict(saved)
    assert restored.local_step == 2 and restored.state_dict()["due"] == []
    syncs = [r.gang_ft for r in caplog.records if getattr(r, "gang_ft", {}).get("event") == "sync"]  # type: ignore[attr-defined]
    assert [(s["local_steps"], s["fragments"], s["averaged"]) for s in syncs] == [(0, [], ["solo"]), (2, [0], ["solo"])]
    assert syncs[1]["bytes"] == (8 * 4 + 8) * 8, syncs[1]
    with LocalSGD(solo, model, sgd, sync_every=3) as local_sgd:  # step_number > 0: no entering step
        for _ in range(6):
            train(model, sgd)
    assert local_sgd.local_step == 6 and solo.step_number == 4
