"""One model, both frameworks, one job: DiLoCo with 2 torch replicas and 1 JAX replica.

The fault-tolerance model is the framework's choice, not the job's. Replicas ``0`` and ``1``
train the MLP as a torch module inside :class:`gang.ft.DiLoCo`; replica ``2`` trains the same MLP
as a JAX pytree inside :class:`gang_jax.ft.DiLoCo`. All three start from the same weights (float64),
read their own batches, take plain SGD steps inside and sync every 4 local steps (2 fragments)
through one :class:`gang.ft.ReplicaGang`, with an outer plain SGD (torch's update and the jitted
``optax.sgd`` round alike, so the global parameters stay bit-identical across the frameworks).

Run as is (``python examples/diloco_torch_and_jax.py``): it starts the coordination store and the
3 replicas on this machine, and checks that every replica finished with bit-identical global
parameters (a hash of their bytes). As a replica (``GANG_FT_STORE``, ``GANG_FT_REPLICA_ID`` and
``--framework`` set) it trains.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gang.ft import DiLoCo, ReplicaGang

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ft_launch import LocalJob

STEPS, SYNC_EVERY, FRAGMENTS = 24, 4, 2
INNER_LR, OUTER_LR = 0.05, 0.7
TIMEOUT = timedelta(seconds=60)


def start_weights() -> list[Tensor]:
    """The weights every replica starts from: ``8 -> 16 -> 4`` with a tanh, float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    return [p.detach().clone() for p in model.parameters()]


def batch(replica_id: str, step: int) -> tuple[Tensor, Tensor]:
    """Replica ``replica_id``'s own batch of local step ``step``."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{replica_id}/{step}".encode()))
    x = torch.randn(16, 8, generator=generator, dtype=torch.float64)
    return x, torch.randn(16, 4, generator=generator, dtype=torch.float64)


def fingerprint(arrays: list[Any]) -> str:
    """A short hash of the arrays' bytes: equal on two replicas only if they are bit-identical."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.asarray(array).tobytes())
    return digest.hexdigest()[:16]


def train_torch(rg: ReplicaGang, replica_id: str) -> list[Any]:
    """Train the torch module inside :class:`gang.ft.DiLoCo`; return the final global parameters."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    with torch.no_grad():
        for p, w in zip(model.parameters(), start_weights(), strict=True):
            p.copy_(w)
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR)
    with DiLoCo(rg, model, inner, outer, sync_every=SYNC_EVERY, fragments=FRAGMENTS) as diloco:
        while diloco.local_step < STEPS:
            x, y = batch(replica_id, diloco.local_step)
            inner.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            inner.step()  # counts one local step; runs a sync when one is due
        return [g.numpy() for g in diloco.state_dict()["global"]]


def train_jax(rg: ReplicaGang, replica_id: str) -> list[Any]:
    """Train the JAX pytree inside :class:`gang_jax.ft.DiLoCo`; return the final global parameters."""
    import jax
    import jax.numpy as jnp
    import optax

    import gang_jax.ft

    jax.config.update("jax_enable_x64", True)  # type: ignore[no-untyped-call]

    def loss(params: list[Any], x: Any, y: Any) -> Any:
        w1, b1, w2, b2 = params
        return jnp.mean((jnp.tanh(x @ w1.T + b1) @ w2.T + b2 - y) ** 2)

    @jax.jit
    def inner_step(params: list[Any], x: Any, y: Any) -> list[Any]:
        return [p - INNER_LR * g for p, g in zip(params, jax.grad(loss)(params, x, y), strict=True)]

    params = [jnp.asarray(w.numpy()) for w in start_weights()]
    with gang_jax.ft.DiLoCo(rg, params, optax.sgd(OUTER_LR), sync_every=SYNC_EVERY, fragments=FRAGMENTS) as diloco:
        params = diloco.params
        while diloco.local_step < STEPS:
            x, y = batch(replica_id, diloco.local_step)
            params = diloco.step(inner_step(params, jnp.asarray(x.numpy()), jnp.asarray(y.numpy())))
        return [g.numpy() for g in diloco.state_dict()["global"]]


def run_local_job() -> None:
    """Start the store and the 3 replicas; check that they end with the same global parameters."""
    with LocalJob() as job:
        store = job.start_store()
        names = []
        for replica, framework in enumerate(("torch", "torch", "jax")):
            names.append(f"replica {replica} ({framework})")
            env = {"GANG_FT_STORE": store, "GANG_FT_REPLICA_ID": str(replica)}
            job.start(names[-1], [__file__, "--framework", framework], env)
        final = job.expect_same_ending("final sync", names)
    print(f"=== torch and JAX replicas finished with the same global parameters: {final}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--framework", choices=("torch", "jax"), default="torch")
    args = parser.parse_args()
    if "GANG_FT_STORE" not in os.environ:
        run_local_job()
        return
    replica_id = os.environ["GANG_FT_REPLICA_ID"]
    # Every replica starts from the same weights: no `init_sync` needed (and a JAX replica heals
    # from JAX replicas only).
    rg = ReplicaGang.join(
        state_dict=dict, load_state_dict=lambda state: None, min_replicas=3, timeout=TIMEOUT, init_sync=False
    )
    with rg:
        final = (train_jax if args.framework == "jax" else train_torch)(rg, replica_id)
    print(f"final sync {rg.step_number} global parameters {fingerprint(final)}")


if __name__ == "__main__":
    main()
