"""DiLoCo for JAX models against DiLoCo for torch modules, on the same model, in the same processes.

``python -m benchmarks.ft_diloco_jax [--quick] [--out results.json]`` starts two coordination
stores (``python -m gang.ft.store``) and 3 replicas of 1 process each (gloo on CPU, everything on
127.0.0.1). Every replica process holds both implementations, each on its own
:class:`~gang.ft.ReplicaGang` (one per store) and its own copy of the MLP of
``benchmarks.ft_diloco`` (``WIDTH`` x ``DEPTH`` linear layers, float32, the same initial weights):
:class:`gang.ft.DiLoCo` over a torch module with AdamW inside, and :class:`gang_jax.ft.DiLoCo` over
the same weights as a JAX pytree with ``optax.adamw`` inside (its step jitted); both with an outer
SGD with Nesterov momentum, syncing every ``SYNC_EVERY`` local steps. They run in interleaved
rounds (the order alternating every round), so both see the same load; a round is one outer step
of each.

Rows (op ``diloco_jax_outer_step``, impl ``gang.ft`` for torch and ``gang_jax.ft`` for JAX): the
outer step's time (the slowest replica), ``inner_ms`` (the outer step less its sync: the inner
steps, forward, backward and the inner optimizer, in each framework's own way) and ``sync_ms``
(the sync: the ``seconds`` of the ``sync`` record, the exchange of the shared core plus, for JAX,
moving the leaves in and out and the jitted outer update). ``sync_ratio`` is JAX's sync over
torch's (medians; the target is at most 1.10); ``ratio`` the same for the whole outer step, which
mostly compares the two frameworks' own inner steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import zlib
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from benchmarks.ft import ROOT, write_rows
from benchmarks.ft_diloco import DEPTH, LAUNCH_TIMEOUT_S, MICRO_BATCH, REPLICAS, SYNC_EVERY, WIDTH
from gang.bench.metrics import Row, make_row, median
from gang.ft import DiLoCo, ReplicaGang

sys.path.insert(0, str(ROOT / "examples"))
from _ft_launch import LocalJob

TIMEOUT = timedelta(seconds=30)
IMPLS = ("gang.ft", "gang_jax.ft")


class SyncSeconds(logging.Handler):
    """Collects the ``seconds`` of every ``sync`` record, by the replica gang's store address."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "gang_ft", {})
        if fields.get("event") == "sync" and fields.get("fragments"):
            self.seconds.append(float(fields["seconds"]))


def batch(replica: int, step: int) -> torch.Tensor:
    """Replica ``replica``'s batch of local step ``step``."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{replica}/{step}".encode()))
    return torch.randn(MICRO_BATCH, WIDTH, generator=generator)


def torch_model() -> nn.Sequential:
    """The MLP of ``benchmarks.ft_diloco``, from its seed."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def worker(replica: int, stores: list[str], rounds: int) -> None:
    """One replica: both implementations, interleaved rounds; print ``@result`` with the seconds."""
    import jax
    import jax.numpy as jnp
    import optax

    import gang_jax.ft

    handler = SyncSeconds()
    logger = logging.getLogger("gang.ft")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)

    def join(store: str) -> ReplicaGang:
        return ReplicaGang.join(
            replica_id=str(replica),
            store=store,
            state_dict=dict,
            load_state_dict=lambda state: None,
            min_replicas=REPLICAS,
            timeout=TIMEOUT,
            init_sync=False,
        )

    model = torch_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    params = [jnp.asarray(p.detach().numpy()) for p in model.parameters()]
    tx = optax.adamw(1e-4)
    inner_state = tx.init(params)

    def loss(ps: list[Any], x: Any) -> Any:
        h = x
        for k in range(DEPTH):
            h = h @ ps[2 * k].T + ps[2 * k + 1]
            if k < DEPTH - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - jnp.tanh(x)) ** 2)

    @jax.jit
    def inner_step(ps: list[Any], state: Any, x: Any) -> tuple[list[Any], Any]:
        grads = jax.grad(loss)(ps, x)
        updates, state = tx.update(grads, state, ps)
        return optax.apply_updates(ps, updates), state

    rg_torch, rg_jax = join(stores[0]), join(stores[1])
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    computes: dict[str, list[float]] = {name: [] for name in IMPLS}
    syncs: dict[str, list[float]] = {name: [] for name in IMPLS}
    nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)
    with (
        rg_torch,
        rg_jax,
        DiLoCo(rg_torch, model, inner, outer, sync_every=SYNC_EVERY) as torch_diloco,
        gang_jax.ft.DiLoCo(rg_jax, params, nesterov, sync_every=SYNC_EVERY) as jax_diloco,
    ):
        params = jax_diloco.params

        def torch_outer_step() -> float:
            compute = 0.0
            for _ in range(SYNC_EVERY):
                x = batch(replica, torch_diloco.local_step)
                begin = time.perf_counter()
                inner.zero_grad()
                functional.mse_loss(model(x), x.tanh()).backward()  # type: ignore[no-untyped-call]
                compute += time.perf_counter() - begin
                inner.step()  # the inner step, and the sync at the last
            return compute

        def jax_outer_step() -> float:
            nonlocal params, inner_state
            compute = 0.0
            for _ in range(SYNC_EVERY):
                x = jnp.asarray(batch(replica, jax_diloco.local_step).numpy())
                begin = time.perf_counter()
                params, inner_state = inner_step(params, inner_state, x)
                jax.block_until_ready(params)  # type: ignore[no-untyped-call]
                compute += time.perf_counter() - begin
                params = jax_diloco.step(params)
            return compute

        steps = {"gang.ft": torch_outer_step, "gang_jax.ft": jax_outer_step}
        for name in IMPLS:  # a warm-up outer step each (compilation, buffers)
            steps[name]()
        for r in range(rounds):
            for name in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                before = len(handler.seconds)
                start = time.perf_counter()
                computes[name].append(steps[name]())
                times[name].append(time.perf_counter() - start)
                syncs[name].append(sum(handler.seconds[before:]))
    result = {
        "times": times,
        "computes": computes,
        "syncs": syncs,
        "payload_bytes": 4 * int(sum(np.size(p) for p in params)),
    }
    print("@result " + json.dumps(result), flush=True)


def measure(rounds: int) -> list[dict[str, Any]]:
    """Run the stores and the 3 replicas; return each replica's result."""
    with LocalJob(echo=False) as job:
        stores = [job.start_store(timeout=LAUNCH_TIMEOUT_S)]
        job.start("store b", ["-m", "gang.ft.store", "--host", "127.0.0.1", "--port", "0"])
        line = job.expect(
            lambda line: line.name == "store b" and line.text.startswith("GANG_FT_STORE="), LAUNCH_TIMEOUT_S
        )
        stores.append(line.text.removeprefix("GANG_FT_STORE="))
        for replica in range(REPLICAS):
            args = ["-m", "benchmarks.ft_diloco_jax", "worker", str(replica), "--rounds", str(rounds), *stores]
            job.start(f"replica {replica}", args, {"OMP_NUM_THREADS": "1"})
        found: dict[str, dict[str, Any]] = {}
        while len(found) < REPLICAS:
            line = job.expect(lambda line: line.text.startswith("@result "), LAUNCH_TIMEOUT_S)
            found[line.name] = json.loads(line.text.removeprefix("@result "))
        return [found[f"replica {r}"] for r in range(REPLICAS)]


def rows_of(results: list[dict[str, Any]]) -> list[Row]:
    """The slowest replica of each round, per implementation; JAX's ratios to torch's."""
    count = len(results[0]["times"][IMPLS[0]])

    def slowest(key: str, name: str) -> list[float]:
        if key == "inner":  # the outer step less its sync: the inner steps, each framework's own
            return [max(r["times"][name][i] - r["syncs"][name][i] for r in results) for i in range(count)]
        return [max(r[key][name][i] for r in results) for i in range(count)]

    rows: list[Row] = []
    for name in IMPLS:
        extra: dict[str, Any] = {
            "inner_ms": round(1e3 * median(slowest("inner", name)), 2),
            "sync_ms": round(1e3 * median(slowest("syncs", name)), 2),
            "payload_bytes": results[0]["payload_bytes"],
            "iters": count,
        }
        if name == "gang_jax.ft":
            ours, theirs = "gang_jax.ft", "gang.ft"
            extra["sync_ratio"] = median(slowest("syncs", ours)) / median(slowest("syncs", theirs))
            extra["ratio"] = median(slowest("times", ours)) / median(slowest("times", theirs))
        rows.append(make_row(name, "diloco_jax_outer_step", 0, REPLICAS, median(slowest("times", name)), **extra))
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a table."""
    lines = [f"{'impl':<12} {'outer step ms':>14} {'inner ms':>11} {'sync ms':>8} {'sync ratio':>10} {'ratio':>6}"]
    for row in rows:
        sync_ratio = f"{row['sync_ratio']:.3f}" if "sync_ratio" in row else "-"
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "-"
        lines.append(
            f"{row['impl']:<12} {row['time_us'] / 1e3:>14.1f} {row['inner_ms']:>11.1f} {row['sync_ms']:>8.1f} "
            f"{sync_ratio:>10} {ratio:>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the driver, or one replica (``worker`` as the first argument)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        parser = argparse.ArgumentParser()
        parser.add_argument("replica", type=int)
        parser.add_argument("--rounds", type=int, default=6)
        parser.add_argument("stores", nargs=2)
        args = parser.parse_args(argv[1:])
        worker(args.replica, args.stores, args.rounds)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--out", default="results.json", help="the rows go to <stem>_ft_diloco_jax.json next to it")
    args, _ = parser.parse_known_args(argv)  # the other benchmarks' arguments pass through nox -s bench
    print(f"# load before: {os.getloadavg()[0]:.1f}", flush=True)
    rows = rows_of(measure(4 if args.quick else 10))
    print(f"# load after: {os.getloadavg()[0]:.1f}", flush=True)
    write_rows(rows, args.out, "_ft_diloco_jax", table(rows))


if __name__ == "__main__":
    main()
