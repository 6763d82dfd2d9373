"""One layout, both frameworks: the same sharded MLP trained in torch and in JAX, side by side.

Every process holds a gloo torch gang and a JAX runtime (:meth:`gang_jax.JaxGang.create_default`
gives JAX process *r* to torch rank *r*). One :class:`~gang.Gangs` layout, fully sharded data
parallel x tensor parallel, becomes a torch ``DeviceMesh`` (:func:`gang_mesh.to_device_mesh`) and
a JAX ``Mesh`` (:func:`gang_jax.to_jax_mesh`) with the same processes in the same places. A
two-layer MLP (``relu(x @ w1.T) @ w2.T``, ``w1`` split by rows and ``w2`` by columns over ``tp``,
both sharded over the data parallel axes) trains for 5 SGD steps in each framework, from the same
initial weights on the same batches: FSDP2 and DTensor tensor parallelism in torch, ``jax.jit``
with ``NamedSharding`` in JAX. Rank 0 prints both loss curves and the largest difference between
the two frameworks' parameters, in float32 and in float64 (JAX's x64 mode).

Run with plain ``python`` it starts 4 local processes itself (``rdp`` 1 x ``sdp`` 2 x ``tp`` 2: a
size-1 axis, HSDP configured down to FSDP); under ``torchrun --nproc-per-node 8`` the layout is
``rdp`` 2 x ``sdp`` 2 x ``tp`` 2.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from gang import Gangs, ProcessGroupGang, ReduceOperation, create_fsdp_gangs, create_parallel_gangs
from gang.testing import launch
from gang_jax import JaxGang, to_jax_mesh
from gang_mesh import to_device_mesh

DIMS = ("rdp", "sdp", "tp")
"""The mesh axes: replicated data parallel, sharded data parallel, tensor parallel."""
STEPS = 5
IN, HIDDEN, OUT, BATCH = 8, 16, 4, 4  # BATCH: rows per data parallel replica and step
LR = 0.1

spec = cast(Callable[..., PartitionSpec], PartitionSpec)  # `PartitionSpec(...)`, typed (JAX's is not)


@dataclass
class Run:
    """One framework's training run: the loss of each step and the final parameters (whole)."""

    losses: list[float]
    params: dict[str, np.ndarray]


def initial_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The two weight matrices, in float64 (each framework casts them to its dtype)."""
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(0, 0.5, (HIDDEN, IN)), "w2": rng.normal(0, 0.5, (OUT, HIDDEN))}


def batches(replicas: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """The global batch (``replicas * BATCH`` rows, replica *i* owns rows ``i*BATCH`` on) of every step."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(0, 1, (OUT, IN))
    out = []
    for _ in range(STEPS):
        x = rng.normal(0, 1, (replicas * BATCH, IN))
        out.append((x, np.tanh(x @ teacher.T)))
    return out


def train_torch(gangs: Gangs, dtype: torch.dtype) -> Run:
    """FSDP2 (over ``rdp`` x ``sdp``) and DTensor tensor parallel (over ``tp``) on ``to_device_mesh``."""
    mesh = to_device_mesh(gangs, DIMS)
    weights = initial_weights()
    first = nn.Linear(IN, HIDDEN, bias=False, dtype=dtype)
    second = nn.Linear(HIDDEN, OUT, bias=False, dtype=dtype)
    with torch.no_grad():  # in the run's dtype from the start: float64 weights never pass through float32
        first.weight.copy_(torch.from_numpy(weights["w1"]))
        second.weight.copy_(torch.from_numpy(weights["w2"]))
    model = nn.Sequential(first, nn.ReLU(), second)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["rdp", "sdp"])  # gradients averaged over the data parallel replicas
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dp = gangs.dp
    replica = gangs.rdp.rank * gangs.sdp.size + gangs.sdp.rank  # the mesh's row-major (rdp, sdp) index
    losses = []
    for x, y in batches(dp.size):
        rows = slice(replica * BATCH, (replica + 1) * BATCH)
        inputs, targets = (torch.from_numpy(a[rows]).to(dtype) for a in (x, y))
        loss = ((model(inputs) - targets) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().reshape(1).clone()
        dp.all_reduce(total, ReduceOperation.MEAN)  # the loss of the global batch
        losses.append(float(total.item()))
    params = {}
    for name, key in (("0.weight", "w1"), ("2.weight", "w2")):
        param = model.get_parameter(name)
        full = param.full_tensor() if isinstance(param, DTensor) else param
        params[key] = full.detach().numpy().astype(np.float64)
    return Run(losses, params)


def train_jax(gangs: Gangs, dtype: Any) -> Run:
    """``jax.jit`` with ``NamedSharding`` on ``to_jax_mesh``: the same shardings, found by XLA."""
    mesh = to_jax_mesh(gangs, DIMS)
    dp = ("rdp", "sdp")
    shardings = {"w1": NamedSharding(mesh, spec("tp", dp)), "w2": NamedSharding(mesh, spec(None, ("tp", *dp)))}
    rows = NamedSharding(mesh, spec(dp, None))

    def put(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
        value = value.astype(dtype)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def loss_of(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        hidden = jax.nn.relu(x @ params["w1"].T)
        return jnp.mean((hidden @ params["w2"].T - y) ** 2)

    @jax.jit
    def step(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> tuple[dict[str, jax.Array], jax.Array]:
        loss, grads = jax.value_and_grad(loss_of)(params, x, y)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss

    params = {key: put(value, shardings[key]) for key, value in initial_weights().items()}
    losses = []
    for x, y in batches(gangs.dp.size):
        params, loss = step(params, put(x, rows), put(y, rows))
        losses.append(float(_whole(loss, mesh)))
    return Run(losses, {key: _whole(value, mesh).astype(np.float64) for key, value in params.items()})


def _whole(value: jax.Array, mesh: jax.sharding.Mesh) -> np.ndarray:
    """The whole of a sharded array on every process of the mesh (replicated by XLA, then read locally)."""
    replicated = jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, spec()))(value)
    whole: np.ndarray = np.asarray(replicated.addressable_data(0))
    return whole


def compare(gangs: Gangs) -> dict[str, Any]:
    """Train in both frameworks in float32 and float64; the loss curves and the largest differences."""
    report: dict[str, Any] = {"layout": {name: getattr(gangs, name).size for name in DIMS}}
    for name, torch_dtype, jax_dtype in (
        ("float32", torch.float32, np.float32),
        ("float64", torch.float64, np.float64),
    ):
        with jax.enable_x64(name == "float64"):
            jax_run = train_jax(gangs, jax_dtype)
        torch_run = train_torch(gangs, torch_dtype)
        report[name] = {
            "torch": torch_run.losses,
            "jax": jax_run.losses,
            "loss_diff": max(abs(a - b) for a, b in zip(torch_run.losses, jax_run.losses, strict=True)),
            "param_diff": max(float(np.abs(torch_run.params[k] - jax_run.params[k]).max()) for k in torch_run.params),
        }
    return report


def layout(root: ProcessGroupGang) -> Gangs:
    """``tp`` 2, ``sdp`` 2, ``rdp`` the rest (1 on 4 processes, 2 on 8)."""
    return create_fsdp_gangs(create_parallel_gangs(root, tp_size=2), 2)


def print_report(report: dict[str, Any]) -> None:
    """The two loss curves of each dtype and the largest differences."""
    sizes = " x ".join(f"{name} {size}" for name, size in report["layout"].items())
    print(f"Layout: {sizes}; a two-layer MLP, {STEPS} SGD steps, torch (FSDP2 + DTensor) and JAX (jit + NamedSharding)")
    for name in ("float32", "float64"):
        r = report[name]
        print(f"{name}:")
        print(f"  step {'torch loss':>22} {'JAX loss':>22}")
        for step, (a, b) in enumerate(zip(r["torch"], r["jax"], strict=True)):
            print(f"  {step:>4} {a:>22.15f} {b:>22.15f}")
        print(f"  largest loss difference {r['loss_diff']:.3e}, largest parameter difference {r['param_diff']:.3e}")


def _quiet() -> None:
    """Leave out what torch says about this small model: FSDP2's note on a view output, DTensor's on
    gathering a parameter sharded over two axes in two steps (the report's gathers only)."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _worker() -> tuple[int, dict[str, Any]]:
    _quiet()
    root = ProcessGroupGang.create_default_process_group(torch.device("cpu"))
    jax_root = JaxGang.create_default()  # JAX process index = torch rank
    try:
        report = compare(layout(root))
    finally:
        jax_root.close()
        root.close()
    return root.rank, report


def main() -> int:
    """Under torchrun, or on 4 local processes started here; 0 if the frameworks agree."""
    if "RANK" in os.environ:
        rank, report = _worker()
    else:
        rank, report = launch(_worker, 4)[0]
    if rank == 0:
        print_report(report)
    agree = report["float32"]["param_diff"] < 1e-5 and report["float64"]["param_diff"] < 1e-12
    return 0 if agree else 1


if __name__ == "__main__":
    if "RANK" not in os.environ:
        # The local processes unpickle `_worker` by module name: make this file importable.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        sys.exit(importlib.import_module("torch_and_jax_mlp").main())
    sys.exit(main())
