"""Training across data centres: gang.ft's ``LocalSGD`` and ``DiLoCo`` side by side with torchft 0.2's.

``python -m benchmarks.ft_diloco [--quick] [--out results.json] [--torchft-python PATH]`` (``nox -s
bench`` runs it) starts local processes itself: the coordination store (``python -m
gang.ft.store``), with ``--torchft-python`` or ``TORCHFT_PYTHON`` also torchft's Lighthouse
(``python -m benchmarks.ft_torchft``, on 127.0.0.1), and 3 replicas of 1 process each, gloo on CPU.
Every replica trains the same MLP (``WIDTH`` x ``DEPTH`` linear layers, the same initial weights)
with AdamW inside, on its own batches, and syncs every ``SYNC_EVERY`` local steps; DiLoCo's outer
optimizer is SGD with Nesterov momentum. Three measurements:

* **Time and bytes per outer step** (ops ``diloco_<config>_outer_step`` and
  ``diloco_<config>_bytes``; configs ``localsgd``, ``diloco`` (1 fragment), ``streaming`` (2 fragments,
  each synced every ``SYNC_EVERY`` steps, ``fragment_sync_delay=1``) and ``streaming_d2`` (the
  same with ``fragment_sync_delay=2``), and gang.ft quantized (``localsgd_int8``, ``diloco_int8``,
  ``diloco_float8``, ``streaming_int8``) against torchft's unquantized same configuration (torchft's
  quantization needs Triton on a CUDA GPU); each implementation follows its own schedule for these
  arguments, the same number of syncs and bytes per outer step): under the torchft interpreter
  every replica process holds *both* implementations, each on its own copy of the model, both
  entered, and runs them in interleaved rounds (the order alternates every round), so both see the
  same load. An outer step is ``SYNC_EVERY`` local steps; its time is that of the slowest replica.
  Its breakdown: ``compute_ms`` (forward and backward), ``inner_ms`` (``SYNC_EVERY`` times the
  median ``inner.step()`` of the round) and ``sync_ms`` (what the ``step()`` calls took beyond
  that: the syncs run in their hooks), and of that ``quorum_ms`` (gang.ft: forming the quorum
  through the store, ``ReplicaGang``'s ``_begin``; torchft: ``Manager.start_quorum()``),
  ``vote_ms`` (gang.ft's vote; torchft's ``should_commit()``), and for gang.ft ``pack_ms`` (the
  contribution written, and quantized, into the send buffer) and ``update_ms`` (the average
  applied: LocalSGD's copy, DiLoCo's outer step), the rest being the exchange (and torchft's
  update). gang.ft's quorum in parts (:data:`QUORUM_PHASES`, means over replicas and rounds: one
  replica proposes, one publishes), its store requests per outer step (``requests``, the training
  thread's) and its exchange's two collectives (``all_to_all_ms``, ``all_gather_ms``: blocking ones
  with their wait, async ones only started). Bytes are counted by the kernel: the growth of
  ``tcpi_bytes_acked`` over every TCP socket the implementation opened in the process (socket
  ownership by the moment a socket first appears), during that implementation's own rounds, per
  outer step, as ``bytes_to_peers`` and ``bytes_to_coordinator`` (the gang.ft store or torchft's
  Lighthouse); ``payload_bytes`` is what one replica contributes (the parameters or
  pseudo-gradients synced per outer step). ``ratio`` is gang.ft over torchft (medians) and
  ``paired_ratio`` the median over rounds of each round's ratio.
* **Overlap** (op ``diloco_overlap``, gang.ft alone): streaming DiLoCo with 2 fragments and
  ``fragment_sync_delay`` 0, 1 and 2 (the exchange through async handles while the next local
  steps compute) in interleaved rounds in the same processes (a fresh ``DiLoCo`` per round; the
  timed window holds every exchange it starts and their ends), and ``exchange_ms``: one
  fragment's exchange alone as DiLoCo runs it inside a step of the replica gang (an all-to-all of
  a chunk per member, an all-gather of the averaged chunks). ``waited_ms_delay<d>`` is the median
  of the sync records' ``waited``: the vote and the update, and with a delay what the local steps
  left of the exchange; ``hidden_delay<d>`` is ``1 - (waited_d - waited_0) / exchange``, the
  share of the exchange that no longer shows at the vote. With them, the outer step's time and
  ``sync_ms_delay<d>``, what its ``step()`` calls took beyond the median one (slowest replica).
* **Recovery** (ops ``diloco_kill_to_sync`` and ``diloco_restart_to_sync``; DiLoCo, 1 fragment):
  replica 2 is ``SIGKILL``\\ ed at a random moment between syncs; the time from the signal to the
  survivors' next committed sync without it (the later of the two), split into the wait for the
  sync's local step (``to_start_s``: the schedule, the same for both) and the sync's own
  ``step()`` (``sync_s``: the dead replica noticed, the exchange, the vote); then replica 2 is
  started again and the time from its launch (``Popen``) to the first committed sync it takes part
  in, with the moments it had imported torch, built its model and joined. Both implementations
  use a 1 s timeout (gang.ft's ``timeout``, torchft's Lighthouse join and heartbeat timeouts) and
  wait at least 5 s for a quorum (gang.ft's ``quorum_timeout``, torchft's Manager timeout).

A worker process (``python -m benchmarks.ft_diloco worker ...``) is one replica; the driver prints
a table and writes ``<out stem>_ft_diloco.json`` (rows as in ``gang.bench.metrics.make_row``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import random
import socket
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from benchmarks.ft import (
    ROOT,
    Runner,
    _commit,
    _fail,
    _launch_stamps,
    _steady,
    check_torchft_python,
    row_cells,
    write_rows,
)
from gang.bench.metrics import Row, make_row, median

sys.path.insert(0, str(ROOT / "examples"))
from _ft_launch import LocalJob

REPLICAS = 3
WIDTH = 512
DEPTH = 4
MICRO_BATCH = 32
SYNC_EVERY = 20
"""Local steps per outer step (each fragment is synced once per outer step)."""
CONFIGS: dict[str, tuple[int, int, str | None]] = {
    "localsgd": (1, 0, None),
    "localsgd_int8": (1, 0, "int8"),
    "diloco": (1, 0, None),
    "diloco_int8": (1, 0, "int8"),
    "diloco_float8": (1, 0, "float8"),
    "streaming": (2, 1, None),
    "streaming_int8": (2, 1, "int8"),
    "streaming_d2": (2, 2, None),
}
"""Per config: ``fragments``, ``fragment_sync_delay`` and gang.ft's ``quantize`` (torchft's side of a
quantized config runs unquantized: its quantization needs Triton on a CUDA GPU)."""
TIMEOUT_S = 5.0
"""The timeout of both implementations while their per-step cost is measured."""
LAUNCH_TIMEOUT_S = 600.0
"""The longest wait for a line of a replica (starting torch on a loaded machine takes minutes)."""
RECOVERY_TIMEOUT_S = 1.0
"""gang.ft's ``timeout`` and torchft's Lighthouse join and heartbeat timeouts in the recovery measurement."""

# --------------------------------------------------------------------------------------------------
# One replica (a worker process)
# --------------------------------------------------------------------------------------------------


class Replica:
    """One implementation's model, inner and outer optimizers on one replica (the state healing moves)."""

    def __init__(self, replica: int) -> None:
        self.replica = replica
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        self.model = nn.Sequential(*layers[:-1])
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def outer(self, params: Any) -> torch.optim.Optimizer:
        """An outer optimizer over ``params``."""
        return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)

    def fragments(self, count: int) -> list[nn.Module]:
        """The model cut into ``count`` modules of consecutive layers (as gang.ft cuts its parameters)."""
        linear = [m for m in self.model if isinstance(m, nn.Linear)]
        per = len(linear) // count
        return [nn.ModuleList(linear[i * per : (i + 1) * per]) for i in range(count)]

    def state_dict(self) -> dict[str, Any]:
        """The user's state: the model and the inner optimizer."""
        return {"model": self.model.state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the state received from a healthy replica."""
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])

    def forward_backward(self, step: int) -> None:
        """The forward and backward pass of local step ``step`` on this replica's own batch."""
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.replica}/{step}".encode()))
        x = torch.randn(MICRO_BATCH, WIDTH, generator=generator)
        self.inner.zero_grad()
        functional.mse_loss(self.model(x), x.tanh()).backward()  # type: ignore[no-untyped-call]


class Impl:
    """One implementation in a worker: its replica, its entered context manager and its sync counter."""

    def __init__(
        self,
        name: str,
        replica: Replica,
        syncs: Callable[[], int],
        size: Callable[[], int],
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        self.replica = replica
        self.syncs = syncs
        self.size = size
        self.close = close
        self.local_step = 0
        self.phases: dict[str, float] = {}
        """Seconds spent in each timed call of the implementation (see :func:`time_calls`)."""

    def local_steps(self, count: int) -> tuple[float, float, list[float]]:
        """Run ``count`` local steps; return the compute seconds, the total seconds and each ``step()``'s seconds."""
        compute = 0.0
        steps = []
        start = time.perf_counter()
        for _ in range(count):
            begin = time.perf_counter()
            self.replica.forward_backward(self.local_step)
            middle = time.perf_counter()
            self.replica.inner.step()
            steps.append(time.perf_counter() - middle)
            compute += middle - begin
            self.local_step += 1
        return compute, time.perf_counter() - start, steps


def time_calls(owner: Any, method: str, phases: dict[str, float], phase: str) -> None:
    """Replace ``owner.method`` (on the instance) by a wrapper that adds its seconds to ``phases[phase]``."""
    original = getattr(owner, method)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start

    setattr(owner, method, timed)


def count_calls(owner: Any, method: str, counts: dict[str, float], name: str) -> None:
    """Replace ``owner.method`` (on the instance) by a wrapper that adds one to ``counts[name]`` per call."""
    original = getattr(owner, method)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] = counts.get(name, 0.0) + 1
        return original(*args, **kwargs)

    setattr(owner, method, counted)


Maker = Callable[[argparse.Namespace, int, int, str, float, Callable[[], None]], tuple[Impl, Any]]


def make_gang(
    args: argparse.Namespace, fragments: int, delay: int, kind: str, timeout_s: float, on_built: Callable[[], None]
) -> tuple[Impl, Any]:
    """gang.ft's implementation (joined from the environment) and its context manager, not yet entered."""
    from benchmarks.ft_torchft import MANAGER_TIMEOUT_S
    from gang.ft import DiLoCo, LocalSGD, ReplicaGang

    replica = Replica(args.replica)
    on_built()
    rg = ReplicaGang.join(
        device=torch.device("cpu"),
        state_dict=replica.state_dict,
        load_state_dict=replica.load_state_dict,
        min_replicas=args.min_replicas,
        timeout=timedelta(seconds=timeout_s),
        # torchft's Manager waits at least MANAGER_TIMEOUT_S for its quorum: the same bound here.
        quorum_timeout=timedelta(seconds=max(timeout_s, MANAGER_TIMEOUT_S)),
    )
    manager: Any
    quantize = CONFIGS[kind][2] if kind in CONFIGS else None
    if kind.startswith("localsgd"):
        manager = LocalSGD(rg, replica.model, replica.inner, sync_every=SYNC_EVERY, quantize=quantize)
    else:
        outer = replica.outer(replica.model.parameters())
        manager = DiLoCo(
            rg,
            replica.model,
            replica.inner,
            outer,
            sync_every=SYNC_EVERY,
            fragments=fragments,
            fragment_sync_delay=delay,
            quantize=quantize,
        )
    impl = Impl("gang.ft", replica, lambda: rg.step_number, lambda: rg.size, rg.close)
    # The quorum (formed through the store, with a heal if one is due) and the vote.
    time_calls(rg, "_begin", impl.phases, "quorum")
    time_calls(rg, "_vote", impl.phases, "vote")
    # The contribution written (and quantized) into the send buffer, and the update applied.
    time_calls(manager, "_pack", impl.phases, "pack")
    time_calls(manager, "_land", impl.phases, "update")
    # Inside the quorum (see QUORUM_PHASES): the rest of it is the wait for the others.
    protocol = rg._protocol
    time_calls(protocol, "_propose", impl.phases, "propose")
    time_calls(protocol, "_join", impl.phases, "join")
    time_calls(protocol, "_lead", impl.phases, "lead")
    time_calls(rg, "_rebuild", impl.phases, "rebuild")
    time_calls(rg, "_heal", impl.phases, "heal")
    count_calls(protocol.client, "_call", impl.phases, "requests")
    # The exchange's two collectives (a blocking one with its wait; an async one only started).
    time_calls(rg, "_all_to_all", impl.phases, "all_to_all")
    time_calls(rg, "_all_gather", impl.phases, "all_gather")
    return impl, manager


def make_torchft(
    args: argparse.Namespace, fragments: int, delay: int, kind: str, timeout_s: float, on_built: Callable[[], None]
) -> tuple[Impl, Any]:
    """torchft's implementation (a ``Manager`` with a synchronous quorum) and its context manager."""
    from benchmarks.ft_torchft import make_manager

    local_sgd: Any = importlib.import_module("torchft.local_sgd")
    replica = Replica(args.replica)
    on_built()
    store, manager = make_manager(
        replica, args.replica, args.min_replicas, args.lighthouse, timeout_s, use_async_quorum=False
    )
    if kind.startswith("localsgd"):
        wrapper = local_sgd.LocalSGD(manager, replica.model, replica.inner, sync_every=SYNC_EVERY)
    else:
        parts = replica.fragments(fragments)
        outers = [replica.outer(part.parameters()) for part in parts]
        wrapper = local_sgd.DiLoCo(
            manager, parts, replica.inner, outers, sync_every=SYNC_EVERY, pin_memory=False, fragment_sync_delay=delay
        )
    sizes = (lambda: int(manager.current_step()), lambda: int(manager.num_participants()))
    impl = Impl("torchft", replica, *sizes, lambda: (manager.shutdown(wait=False), store)[0])
    time_calls(manager, "start_quorum", impl.phases, "quorum")
    time_calls(manager, "should_commit", impl.phases, "vote")
    return impl, wrapper


TCP_INFO_BYTES_ACKED = 120
"""The offset of ``tcpi_bytes_acked`` (u64) in Linux's ``struct tcp_info``."""


def tcp_sockets() -> dict[int, tuple[int, int]]:
    """Every TCP socket of this process: its inode -> (bytes sent and acknowledged, the peer's port)."""
    found: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:["):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
            peer = sock.getpeername()[1]
            found[int(link[8:-1])] = (struct.unpack_from("Q", info, TCP_INFO_BYTES_ACKED)[0], int(peer))
        except OSError:
            continue
        finally:
            sock.close()
    return found


class ByteCounter:
    """Attributes each TCP socket of the process to the implementation that was active when it appeared."""

    def __init__(self) -> None:
        self.owner = {inode: "" for inode in tcp_sockets()}

    def claim(self, name: str) -> dict[int, tuple[int, int]]:
        """Give every socket not seen before to ``name``; return the current counts."""
        now = tcp_sockets()
        for inode in now:
            self.owner.setdefault(inode, name)
        return now

    def sent(self, name: str, before: dict[int, tuple[int, int]], coordinator: int) -> tuple[int, int]:
        """The bytes ``name``'s sockets sent since ``before``: (to peers, to the coordinator port)."""
        now = self.claim(name)
        peers = coord = 0
        for inode, (acked, port) in now.items():
            if self.owner[inode] != name:
                continue
            grown = acked - before.get(inode, (0, 0))[0]
            if port == coordinator:
                coord += grown
            else:
                peers += grown
        return peers, coord


def payload_bytes(model: nn.Module) -> int:
    """The bytes one replica contributes per outer step: every parameter once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def worker_paired(args: argparse.Namespace) -> None:
    """Time both implementations (or gang.ft alone) in interleaved rounds; print each replica's result."""
    fragments, delay, _ = CONFIGS[args.config]
    counter = ByteCounter()
    impls: list[tuple[Impl, Any]] = []
    for name in args.impls:
        make: Maker = make_gang if name == "gang" else make_torchft
        impls.append(make(args, fragments, delay, args.config, TIMEOUT_S, lambda: None))
        counter.claim(impls[-1][0].name)
    for impl, manager in impls:
        manager.__enter__()
        counter.claim(impl.name)
        # Warm-up: the first sync (and gang.ft's entering step), and `delay` more local steps, so
        # that no exchange is in flight when a round ends (one started after a round's last
        # fragment is applied after its first `delay` steps otherwise, hidden in the other's round).
        impl.local_steps(SYNC_EVERY + delay)
        counter.claim(impl.name)
    ports = {"gang.ft": int(os.environ["GANG_FT_STORE"].rsplit(":", 1)[1])}
    if args.lighthouse:
        ports["torchft"] = int(args.lighthouse.rsplit(":", 1)[1])
    result: dict[str, dict[str, list[Any]]] = {impl.name: {} for impl, _ in impls}
    for round_ in range(args.rounds):
        for impl, _ in impls if round_ % 2 == 0 else impls[::-1]:
            record = result[impl.name]
            before, syncs = counter.claim(impl.name), impl.syncs()
            impl.phases.clear()
            steps: list[float] = []
            for _ in range(args.outer_steps):
                compute, total, inner = impl.local_steps(SYNC_EVERY)
                steps += inner
                record.setdefault("outer_s", []).append(total)
                record.setdefault("compute_s", []).append(compute)
                record.setdefault("step_s", []).append(sum(inner))
            record.setdefault("inner_median_s", []).append(median(steps))
            peers, coord = counter.sent(impl.name, before, ports[impl.name])
            record.setdefault("bytes_to_peers", []).append(peers / args.outer_steps)
            record.setdefault("bytes_to_coordinator", []).append(coord / args.outer_steps)
            record.setdefault("syncs", []).append((impl.syncs() - syncs) / args.outer_steps)
            if impl.name == "gang.ft":
                inside = sum(impl.phases.get(phase, 0.0) for phase in QUORUM_PHASES[:-1])
                impl.phases["wait"] = impl.phases.get("quorum", 0.0) - inside
            for phase in PHASES + QUORUM_PHASES + EXCHANGE_PHASES + ("requests",):
                record.setdefault(f"{phase}_s", []).append(impl.phases.get(phase, 0.0) / args.outer_steps)
            if impl.size() != REPLICAS:
                raise RuntimeError(f"{impl.name} synced with {impl.size()} replicas, not {REPLICAS}")
    for impl, manager in impls:
        manager.__exit__(None, None, None)
        result[impl.name]["payload_bytes"] = [payload_bytes(impl.replica.model)]
    print("@result " + json.dumps(result), flush=True)
    for impl, _ in impls:
        impl.close()


class SyncRecords(logging.Handler):
    """Keeps the ``seconds`` and ``waited`` of the ``gang.ft`` logger's ``sync`` records."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self.waited: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "gang_ft", {})
        if fields.get("event") == "sync" and fields.get("fragments"):
            self.seconds.append(fields["seconds"])
            self.waited.append(fields["waited"])


PHASES = ("quorum", "pack", "vote", "update")
"""The timed phases of a sync (gang.ft has all four, torchft ``quorum`` and ``vote``)."""

QUORUM_PHASES = ("propose", "join", "lead", "rebuild", "heal", "wait")
"""gang.ft's quorum, in parts: the next round proposed by the last voter of the previous one as it
enters the step (``propose``), joining the round (``join``: with the last member's publication of the
proposal), a leader's reads and decision (``lead``), the group built anew (``rebuild``) and the heal
(``heal``); ``wait`` is the rest: polling the round's result while the others arrive."""

EXCHANGE_PHASES = ("all_to_all", "all_gather")
"""gang.ft's exchange, timed per collective (a blocking one with its wait, an async one only started)."""

OVERLAP_DELAYS = (0, 1, 2)
"""The ``fragment_sync_delay`` values of the overlap measurement."""


def worker_overlap(args: argparse.Namespace) -> None:
    """Streaming DiLoCo (2 fragments) with each delay of ``OVERLAP_DELAYS`` in interleaved rounds, and
    one exchange alone."""
    from gang.ft import DiLoCo, ReplicaGang

    replicas = {delay: Replica(args.replica) for delay in OVERLAP_DELAYS}
    rg = ReplicaGang.join(
        device=torch.device("cpu"),
        state_dict=replicas[0].state_dict,
        load_state_dict=replicas[0].load_state_dict,
        min_replicas=REPLICAS,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    records = SyncRecords()
    logger = logging.getLogger("gang.ft")
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    impls = {d: Impl(f"delay {d}", r, lambda: rg.step_number, lambda: rg.size) for d, r in replicas.items()}
    result: dict[str, list[float]] = {}
    fragment = 0
    for round_ in range(-1, args.rounds):  # round -1: warm-up
        shift = round_ % len(OVERLAP_DELAYS)
        for delay in OVERLAP_DELAYS[shift:] + OVERLAP_DELAYS[:shift]:
            impl = impls[delay]
            outer = impl.replica.outer(impl.replica.model.parameters())
            diloco = DiLoCo(
                rg,
                impl.replica.model,
                impl.replica.inner,
                outer,
                sync_every=SYNC_EVERY,
                fragments=2,
                fragment_sync_delay=delay,
            )
            records.seconds, records.waited = [], []
            with diloco:
                fragment = len(diloco.fragments[0])
                # A fresh DiLoCo exchanges nothing in its first `delay` steps; the timed window of
                # `outer_steps` outer steps then holds every exchange it starts, and their ends.
                impl.local_steps(delay)
                _, total, steps = impl.local_steps(SYNC_EVERY * args.outer_steps)
            if round_ >= 0:
                result.setdefault(f"outer_s_{delay}", []).append(total / args.outer_steps)
                # What the step() calls took beyond the median one: the syncs' critical path.
                result.setdefault(f"sync_s_{delay}", []).append(
                    (sum(steps) - len(steps) * median(steps)) / args.outer_steps
                )
                result.setdefault(f"seconds_{delay}", []).extend(records.seconds)
                result.setdefault(f"waited_{delay}", []).extend(records.waited)
    # One fragment's exchange alone, as DiLoCo runs it inside a step: an all-to-all of a chunk per
    # member, then an all-gather of the averaged chunks.
    numel = sum(p.numel() for p in list(replicas[0].model.parameters())[:fragment])
    chunks = torch.randn(REPLICAS, -(-numel // REPLICAS))
    received, table = torch.empty_like(chunks), torch.empty_like(chunks)
    for _ in range(args.rounds):
        with rg.step():
            start = time.perf_counter()
            rg.all_to_all(received, chunks)
            rg.all_gather(table, received.mean(0))
            result.setdefault("exchange_s", []).append(time.perf_counter() - start)
            rg.should_commit()
    print("@result " + json.dumps(result), flush=True)
    rg.close()


def worker_recovery(args: argparse.Namespace) -> None:
    """DiLoCo until killed, printing a timestamped line per committed sync (and the moments of its start)."""
    print(f"@imported {time.time()}", flush=True)
    make: Maker = make_gang if args.impl == "gang" else make_torchft
    impl, manager = make(args, 1, 0, "diloco", args.timeout, lambda: print(f"@built {time.time()}", flush=True))
    print(f"@joined {time.time()}", flush=True)
    while args.gate and not os.path.exists(args.gate):  # the first start: until every replica joined
        time.sleep(0.05)
    with manager:
        while True:
            before = impl.syncs()
            impl.replica.forward_backward(impl.local_step)
            started = time.time()
            impl.replica.inner.step()
            impl.local_step += 1
            if impl.syncs() > before:
                print(f"@commit {impl.syncs()} {time.time()} {impl.size()} {before} {started}", flush=True)


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def _python(impls: Sequence[str], torchft_python: str | None) -> Runner:
    """A runner whose interpreter can run ``impls`` (torchft's when torchft is among them)."""
    runner = Runner("torchft" if "torchft" in impls else "gang", torchft_python, TIMEOUT_S)
    runner.module = "benchmarks.ft_diloco"
    return runner


def _results(job: LocalJob, timeout: float) -> list[dict[str, Any]]:
    """Every replica's ``@result`` (in replica order)."""
    found: dict[str, dict[str, Any]] = {}
    while len(found) < REPLICAS:
        line = job.expect(lambda line: line.text.startswith("@result "), timeout)
        found[line.name] = json.loads(line.text.removeprefix("@result "))
    return [found[f"replica {r}"] for r in range(REPLICAS)]


def measure_paired(config: str, impls: Sequence[str], torchft_python: str | None, rounds: int) -> list[dict[str, Any]]:
    """Run one config's paired measurement on 3 replicas; return each replica's result."""
    runner = _python(impls, torchft_python)
    with LocalJob(echo=False) as job:
        reach = {"GANG_FT_STORE": job.start_store(timeout=LAUNCH_TIMEOUT_S)}
        if "torchft" in impls:
            reach.update(runner.start_coordinator(job, LAUNCH_TIMEOUT_S))
        args = ["paired", "--config", config, "--rounds", str(rounds), "--impls", *impls]
        for replica in range(REPLICAS):
            runner.start_replica(job, replica, reach, args)
        try:
            return _results(job, 900)
        except TimeoutError as error:
            raise _fail(job, error) from None


def measure_overlap(rounds: int) -> list[dict[str, Any]]:
    """Run the overlap measurement (gang.ft alone) on 3 replicas; return each replica's result."""
    runner = _python(["gang"], None)
    with LocalJob(echo=False) as job:
        reach = {"GANG_FT_STORE": job.start_store(timeout=LAUNCH_TIMEOUT_S)}
        for replica in range(REPLICAS):
            runner.start_replica(job, replica, reach, ["overlap", "--rounds", str(rounds)])
        try:
            return _results(job, 900)
        except TimeoutError as error:
            raise _fail(job, error) from None


def measure_recovery(impl: str, torchft_python: str | None, cycles: int) -> list[dict[str, float]]:
    """Kill replica 2 and start it again ``cycles`` times; return the times of each cycle."""
    runner = Runner(impl, torchft_python, RECOVERY_TIMEOUT_S)
    runner.module = "benchmarks.ft_diloco"
    samples: list[dict[str, float]] = []
    with LocalJob(echo=False) as job:
        reach = runner.start_coordinator(job, LAUNCH_TIMEOUT_S)
        gate = Path(tempfile.mkdtemp()) / "gate"
        args = ["recovery", "--min-replicas", "1", "--gate", str(gate)]
        for replica in range(REPLICAS):
            runner.start_replica(job, replica, reach, args)
        try:
            # The replicas start training together: one that trained alone for a while (the
            # others still starting on a loaded machine) would outrun the quorum timeout.
            for _ in range(REPLICAS):
                job.expect(lambda line: line.text.startswith("@joined"), LAUNCH_TIMEOUT_S)
            gate.touch()
            for _ in range(cycles):
                _steady(job, REPLICAS, steps=2, timeout=LAUNCH_TIMEOUT_S)
                # Anywhere between two syncs (an outer step is SYNC_EVERY local steps).
                time.sleep(random.uniform(0, 0.5))
                killed = job.kill("replica 2")
                survivors: dict[str, tuple[float, float]] = {}
                while len(survivors) < 2:
                    line = job.expect(lambda line: (c := _commit(line)) is not None and c[2] == 2, LAUNCH_TIMEOUT_S)
                    fields = line.text.split()
                    survivors.setdefault(line.name, (float(fields[2]), float(fields[5])))
                _steady(job, 2, steps=2, timeout=LAUNCH_TIMEOUT_S)
                launched = runner.start_replica(job, 2, reach, args)
                first = job.expect(
                    lambda line: line.name == "replica 2" and line.text.startswith("@commit"), LAUNCH_TIMEOUT_S
                )
                commit = _commit(first)
                assert commit is not None
                stamps = _launch_stamps(job.output("replica 2"))
                last = max(survivors.values())
                samples.append(
                    {
                        "kill_to_sync": last[0] - killed,
                        "to_start": max(0.0, last[1] - killed),
                        "sync": last[0] - max(last[1], killed),
                        "restart_to_sync": commit[1] - launched,
                        "restart_to_imported": stamps.get("@imported", float("nan")) - launched,
                        "restart_to_built": stamps.get("@built", float("nan")) - launched,
                        "restart_to_joined": stamps.get("@joined", float("nan")) - launched,
                    }
                )
                s = samples[-1]
                print(
                    f"# {impl:>8} cycle {len(samples)}: kill -> survivors' next sync {s['kill_to_sync']:.2f} s "
                    f"(its local step began {s['to_start']:.2f} s after the kill, the sync took {s['sync']:.2f} s), "
                    f"launch -> first sync {s['restart_to_sync']:.2f} s (imported {s['restart_to_imported']:.2f} s, "
                    f"built {s['restart_to_built']:.2f} s, joined {s['restart_to_joined']:.2f} s)",
                    flush=True,
                )
        except (TimeoutError, RuntimeError) as error:
            raise _fail(job, error) from None
    return samples


def paired_rows(config: str, results: list[dict[str, Any]], rounds: int) -> list[Row]:
    """The time and bytes rows of one config (the slowest replica per outer step; bytes: the mean over replicas)."""
    rows: list[Row] = []
    names = list(results[0])
    outer = {n: [max(r[n]["outer_s"][i] for r in results) for i in range(len(results[0][n]["outer_s"]))] for n in names}
    per_round = len(outer[names[0]]) // rounds
    for name in names:
        mine = results[0][name]
        inner = median(r[name]["inner_median_s"][i] for r in results for i in range(rounds))
        extra: dict[str, Any] = {
            "compute_ms": round(
                1e3 * median(max(r[name]["compute_s"][i] for r in results) for i in range(len(outer[name]))), 2
            ),
            "inner_ms": round(1e3 * SYNC_EVERY * inner, 2),
            "sync_ms": round(
                1e3 * median(max(r[name]["step_s"][i] for r in results) for i in range(len(outer[name])))
                - 1e3 * SYNC_EVERY * inner,
                2,
            ),
            "syncs": median(mine["syncs"]),
            # Per outer step, the median over rounds and replicas; the rest of `sync_ms` is the
            # exchange and the update.
            **{
                f"{phase}_ms": round(1e3 * median(q for r in results for q in r[name][f"{phase}_s"]), 2)
                for phase in PHASES + EXCHANGE_PHASES
            },
            # The quorum's parts and the store requests: the mean over rounds and replicas (one
            # replica proposes, one publishes: a median would hide them).
            **{
                f"{phase}_ms": round(1e3 * mean(q for r in results for q in r[name].get(f"{phase}_s", [0.0])), 2)
                for phase in QUORUM_PHASES
            },
            "requests": round(mean(q for r in results for q in r[name].get("requests_s", [0.0])), 2),
            "iters": len(outer[name]),
            "times_ms": [round(t * 1e3, 2) for t in outer[name]],
        }
        if name == "gang.ft" and "torchft" in outer:
            theirs = outer["torchft"]
            extra["ratio"] = median(outer[name]) / median(theirs)
            extra["paired_ratio"] = median(
                median(outer[name][k * per_round : (k + 1) * per_round])
                / median(theirs[k * per_round : (k + 1) * per_round])
                for k in range(rounds)
            )
        rows.append(make_row(name, f"diloco_{config}_outer_step", 0, REPLICAS, median(outer[name]), **extra))
        peers = median(b for r in results for b in r[name]["bytes_to_peers"])
        coord = median(b for r in results for b in r[name]["bytes_to_coordinator"])
        rows.append(
            make_row(
                name,
                f"diloco_{config}_bytes",
                int(mine["payload_bytes"][0]),
                REPLICAS,
                0.0,
                bandwidth=False,
                bytes_sent=round(peers + coord),
                bytes_to_peers=round(peers),
                bytes_to_coordinator=round(coord),
                payload_bytes=mine["payload_bytes"][0],
            )
        )
    return rows


def overlap_row(results: list[dict[str, Any]]) -> Row:
    """The overlap row: outer step times per delay, one exchange alone, the share hidden per delay."""
    count = len(results[0]["outer_s_0"])
    times = {d: median(max(r[f"outer_s_{d}"][i] for r in results) for i in range(count)) for d in OVERLAP_DELAYS}
    exchange = median(max(r["exchange_s"][i] for r in results) for i in range(len(results[0]["exchange_s"])))
    extra: dict[str, Any] = {"exchange_ms": round(exchange * 1e3, 2)}
    syncs = {d: median(max(r[f"sync_s_{d}"][i] for r in results) for i in range(count)) for d in OVERLAP_DELAYS}
    waited = {d: median(s for r in results for s in r[f"waited_{d}"]) for d in OVERLAP_DELAYS}
    for d in OVERLAP_DELAYS:
        extra[f"outer_ms_delay{d}"] = round(times[d] * 1e3, 2)
        extra[f"sync_ms_delay{d}"] = round(syncs[d] * 1e3, 2)
        extra[f"waited_ms_delay{d}"] = round(waited[d] * 1e3, 2)
        if d:
            # At the vote, delay 0 waits for nothing of the exchange (it blocked before): what a
            # delay's vote waits for beyond that is the part of the exchange left unhidden.
            extra[f"hidden_delay{d}"] = round(1 - (waited[d] - waited[0]) / exchange, 3)
    # One sync of delay 0 from the exchange's start (its quorum formed) to its update (the sync records' `seconds`).
    extra["sync_record_ms_delay0"] = round(1e3 * median(s for r in results for s in r["seconds_0"]), 2)
    return make_row("gang.ft", "diloco_overlap", 0, REPLICAS, times[max(OVERLAP_DELAYS)], bandwidth=False, **extra)


def recovery_rows(impl: str, samples: list[dict[str, float]]) -> list[Row]:
    """The rows of the recovery measurement (median over cycles, every cycle in ``samples``)."""
    rows = []
    for key, parts in (
        ("kill_to_sync", ("to_start", "sync")),
        ("restart_to_sync", ("restart_to_imported", "restart_to_built", "restart_to_joined")),
    ):
        extra: dict[str, Any] = {"samples": [s[key] for s in samples], "timeout_s": RECOVERY_TIMEOUT_S}
        for part in parts:
            extra[part.removeprefix("restart_to_") + "_s"] = median(s[part] for s in samples)
        rows.append(make_row(impl, f"diloco_{key}", 0, REPLICAS, median(extra["samples"]), bandwidth=False, **extra))
    return rows


def table(rows: list[Row]) -> str:
    """The printed table of the rows."""
    lines = [f"{'op':>28} {'impl':>8} {'median':>10} {'ratio':>7} {'paired':>7}  breakdown"]
    for row in rows:
        shown, ratio, paired = row_cells(row)
        if row["op"].endswith("_bytes"):
            shown = f"{row['bytes_sent'] / 1e6:7.2f}MB"
            notes = (
                f"to peers {row['bytes_to_peers'] / 1e6:.2f} MB, "
                f"to the coordinator {row['bytes_to_coordinator'] / 1e3:.1f} kB; "
                f"payload {row['payload_bytes'] / 1e6:.2f} MB per replica"
            )
        elif row["op"].endswith("_outer_step"):
            notes = (
                f"compute {row['compute_ms']:.1f} ms, inner steps {row['inner_ms']:.1f} ms, "
                f"syncs {row['sync_ms']:.1f} ms (quorum {row['quorum_ms']:.1f}, pack {row['pack_ms']:.1f}, "
                f"vote {row['vote_ms']:.1f}, update {row['update_ms']:.1f}) "
                + (
                    "(quorum: "
                    + ", ".join(f"{p} {row[f'{p}_ms']:.1f}" for p in QUORUM_PHASES)
                    + f"; {row['requests']:g} store requests; "
                    + ", ".join(f"{p} {row[f'{p}_ms']:.1f}" for p in EXCHANGE_PHASES)
                    + ") "
                    if row["impl"] == "gang.ft"
                    else ""
                )
                + f"({row['syncs']:g} per outer step, {row['iters']} outer steps)"
            )
        elif row["op"] == "diloco_overlap":
            delays = ", ".join(
                f"delay {d}: outer step {row[f'outer_ms_delay{d}']:.1f} ms, syncs {row[f'sync_ms_delay{d}']:.1f} ms "
                f"(waited {row[f'waited_ms_delay{d}']:.1f} ms"
                + (f", hidden {row[f'hidden_delay{d}']:.2f})" if d else ")")
                for d in OVERLAP_DELAYS
            )
            notes = f"one exchange alone {row['exchange_ms']:.1f} ms; {delays}"
        else:
            parts = [
                f"{k.removesuffix('_s')} {v:.2f} s" for k, v in row.items() if k.endswith("_s") and k != "timeout_s"
            ]
            notes = "samples " + ", ".join(f"{s:.2f}" for s in row["samples"]) + "; " + ", ".join(parts)
        lines.append(f"{row['op']:>28} {row['impl']:>8} {shown} {ratio} {paired}  {notes}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the driver, or one worker (``worker`` as the first argument)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        parser = argparse.ArgumentParser()
        parser.add_argument("mode", choices=["paired", "overlap", "recovery"])
        parser.add_argument("--impl", choices=["gang", "torchft"], default="gang")
        parser.add_argument("--impls", nargs="*", default=["gang"])
        parser.add_argument("--config", choices=sorted(CONFIGS), default="diloco")
        parser.add_argument("--replica", type=int, required=True)
        parser.add_argument("--lighthouse", default="")
        parser.add_argument("--rounds", type=int, default=6)
        parser.add_argument("--outer-steps", type=int, default=2, help="outer steps per round")
        parser.add_argument("--min-replicas", type=int, default=REPLICAS)
        parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
        parser.add_argument("--gate", default="", help="recovery: start training once this file exists")
        args = parser.parse_args(argv[1:])
        {"paired": worker_paired, "overlap": worker_overlap, "recovery": worker_recovery}[args.mode](args)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and cycles")
    parser.add_argument("--out", default="results.json", help="the rows go to <stem>_ft_diloco.json next to it")
    parser.add_argument(
        "--torchft-python",
        default=os.environ.get("TORCHFT_PYTHON") or None,
        help="interpreter of a venv with torchft 0.2 (default: $TORCHFT_PYTHON; none: gang.ft alone)",
    )
    parser.add_argument("--diloco-skip", nargs="*", default=[], choices=["paired", "overlap", "recovery"])
    parser.add_argument("--diloco-configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args, _ = parser.parse_known_args(argv)  # the other benchmarks' arguments pass through nox -s bench
    impls = ["gang", "torchft"] if args.torchft_python else ["gang"]
    if "torchft" in impls and (why := check_torchft_python(args.torchft_python)) is not None:
        print(f"# torchft left out: {why}", flush=True)
        impls.remove("torchft")
    rounds, cycles = (4, 2) if args.quick else (8, 3)
    print(f"# load before: {os.getloadavg()[0]:.1f}", flush=True)
    rows: list[Row] = []
    if "paired" not in args.diloco_skip:
        print(
            f"\n# LocalSGD / DiLoCo: time and bytes per outer step ({SYNC_EVERY} local steps), 3 replicas", flush=True
        )
        for config in args.diloco_configs:
            try:
                new = paired_rows(config, measure_paired(config, impls, args.torchft_python, rounds), rounds)
            except (RuntimeError, TimeoutError) as error:
                print(f"# {config} failed: {error}", flush=True)
                continue
            print(table(new).split("\n", 1)[1], flush=True)
            rows += new
    if "overlap" not in args.diloco_skip:
        print("\n# streaming DiLoCo: the exchange overlapped with a local step (gang.ft)", flush=True)
        try:
            rows.append(overlap_row(measure_overlap(rounds)))
            print(table(rows[-1:]).split("\n", 1)[1], flush=True)
        except (RuntimeError, TimeoutError) as error:
            print(f"# overlap failed: {error}", flush=True)
    if "recovery" not in args.diloco_skip:
        print("\n# DiLoCo: recovery from a SIGKILLed replica", flush=True)
        for impl in impls:
            try:
                rows += recovery_rows(
                    "gang.ft" if impl == "gang" else "torchft", measure_recovery(impl, args.torchft_python, cycles)
                )
            except (RuntimeError, TimeoutError) as error:
                print(f"# {impl} recovery failed: {error}", flush=True)
    print(f"# load after: {os.getloadavg()[0]:.1f}", flush=True)
    write_rows(rows, args.out, "_ft_diloco", table(rows))


if __name__ == "__main__":
    main()
