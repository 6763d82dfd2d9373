"""The replicas of the DiLoCo tests: one process each (``one``; ``localsgd`` runs ``gang.ft.LocalSGD``
instead) or a torchrun of 2 sharding with FSDP2 (``fsdp``); ``jax`` and ``jaxlocalsgd`` train the same
model as a JAX pytree with ``gang_jax.ft.DiLoCo`` and ``gang_jax.ft.LocalSGD`` (float64, x64 on);
``jaxfsdp`` is a torchrun of 2 JAX processes that average their gradients through the replica's
``gang_jax.JaxGang`` and each hand only their own shard (chunk ``process`` of dim 0 of every leaf)
to their own ``gang_jax.ft.DiLoCo``, rebuilding the full parameters by an all-gather after it.
``FT_MODE`` overrides the mode of one replica (torch and JAX replicas in one job), ``FT_OUTER=sgd``
makes the outer optimizer plain SGD (no momentum) instead of SGD with Nesterov momentum.

Run as ``python diloco_workers.py MODE LOG STEPS`` with ``GANG_FT_REPLICA_ID``/``GANG_FT_STORE``
set. Each process builds the float64 model of :func:`build_model` (replica ``0`` from seed 1234,
the others from their own seeds: the gang's ``init_sync`` makes them agree), trains it with plain
SGD inside ``gang.ft.DiLoCo`` (outer SGD with Nesterov momentum) until ``STEPS`` local steps, on
batch :func:`gang_batch` of (replica, replica rank, local step), and logs JSON lines as
``ft_workers.py`` does: ``joined``, ``paused``, ``healed``, ``error``, ``done``, and ``sync`` for every
committed sync with the fields of the ``gang.ft`` ``sync`` record and this process's ``global``
parameters, ``local`` parameters and outer ``momentum`` after it (flat; local shards under FSDP2).

Pauses (``FT_PAUSE``): ``enter:1`` before entering DiLoCo (``FT_GATE=1``), ``step:<t>`` before
local step ``t``, ``exchange:<t>`` inside the sync that follows local step ``t``, as its
all-to-all (the exchange's first collective) starts (through ``gang.ft.replica``'s test-only
fault seam). ``FT_FRAGMENTS``, ``FT_DELAY``,
``FT_ALPHA``, ``FT_SYNC_EVERY`` and ``FT_QUANTIZE`` (``int8`` or ``float8``; unset: full precision)
configure DiLoCo (``FT_SYNC_EVERY`` and ``FT_QUANTIZE`` also LocalSGD); ``FT_TIMEOUT``, ``FT_QUORUM_TIMEOUT``,
``FT_HEARTBEAT_TIMEOUT`` and ``FT_MIN_REPLICAS`` the gang. ``FT_HIDDEN`` sets the model's hidden width
(default 16; a wide one makes an exchange megabytes): its parameters are then logged as the
SHA-256 of their float64 bytes (:func:`flat`), which the test compares with the replay's.

:func:`replay` is DiLoCo from its definition in plain torch, in one process: it needs only the
committed syncs (their local step, fragments, quorum, heals and averaged members).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import zlib
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ft_workers import Replica
from torch import Tensor, nn

import gang.ft.replica as replica_module
from gang import GangError, create_default_gang, create_fsdp_gangs, create_parallel_gangs, get_rank
from gang.ft import DiLoCo, LocalSGD, ReplicaGang
from gang.ft.quantize import reference_mean

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 16
INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.9
FSDP_PROCS = 2


def build_model(rid: str) -> nn.Sequential:
    """Replica ``rid``'s starting model (float64): replica ``"0"``'s is the one every replica adopts
    (with ``FT_SAME_START=1``, every replica starts from it and joins with ``init_sync=False``)."""
    same = os.environ.get("FT_SAME_START") == "1"
    torch.manual_seed(1234 if rid == "0" or same else zlib.crc32(rid.encode()))
    hidden = int(os.environ.get("FT_HIDDEN") or HIDDEN)
    return nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, OUT)).double()


def inner(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=INNER_LR)


def nesterov() -> bool:
    """Whether the outer optimizer has Nesterov momentum (``FT_OUTER`` is not ``sgd``)."""
    return os.environ.get("FT_OUTER", "nesterov") != "sgd"


def outer(params: Any) -> torch.optim.Optimizer:
    if not nesterov():
        return torch.optim.SGD(params, lr=OUTER_LR)
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)


def jax_outer() -> Any:
    """The outer optimizer of a JAX replica: the same as :func:`outer`, in ``optax``."""
    import optax

    if not nesterov():
        return optax.sgd(OUTER_LR)
    return optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)


_JAX_STEP: Any = None


def _jax_loss(ps: list[Any], x: Any, y: Any) -> Any:
    """The mean squared error of the JAX model (``build_model``'s parameters as a list)."""
    import jax.numpy as jnp

    w1, b1, w2, b2 = ps
    return jnp.mean((jnp.tanh(x @ w1.T + b1) @ w2.T + b2 - y) ** 2)


def jax_inner_step(params: list[Any], rid: str, process: int, t: int) -> list[Any]:
    """One plain SGD step of the JAX model (``build_model``'s parameters as a list, in its order) on
    the batch of (``rid``, ``process``, ``t``): the JAX replicas' inner step, and the replay's for them."""
    global _JAX_STEP
    import jax
    import jax.numpy as jnp

    if _JAX_STEP is None:

        def step(ps: list[Any], x: Any, y: Any) -> list[Any]:
            return [p - INNER_LR * g for p, g in zip(ps, jax.grad(_jax_loss)(ps, x, y), strict=True)]

        _JAX_STEP = jax.jit(step)
    x, y = gang_batch(rid, process, t)
    result: list[Any] = _JAX_STEP(params, jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    return result


_JAX_GRAD: Any = None
_JAX_SGD: Any = None


def jax_grads(params: list[Any], rid: str, process: int, t: int) -> list[Any]:
    """The gradients of the JAX model's loss on the batch of (``rid``, ``process``, ``t``), jitted:
    what each process of a ``jaxfsdp`` replica contributes to its replica's inner step."""
    global _JAX_GRAD
    import jax
    import jax.numpy as jnp

    if _JAX_GRAD is None:
        _JAX_GRAD = jax.jit(jax.grad(_jax_loss))
    x, y = gang_batch(rid, process, t)
    result: list[Any] = _JAX_GRAD(params, jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    return result


def jax_sgd(params: list[Any], summed: list[Any], procs: int) -> list[Any]:
    """One plain SGD step (jitted) with the mean gradient ``summed / procs`` (``summed``: the sum of
    the ``procs`` processes' :func:`jax_grads`, which rounds alike in any order for 2 processes)."""
    global _JAX_SGD
    import jax

    if _JAX_SGD is None:

        def step(ps: list[Any], gs: list[Any], n: int) -> list[Any]:
            return [p - INNER_LR * (g / n) for p, g in zip(ps, gs, strict=True)]

        _JAX_SGD = jax.jit(step, static_argnums=2)
    result: list[Any] = _JAX_SGD(params, summed, procs)
    return result


def jax_mode(mode: str) -> bool:
    return mode.startswith("jax")


def procs_of(mode: str) -> int:
    """The number of processes of a replica in ``mode``."""
    return FSDP_PROCS if mode in ("fsdp", "jaxfsdp") else 1


def gang_batch(rid: str, process: int, t: int) -> tuple[Tensor, Tensor]:
    """The batch of process ``process`` of replica ``rid`` at local step ``t``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{process}/{t}".encode()))
    return torch.randn(BATCH, IN, generator=g, dtype=torch.float64), torch.randn(
        BATCH, OUT, generator=g, dtype=torch.float64
    )


def loss_of(model: nn.Module, rid: str, process: int, t: int) -> Tensor:
    x, y = gang_batch(rid, process, t)
    loss: Tensor = ((model(x) - y) ** 2).mean()
    return loss


def flat(tensors: list[Tensor]) -> list[float] | str:
    """The values of ``tensors`` in order, or with ``FT_HIDDEN`` set the SHA-256 of their float64 bytes."""
    joined = torch.cat([t.detach().reshape(-1) for t in tensors])
    if os.environ.get("FT_HIDDEN"):
        return digest(joined)
    values: list[float] = joined.tolist()
    return values


def digest(values: Tensor) -> str:
    """The SHA-256 of ``values`` as float64 bytes (equal digests: bit-identical values)."""
    return hashlib.sha256(values.to(torch.float64).contiguous().numpy().tobytes()).hexdigest()


def quantized_mean(rows: dict[str, list[Tensor]], averaged: list[str], procs: int, quantize: str) -> list[Tensor]:
    """The quantized exchange's average of the tensors ``rows[rid]`` (one per synced parameter, in
    registration order) over the members ``averaged``, from :func:`gang.ft.quantize.reference_mean`:
    each of the ``procs`` processes of a replica exchanges the flat concatenation of its own shards
    (FSDP2 shards dim 0 in ``procs`` chunks) with the process of equal replica rank."""
    first = rows[averaged[0]]
    out = [torch.empty_like(t) for t in first]
    for k in range(procs):
        flat_rows = [torch.cat([t.chunk(procs)[k].reshape(-1) for t in rows[rid]]) for rid in averaged]
        mean = reference_mean(flat_rows, quantize).to(first[0].dtype)
        at = 0
        for t in out:
            shard = t.chunk(procs)[k]
            shard.copy_(mean[at : at + shard.numel()].view(shard.shape))
            at += shard.numel()
    return out


def replay(
    syncs: list[dict[str, Any]],
    *,
    procs: int,
    delay: int,
    alpha: float,
    local_sgd: bool = False,
    jax_replicas: bool = False,
    quantize: str | None = None,
) -> list[dict[str, Any]]:
    """:func:`_replay`, with JAX in 64-bit mode for ``jax_replicas`` (as the JAX replicas run)."""
    kwargs: dict[str, Any] = {"procs": procs, "delay": delay, "alpha": alpha, "local_sgd": local_sgd}
    if not jax_replicas:
        return _replay(syncs, **kwargs, jax_replicas=False, quantize=quantize)
    import jax

    with jax.enable_x64(True):
        return _replay(syncs, **kwargs, jax_replicas=True, quantize=quantize)


def _replay(
    syncs: list[dict[str, Any]],
    *,
    procs: int,
    delay: int,
    alpha: float,
    local_sgd: bool,
    jax_replicas: bool,
    quantize: str | None,
) -> list[dict[str, Any]]:
    """DiLoCo from its definition, in one process and plain torch (it reads of each sync only its
    local step, fragments, quorum and heals).

    Every replica id trains at every local step (those that are not in a quorum are never read),
    each on its own batches; a replica's step averages the gradients of its ``procs`` processes
    (as FSDP2's reduce-scatter does). At each committed sync after local step ``t`` (in step
    order): the healed members copy their healer's local parameters; the pseudo-gradients
    ``global - local`` of the other members are summed in quorum order and divided by their
    number; the outer optimizer (its own SGD over its own copy of the global parameters) steps with
    these as gradients of the fragments' parameters (the others have none); every member's
    fragment becomes ``alpha * local + (1 - alpha) * global`` after local step ``t + delay``.
    Returns, per sync, the full ``global`` parameters after it and every replica's ``local``
    parameters once it was applied. With ``local_sgd``, a sync instead sets every member's
    parameters of the fragments to the mean of the other members' (summed in quorum order), and
    there are no global parameters. With ``jax_replicas``, every replica's inner step is
    :func:`jax_inner_step` (with ``procs > 1``: :func:`jax_grads` of every process, summed in
    process order, then :func:`jax_sgd`, as ``jaxfsdp`` replicas run it) and the outer optimizer
    :func:`jax_outer`, one ``optax`` state per fragment, its update jitted (as ``gang_jax.ft``
    runs them; the sync is elementwise, so a shard of it is the sync of the shard). With
    ``quantize``, each mean is :func:`quantized_mean`'s.
    """
    start = [p.detach().clone() for p in build_model("0").parameters()]
    glob = [p.clone().requires_grad_(True) for p in start]
    outer_opt = outer(glob)
    models: dict[str, nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    history: list[dict[str, Any]] = []
    jax_states: dict[int, Any] = {}  # with `jax_replicas`: each fragment's optax state
    waiting: list[tuple[int, list[str], list[int], int]] = []  # (sync, members, parameters, apply after step)
    done = 0

    def model(rid: str) -> nn.Module:
        if rid not in models:
            models[rid] = build_model(rid)
            opts[rid] = inner(models[rid].parameters())
        return models[rid]

    def params(rid: str) -> list[Tensor]:
        return list(model(rid).parameters())

    def apply_due(t: int) -> None:
        for entry in [e for e in waiting if e[3] <= t]:
            waiting.remove(entry)
            index, members, indices, _ = entry
            with torch.no_grad():
                for rid in members:
                    for i in indices:
                        p = params(rid)[i]
                        if alpha == 0.0:
                            p.copy_(glob[i])
                        else:
                            p.mul_(alpha).add_(glob[i], alpha=1.0 - alpha)
            history[index]["local"] = {r: [p.detach().clone() for p in params(r)] for r in models}

    def advance(to: int) -> None:
        nonlocal done
        for t in range(done, to):
            for rid, m in models.items():
                if jax_replicas:
                    import jax.numpy as jnp

                    now = [jnp.asarray(p.detach().numpy()) for p in m.parameters()]
                    if procs == 1:
                        new = jax_inner_step(now, rid, 0, t)
                    else:  # as a `jaxfsdp` replica: its processes' gradients summed, then the step
                        grads_of = [[np.array(g) for g in jax_grads(now, rid, k, t)] for k in range(procs)]
                        summed = [sum(column[1:], column[0]) for column in zip(*grads_of, strict=True)]
                        new = jax_sgd(now, [jnp.asarray(g) for g in summed], procs)
                    with torch.no_grad():
                        for p, value in zip(m.parameters(), new, strict=True):
                            p.copy_(torch.from_numpy(np.array(value)))
                    continue
                grads = []
                for k in range(procs):
                    m.zero_grad()
                    loss_of(m, rid, k, t).backward()  # type: ignore[no-untyped-call]
                    grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
                for p, gs in zip(m.parameters(), zip(*grads, strict=True), strict=True):
                    p.grad = sum(gs[1:], gs[0].clone()).div_(procs)
                opts[rid].step()
            apply_due(t)
        done = max(done, to)

    for index, sync in enumerate(syncs):
        for rid in sync["quorum"]:
            model(rid)
        advance(sync["local_steps"])
        for member, source in sync["healed"].items():
            with torch.no_grad():
                for mine, theirs in zip(params(member), params(source), strict=True):
                    mine.copy_(theirs)
        indices = [i for k in sync["fragments"] for i in sync["fragment_params"][k]]
        if local_sgd:
            averaged = [m for m in sync["quorum"] if m not in sync["healed"]]
            with torch.no_grad():
                if quantize is not None and indices:
                    values = {rid: [params(rid)[i].detach() for i in indices] for rid in averaged}
                    for i, mean in zip(indices, quantized_mean(values, averaged, procs, quantize), strict=True):
                        for rid in sync["quorum"]:
                            params(rid)[i].copy_(mean)
                    indices = []
                for i in indices:
                    total = params(averaged[0])[i].detach().clone()
                    for rid in averaged[1:]:
                        total.add_(params(rid)[i])
                    total.div_(len(averaged))
                    for rid in sync["quorum"]:
                        params(rid)[i].copy_(total)
            history.append({"global": []})
            waiting.append((index, [], [], done - 1))
            apply_due(done - 1)
            continue
        means: dict[int, Tensor] = {}
        averaged = [m for m in sync["quorum"] if m not in sync["healed"]]
        if indices and quantize is not None:  # one exchange row holds every due fragment
            pseudo = {rid: [glob[i].detach() - params(rid)[i].detach() for i in indices] for rid in averaged}
            means = dict(zip(indices, quantized_mean(pseudo, averaged, procs, quantize), strict=True))
        if indices and jax_replicas:
            for k in sync["fragments"]:
                _jax_outer_step(glob, sync["fragment_params"][k], averaged, params, k, jax_states, means)
        elif indices:
            for i, g in enumerate(glob):
                g.grad = None
                if i in means:
                    g.grad = means[i]
                elif i in indices:
                    rows = [g.detach() - params(rid)[i].detach() for rid in averaged]
                    total = rows[0].clone()
                    for row in rows[1:]:
                        total.add_(row)
                    g.grad = total.div_(len(rows))
            outer_opt.step()
        history.append({"global": [g.detach().clone() for g in glob]})
        later = delay if indices else 0  # a sync without fragments (entering) has nothing to apply
        waiting.append((index, list(sync["quorum"]), indices, sync["local_steps"] - 1 + later))
        apply_due(done - 1)
    advance(done + delay)
    return history


_JAX_APPLY: Any = None


def _jax_outer_step(
    glob: list[Tensor],
    indices: list[int],
    averaged: list[str],
    params: Any,
    k: int,
    states: dict[int, Any],
    means: dict[int, Tensor],
) -> None:
    """Fragment ``k``'s outer step with :func:`jax_outer`: the pseudo-gradients of ``averaged``
    summed in quorum order and divided (or ``means``' where given: the quantized exchange's), then
    the jitted optax update added to ``glob``'s leaves."""
    global _JAX_APPLY
    import jax
    import jax.numpy as jnp

    tx = jax_outer()
    if _JAX_APPLY is None:

        def apply(grads: Any, state: Any, values: Any) -> tuple[Any, Any]:
            updates, state = tx.update(grads, state, values)
            return jax.tree.map(lambda p, u: p + u, values, updates), state

        _JAX_APPLY = jax.jit(apply)
    values = [jnp.asarray(glob[i].detach().numpy()) for i in indices]
    grads = []
    for i in indices:
        if i in means:
            grads.append(jnp.asarray(means[i].numpy()))
            continue
        rows = [glob[i].detach() - params(rid)[i].detach() for rid in averaged]
        total = rows[0].clone()
        for row in rows[1:]:
            total.add_(row)
        grads.append(jnp.asarray(total.div_(len(rows)).numpy()))
    if k not in states:
        states[k] = tx.init(values)
    new, states[k] = _JAX_APPLY(grads, states[k], values)
    with torch.no_grad():
        for i, value in zip(indices, new, strict=True):
            glob[i].copy_(torch.from_numpy(np.array(value)))


class Worker(Replica):
    """One process of a replica: the model, the inner optimizer, the heal callbacks and the log."""

    def __init__(self, mode: str, log: Path, process: int, rid: str) -> None:
        super().__init__(log, process, procs_of(mode), rid)
        self.process = process
        self.procs = procs_of(mode)
        self.model = build_model(rid)
        if mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            from gang_mesh import fsdp_mesh

            mesh = fsdp_mesh(create_fsdp_gangs(create_parallel_gangs(create_default_gang(torch.device("cpu")))))
            for layer in self.model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.inner = inner(self.model.parameters())
        self.diloco: Any = None  # a torch or a JAX DiLoCo / LocalSGD
        self.jax = jax_mode(mode)
        if self.jax:
            import jax
            import jax.numpy as jnp

            jax.config.update("jax_enable_x64", True)  # type: ignore[no-untyped-call]
            self.jax_gang: Any = None  # `jaxfsdp`: the JaxGang of this replica's processes (before any JAX call)
            if mode == "jaxfsdp":
                from gang_jax import JaxGang

                # The preemption service catches SIGTERM: torchrun's SIGTERM to the peers of a
                # killed process would leave them alive (a duplicate of the restarted replica's
                # rank) until its SIGKILL, 30 s later.
                jax.config.update("jax_enable_preemption_service", False)  # type: ignore[no-untyped-call]
                self.jax_gang = JaxGang.create_default()
            self.jax_params: list[Any] = [jnp.asarray(p.detach().numpy()) for p in self.model.parameters()]

    def shard(self, full: list[Any]) -> list[Any]:
        """This process's shard of every leaf of ``full`` (chunk ``process`` of dim 0 of ``procs``)."""
        rows = [p.shape[0] // self.procs for p in full]  # FSDP_PROCS divides every leaf's dim 0
        return [p[n * self.process : n * (self.process + 1)] for p, n in zip(full, rows, strict=True)]

    def gather(self, shards: list[Any]) -> list[Any]:
        """The full leaves from this process's ``shards`` and its peers' (all-gather in the replica)."""
        from gang_jax.functional import all_gather

        return [all_gather(self.jax_gang, s).reshape(-1, *s.shape[1:]) for s in shards]

    def jax_step(self, rid: str, t: int) -> None:
        """One inner step of the JAX model (the gradients averaged over the replica's processes under
        ``jaxfsdp``) and ``diloco.step`` after it (with this process's shard under ``jaxfsdp``)."""
        if self.jax_gang is None:
            self.jax_params = self.diloco.step(jax_inner_step(self.jax_params, rid, self.process, t))
            return
        from gang import ReduceOperation
        from gang_jax.functional import all_reduce

        grads = jax_grads(self.jax_params, rid, self.process, t)
        summed = [all_reduce(self.jax_gang, g, ReduceOperation.SUM) for g in grads]
        full = jax_sgd(self.jax_params, summed, self.procs)
        self.jax_params = self.gather(self.diloco.step(self.shard(full)))

    def local(self) -> list[Tensor]:
        if self.jax:  # what the JAX DiLoCo holds (a sync is logged before `step` returns it)
            if self.diloco is not None:
                held = self.diloco.params
            else:
                held = self.jax_params if self.jax_gang is None else self.shard(self.jax_params)
            return [torch.from_numpy(np.array(p)) for p in held]
        return [getattr(p, "_local_tensor", p).detach() for p in self.model.parameters()]

    def state_dict(self) -> Mapping[str, Any]:
        return {"local": self.local()}  # plain SGD has no state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.local(), state["local"], strict=True):
                if mine is not theirs:
                    mine.copy_(theirs)
        self.emit("healed")


class LogSyncs(logging.Handler):
    """Logs every ``sync`` record of the ``gang.ft`` logger with this process's parameters after it,
    and the fields of every other record as ``ft_log``."""

    def __init__(self, worker: Worker) -> None:
        super().__init__()
        self.worker = worker

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(getattr(record, "gang_ft", {}))
        if fields.get("event") != "sync":
            self.worker.emit("ft_log", ft=fields)
            return
        diloco = self.worker.diloco
        assert diloco is not None
        state = diloco.state_dict()
        if self.worker.jax:  # each fragment's optax state, as tensors
            momentum = [t for leaves in state.get("outer", []) for t in leaves if t.is_floating_point()]
        else:
            outer_state = state["outer"]["state"].values() if "outer" in state else []
            momentum = [s["momentum_buffer"] for s in outer_state if "momentum_buffer" in s]
        fields.pop("event")
        self.worker.emit(
            "sync",
            **fields,
            fragment_params=diloco.fragments,
            **{"global": flat(state["global"]) if "global" in state else []},
            local=flat(self.worker.local()),
            momentum=flat(momentum) if momentum else [],
        )


def main() -> None:
    mode, log, steps = os.environ.get("FT_MODE") or sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    process = get_rank() if procs_of(mode) > 1 else 0
    if procs_of(mode) > 1:
        log = Path(f"{log}.rr{process}")
    rid = os.environ["GANG_FT_REPLICA_ID"]
    worker = Worker(mode, log, process, rid)
    ft_logger = logging.getLogger("gang.ft")
    ft_logger.setLevel(logging.INFO)
    ft_logger.addHandler(LogSyncs(worker))

    def seconds(name: str, default: str) -> timedelta:
        return timedelta(seconds=float(os.environ.get(name, default)))

    def pause_in_exchange(gang: ReplicaGang, operation: str) -> RuntimeError | None:
        if operation == "all_to_all" and worker.diloco is not None:
            worker.maybe_pause("exchange", worker.diloco.local_step - 1)
        return None

    replica_module._fault_hook = pause_in_exchange
    try:
        rg = ReplicaGang.join(
            state_dict=worker.state_dict,
            load_state_dict=worker.load_state_dict,
            timeout=seconds("FT_TIMEOUT", "30"),
            quorum_timeout=seconds("FT_QUORUM_TIMEOUT", "30"),
            heartbeat_timeout=seconds("FT_HEARTBEAT_TIMEOUT", "3"),
            min_replicas=int(os.environ.get("FT_MIN_REPLICAS", "1")),
            init_sync=os.environ.get("FT_SAME_START") != "1",
        )
    except GangError as ex:
        worker.emit("error", error=str(ex))
        os._exit(3)
    worker.gang = rg
    worker.emit("joined", step=rg.step_number)
    if os.environ.get("FT_GATE") == "1":
        worker.pauses.add(("enter", 1))  # every process waits to enter until the harness lets it
        worker.maybe_pause("enter", 1)
    sync_every = int(os.environ.get("FT_SYNC_EVERY", "4"))
    quantize = os.environ.get("FT_QUANTIZE") or None
    diloco: Any  # a torch or a JAX DiLoCo / LocalSGD
    if jax_mode(mode):
        import gang_jax.ft

        mine = worker.jax_params if worker.jax_gang is None else worker.shard(worker.jax_params)
        if mode == "jaxlocalsgd":
            diloco = gang_jax.ft.LocalSGD(rg, mine, sync_every=sync_every, quantize=quantize)
        else:
            diloco = gang_jax.ft.DiLoCo(
                rg,
                mine,
                jax_outer(),
                sync_every=sync_every,
                fragments=int(os.environ.get("FT_FRAGMENTS", "1")),
                fragment_sync_delay=int(os.environ.get("FT_DELAY", "0")),
                fragment_update_alpha=float(os.environ.get("FT_ALPHA", "0")),
                quantize=quantize,
            )
    elif mode == "localsgd":
        diloco = LocalSGD(rg, worker.model, worker.inner, sync_every=sync_every, quantize=quantize)
    else:
        diloco = DiLoCo(
            rg,
            worker.model,
            worker.inner,
            outer(worker.model.parameters()),
            sync_every=sync_every,
            fragments=int(os.environ.get("FT_FRAGMENTS", "1")),
            fragment_sync_delay=int(os.environ.get("FT_DELAY", "0")),
            fragment_update_alpha=float(os.environ.get("FT_ALPHA", "0")),
            quantize=quantize,
        )
    worker.diloco = diloco
    try:
        with diloco:
            if worker.jax:  # the replicas agreed on them on entering
                agreed = diloco.params
                worker.jax_params = agreed if worker.jax_gang is None else worker.gather(agreed)
            while diloco.local_step < steps:
                t = diloco.local_step
                worker.maybe_pause("step", t)
                if worker.jax:
                    worker.jax_step(rid, t)
                    continue
                worker.inner.zero_grad()
                loss_of(worker.model, rid, process, t).backward()  # type: ignore[no-untyped-call]
                worker.inner.step()
    except GangError as ex:
        worker.emit("error", error=str(ex))
        sys.stdout.flush()
        os._exit(3)
    rg.close()
    if worker.jax and worker.jax_gang is not None:
        worker.jax_gang.close()  # both processes leave jax.distributed together
    worker.emit("done", step=rg.step_number, local_steps=diloco.local_step)
    os._exit(0)


if __name__ == "__main__":
    main()
