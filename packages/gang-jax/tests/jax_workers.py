"""Functions the gang-jax unit tests run on every rank of a :class:`gang.testing.World` (no torch gang)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import torch

from gang import GangError, InvalidOperationError, NotSupportedError, ReduceOperation
from gang.address import non_loopback_sockets
from gang_jax import JaxGang, functional

_GANG: JaxGang | None = None


def gang() -> JaxGang:
    """Return this process's root gang, created once per process."""
    global _GANG
    if _GANG is None:
        _GANG = JaxGang.create_default()
    return _GANG


def properties() -> dict[str, Any]:
    g = gang()
    return {
        "rank": g.rank,
        "size": g.size,
        "env_rank": int(os.environ["RANK"]),
        "device": g.device,
        "supports_pg": g.supports_process_group,
        "members": g.members,
        "jax_process": jax.process_index(),
        "jax_device_process": g.jax_device.process_index,
        "outside_loopback": non_loopback_sockets(os.getpid()),  # the coordinator and XLA's collectives
    }


def as_process_group_raises() -> str:
    try:
        gang().as_process_group()
    except NotSupportedError as ex:
        return str(ex)
    return "no error"


def numpy_in_place(dtype: str) -> np.ndarray[Any, Any]:
    g = gang()
    a = np.full((3,), g.rank + 1, dtype=dtype)
    g.all_reduce(a, ReduceOperation.SUM)
    return a


def x64_sum() -> tuple[bool, torch.Tensor]:
    """int64 beyond 2**32 while jax_enable_x64 stays off for the user."""
    g = gang()
    t = torch.tensor([2**40 + g.rank, -(2**50)], dtype=torch.int64)
    g.all_reduce(t, ReduceOperation.SUM)
    return bool(jax.config.values.get("jax_enable_x64")), t


def compile_cache() -> tuple[int, int, int]:
    g = gang()
    before = g.num_compiled
    for i in range(5):
        t = torch.full((7,), float(i))
        g.all_reduce(t, ReduceOperation.MAX)
    after_loop = g.num_compiled
    g.all_reduce(torch.zeros(8), ReduceOperation.MAX)  # a new shape compiles once more
    return before, after_loop, g.num_compiled


def all_gather_programs() -> list[str]:
    """The optimised HLO of the all-gather programs a call compiles: the functional one and the torch one."""
    from gang_jax._collectives import ALL_GATHER

    g = gang()
    comm = g.communicator
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + g.rank
    functional.all_gather(g, x)
    g.all_gather(torch.zeros(g.size, 2, 3), torch.zeros(2, 3))
    texts = []
    plan = comm._local[(ALL_GATHER.name, None, None, (), x.shape, x.dtype)]
    assert plan is not None
    like = jax.ShapeDtypeStruct((g.size * 2, 3), x.dtype, sharding=comm.sharding)  # type: ignore[no-untyped-call]
    texts.append(cast(Any, plan.fn).lower(like).compile().as_text())  # a jax.jit: it lowers
    (key,) = [k for k in comm._plans if k[0] == ALL_GATHER.name]
    like = jax.ShapeDtypeStruct((g.size, *key[-2][1:]), key[-1], sharding=comm.sharding)  # type: ignore[no-untyped-call]
    texts.append(cast(Any, comm._plans[key].fn).lower(like).compile().as_text())
    return texts


def large_float_broadcast() -> list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], str, bool]]:
    """Broadcasts from rank 1 of 256 KiB of floats whose bits an arithmetic sum could change: (the source's
    bits, the result's bits, the result's dtype, whether the result is on the gang's device), per dtype."""
    import ml_dtypes

    g = gang()
    out = []
    for dtype, width, nan in (
        (np.float32, np.uint32, 0x7F800001),
        (np.float16, np.uint16, 0x7C01),
        (ml_dtypes.bfloat16, np.uint16, 0x7F81),
    ):
        n = (256 << 10) // np.dtype(dtype).itemsize
        bits = (np.arange(n, dtype=np.uint64) * 2654435761 % (1 << (8 * np.dtype(width).itemsize))).astype(width)
        bits[:3] = [1 << (8 * np.dtype(width).itemsize - 1), 1, nan]  # -0.0, a subnormal, a signalling NaN
        mine = bits if g.rank == 1 else bits[::-1].copy()
        y = functional.broadcast(g, jnp.asarray(mine.view(dtype)), source_rank=1)
        out.append((bits, np.asarray(y).view(width).copy(), str(y.dtype), y.devices() == {g.jax_device}))
    return out


def functional_ops() -> dict[str, Any]:
    g = gang()
    r, n = g.rank, g.size
    x = jnp.arange(4, dtype=jnp.float32) + r
    rows = jnp.arange(n * 2, dtype=jnp.int32).reshape(n, 2) + 100 * r
    out = {
        "sum": functional.all_reduce(g, x, ReduceOperation.SUM),
        "mean": functional.all_reduce(g, x, ReduceOperation.MEAN),
        "gather": functional.all_gather(g, x),
        "rs": functional.reduce_scatter(g, rows, ReduceOperation.MAX),
        "a2a": functional.all_to_all(g, rows),
        "bcast": functional.broadcast(g, x * (r + 1), source_rank=n - 1),
        "bcast_bool": functional.broadcast(g, jnp.array([r % 2 == 0, True]), source_rank=1),
    }
    assert all(isinstance(v, jax.Array) for v in out.values())
    return {k: np.asarray(v) for k, v in out.items()}


def functional_shapes() -> dict[str, Any]:
    """Arrays the compiled program cannot take as its shard (0-d, no rows, a 0-d result) and a few it can."""
    g = gang()
    r, n = g.rank, g.size
    out = {
        "scalar": functional.all_reduce(g, jnp.float32(r + 1), ReduceOperation.SUM),
        "rs_scalar": functional.reduce_scatter(g, jnp.arange(n, dtype=jnp.int32) + r, ReduceOperation.SUM),
        "no_rows": functional.all_reduce(g, jnp.zeros((0, 2)), ReduceOperation.SUM),
        "gather_2d": functional.all_gather(g, jnp.full((2, 3), r, dtype=jnp.int8)),
        "bcast_complex": functional.broadcast(g, jnp.array([1 + 2j * r, -0.0], dtype=jnp.complex64), source_rank=1),
        "bcast_scalar": functional.broadcast(g, jnp.int32(r), source_rank=n - 1),
    }
    x = jnp.ones(5)
    functional.all_reduce(g, x, ReduceOperation.SUM)
    before = g.num_compiled
    for _ in range(3):
        functional.all_reduce(g, x + 1, ReduceOperation.SUM)
    return {"compiled": g.num_compiled - before} | {k: (np.asarray(v), v.shape) for k, v in out.items()}


def functional_errors() -> list[str]:
    g = gang()
    errors = []
    calls: list[Callable[[], object]] = [
        lambda: functional.all_reduce(g, np.ones(2), ReduceOperation.SUM),  # type: ignore[arg-type]
        lambda: functional.all_reduce(g, jnp.ones(2, jnp.int32), ReduceOperation.MEAN),
        lambda: functional.reduce_scatter(g, jnp.ones((g.size + 1, 2)), ReduceOperation.SUM),
        lambda: functional.broadcast(g, jnp.ones(2), source_rank=g.size),
        lambda: functional.all_gather(object(), jnp.ones(2)),  # type: ignore[arg-type]
    ]
    for call in calls:
        try:
            call()
        except (TypeError, ValueError) as ex:
            errors.append(f"{type(ex).__name__}: {ex}")
    return errors


def functional_in_debug_mode() -> dict[str, Any]:
    """A debug-mode gang on the running runtime: a matching functional call runs, mismatched shapes are refused."""
    g = JaxGang.create_default(debug=True)  # wraps the running runtime (closing it leaves the runtime up)
    try:
        same = functional.all_reduce(g, jnp.ones(2), ReduceOperation.SUM)
        try:
            functional.all_reduce(g, jnp.ones(2 + g.rank), ReduceOperation.SUM)
            mismatch = "no error"
        except GangError as ex:
            mismatch = str(ex)
    finally:
        g.close()
    return {"same": np.asarray(same), "mismatch": mismatch}


def checks_before_communication() -> list[str]:
    """Bad arguments raise the core's errors on every rank, before anything is sent."""
    g = gang()
    errors = []
    calls: list[Callable[[], object]] = [
        lambda: g.all_reduce(torch.ones(2, dtype=torch.int32), ReduceOperation.MEAN),
        lambda: g.all_gather(torch.empty(g.size + 1, 2), torch.ones(2)),
        lambda: g.broadcast(torch.ones(2), source_rank=-1),
    ]
    for call in calls:
        try:
            call()
        except ValueError as ex:
            errors.append(str(ex))
    g.barrier()
    return errors


def subgang_and_close() -> dict[str, Any]:
    g = gang()
    sub = g.create_gang([g.size - 1, 0])
    if sub is None:
        return {"member": False}
    t = torch.tensor([float(g.rank)])
    sub.all_reduce(t, ReduceOperation.SUM)
    assert isinstance(sub, JaxGang)
    info = {"member": True, "rank": sub.rank, "size": sub.size, "sum": t.item(), "members": sub.members}
    sub.close()
    try:
        sub.barrier()
    except InvalidOperationError:
        info["closed_raises"] = True
    return info


def bool_and_float16() -> dict[str, torch.Tensor]:
    g = gang()
    flags = torch.tensor([g.rank == 0, True, False])
    g.all_reduce(flags, ReduceOperation.MAX)
    half = torch.full((2,), 0.5 * (g.rank + 1), dtype=torch.float16)
    g.all_reduce(half, ReduceOperation.SUM)
    c = torch.tensor([1 + 2j * g.rank], dtype=torch.complex64)
    g.broadcast(c, source_rank=g.size - 1)
    return {"flags": flags, "half": half, "complex": c}


def large_reduce_scatter(op_name: str) -> torch.Tensor:
    g = gang()
    chunk = 1 << 20
    inp = (torch.arange(g.size * chunk, dtype=torch.float32) % 97 + g.rank).reshape(g.size, chunk)
    out = torch.empty(chunk)
    g.reduce_scatter(out, inp, ReduceOperation[op_name])
    return out


def create_close_create() -> tuple[int, int]:
    """Shut the runtime down with close() and initialise it again in the same processes."""
    first = JaxGang.create_default()
    t = torch.ones(1)
    first.all_reduce(t, ReduceOperation.SUM)
    first.close()
    initialized_after_close = int(jax.distributed.is_initialized())
    return int(t.item()), initialized_after_close


def create_other_ways(address: str, second_address: str) -> list[Any]:
    """Explicit arguments, JAX's own variable, and wrapping a runtime the caller started."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seen: list[Any] = []

    explicit = JaxGang.create_default(coordinator_address=address, num_processes=size, process_id=rank)
    t = torch.tensor([rank + 1])
    explicit.all_reduce(t, ReduceOperation.SUM)
    seen.append(int(t.item()))
    explicit.close()

    os.environ["JAX_COORDINATOR_ADDRESS"] = second_address
    try:
        from_env = JaxGang.create_default()
    finally:
        del os.environ["JAX_COORDINATOR_ADDRESS"]
    t = torch.tensor([rank + 1])
    from_env.all_reduce(t, ReduceOperation.MAX)
    seen.append(int(t.item()))
    try:
        JaxGang.create_default(num_processes=size)
    except InvalidOperationError:
        seen.append("already initialised")
    wrapped = JaxGang.create_default()  # wraps the running runtime; closing it leaves it running
    wrapped.close()
    seen.append(bool(jax.distributed.is_initialized()))
    from_env.close()

    seen.append(bool(jax.distributed.is_initialized()))
    return seen


def several_local_devices() -> dict[str, Any]:
    """With two CPU devices per process, the gang uses the first one each process owns."""
    g = JaxGang.create_default()
    t = torch.tensor([float(g.rank + 1)])
    g.all_reduce(t, ReduceOperation.SUM)
    rows = torch.empty(g.size, 2, dtype=torch.int64)
    g.all_gather(rows, torch.tensor([g.rank, 2**40]))
    info = {
        "local_devices": len(jax.local_devices()),
        "uses_first_local": g.jax_device == min(jax.local_devices(), key=lambda d: d.id),
        "mesh_ids": [d.id for d in g.mesh.devices.flat],
        "sum": t.item(),
        "rows": rows.tolist(),
    }
    g.close()
    return info


_ISOLATED: JaxGang | None = None


def isolated_gang() -> JaxGang:
    """Return this process's isolated root gang (JAX in a child process), created once per process."""
    global _ISOLATED
    if _ISOLATED is None:
        _ISOLATED = JaxGang.create_default(isolated=True)
    return _ISOLATED


def compile_stays_flat(isolated: bool) -> list[int]:
    """``num_compiled`` after one round of every operation, then after each of five more rounds."""
    g = isolated_gang() if isolated else gang()
    n = g.size
    floats, longs = torch.ones(2, 3), torch.ones(5, dtype=torch.int64)
    rows, out = torch.ones(n, 4), torch.empty(n, 4)
    r = g.rank
    counts = []
    for step in range(6):
        # Point-to-point and uneven rows too; the uneven counts vary (3 or 4 rows), within one padded size.
        g.send_recv([(rows[0], (r + 1) % n)], [(out[0], (r - 1) % n)])
        splits = [3 + step % 2] * n
        g.all_to_all_uneven(torch.empty(sum(splits), 2), torch.ones(sum(splits), 2), splits, splits)
        g.all_reduce(floats, ReduceOperation.SUM)
        g.all_reduce(longs, ReduceOperation.MAX)  # 64-bit reductions run in JAX's 64-bit mode
        g.all_gather(out, rows[0])
        g.reduce_scatter(out[0], rows, ReduceOperation.SUM)
        g.all_to_all(out, rows)
        g.broadcast(floats, n - 1)
        g.barrier()
        counts.append(g.num_compiled)
    return counts


def bounded_wait(flag: str) -> Any:
    """Rank 0 waits 0.2 s for a receive that rank 1 sends only once ``flag`` exists (made after that wait)."""
    g = gang()
    g.barrier()  # every rank has joined the gang's programs before two of them start a transfer
    if g.rank == 0:
        t = torch.zeros(3)
        work = g.recv(t, 1, async_op=True)
        try:
            work.wait(timeout=0.2)
            outcome = "no error"
        except GangError as ex:
            outcome = f"GangError: {ex}"
        Path(flag).touch()
        work.wait()
        return outcome, t.tolist(), work.is_completed()
    if g.rank == 1:
        while not os.path.exists(flag):
            time.sleep(0.01)
        g.send(torch.arange(3.0), 0)
    return None


def isolated_properties() -> dict[str, Any]:
    """What an isolated gang tells about itself, next to the in-process gang of the same processes."""
    iso, local = isolated_gang(), gang()
    out: dict[str, Any] = {"same": (iso.rank, iso.size, iso.members) == (local.rank, local.size, local.members)}
    out["isolated"] = (iso.isolated, local.isolated)
    for name, call in (
        ("communicator", lambda: iso.communicator),
        ("functional", lambda: functional.all_reduce(iso, jnp.ones(2), ReduceOperation.SUM)),
    ):
        try:
            call()
            out[name] = "no error"
        except NotSupportedError as ex:
            out[name] = str(ex)
    sub = iso.create_gang([0, iso.size - 1])
    if isinstance(sub, JaxGang):
        t = torch.tensor([float(iso.rank)])
        sub.all_reduce(t, ReduceOperation.SUM)
        out["sub"] = (sub.rank, sub.size, sub.members, t.item())
        sub.close()
    return out


def factory_layouts(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The factories' gangs (cp, ep, flattened) on this process's JaxGang root (see ``roles_workers``).

    Flattening gangs without a layout (a gather over the root) is left to the gloo test: every
    new JaxGang compiles its collectives, the main cost here.
    """
    from roles_workers import layout_report

    return layout_report(gang(), configs, without_layout=False)


def large_calls_twice() -> list[str]:
    """Every call of 2 MiB or more (an input taken through DLPack, not copied in) twice per dtype, the second
    on an input that starts one element into its storage; the wrong results, named."""
    g = gang()
    r, n = g.rank, g.size
    wrong = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        numel = (2 << 20) // torch.empty(0, dtype=dtype).element_size()
        k = torch.arange(n * numel)
        for call in range(2):
            fresh = partial(_offset_copy, offset=call)
            mine = fresh((k[:numel] % 13 + r + call).to(dtype))
            g.all_reduce(mine, ReduceOperation.MAX)
            if not torch.equal(mine, (k[:numel] % 13 + n - 1 + call).to(dtype)):
                wrong.append(f"all_reduce {dtype} call {call}")
            if dtype.is_floating_point:  # a leaf that requires grad (a parameter), reduced under no_grad
                leaf = (k[:numel] % 5 + r + call).to(dtype).requires_grad_()  # not a view: a real leaf
                with torch.no_grad():
                    g.all_reduce(leaf, ReduceOperation.SUM)
                if not torch.equal(leaf.detach(), (n * (k[:numel] % 5 + call) + n * (n - 1) // 2).to(dtype)):
                    wrong.append(f"all_reduce of a leaf that requires grad {dtype} call {call}")
            rows = fresh((k % 11 + 3 * r + call).to(dtype)).view(n, numel)
            out = torch.empty_like(rows)
            g.all_to_all(out, rows)
            expected = torch.stack([(k % 11 + 3 * i + call).to(dtype).view(n, numel)[r] for i in range(n)])
            if not torch.equal(out, expected):
                wrong.append(f"all_to_all {dtype} call {call}")
            sent, received = fresh((k[:numel] % 7 + r + call).to(dtype)), torch.empty(numel, dtype=dtype)
            g.send_recv([(sent, (r + 1) % n)], [(received, (r - 1) % n)])
            if not torch.equal(received, (k[:numel] % 7 + (r - 1) % n + call).to(dtype)):
                wrong.append(f"send_recv {dtype} call {call}")
            if not torch.equal(sent, (k[:numel] % 7 + r + call).to(dtype)):
                wrong.append(f"send_recv's input {dtype} call {call}")
    return wrong


def _offset_copy(values: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``values`` that starts ``offset`` elements into its storage."""
    t = torch.empty(len(values) + offset, dtype=values.dtype)[offset:]
    t.copy_(values)
    return t
