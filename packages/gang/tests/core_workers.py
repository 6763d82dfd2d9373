"""Functions that run on the worker processes of the core tests (imported there by name)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import gang
from gang import Gang, ReduceOperation
from gang.testing import member_ranks, non_loopback_sockets

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
OPS = {op.name: op for op in ReduceOperation}


def values(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Deterministic small integers in [-2, 2]: sums, products (powers of two up to 2**8) and
    means over 1, 2, 4 or 8 ranks are exact in every dtype we test, bfloat16 included."""
    n = int(np.prod(shape)) if shape else 1
    index = np.arange(n, dtype=np.int64)
    data = ((rank + 1 + salt) * (index + 3) + rank) % 5 - 2
    return torch.tensor(data.reshape(shape), dtype=torch.float64).to(dtype)


def run_collective(g: Gang, collective: str, dtype_name: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """Run ``collective`` with every applicable reduction; return the outputs keyed by reduction."""
    dtype = DTYPES[dtype_name]
    size, rank = g.size, g.rank
    results: dict[str, Any] = {}
    reductions = [op for op in ReduceOperation if dtype.is_floating_point or op is not ReduceOperation.MEAN]
    if collective == "all_reduce":
        for op in reductions:
            t = values(rank, shape, dtype)
            g.all_reduce(t, op)
            results[op.name] = t
    elif collective == "reduce_scatter":
        for op in reductions:
            inp = values(rank, (size, *shape), dtype)
            out = torch.empty(shape, dtype=dtype)
            g.reduce_scatter(out, inp, op)
            results[op.name] = out
    elif collective == "all_gather":
        out = torch.empty((size, *shape), dtype=dtype)
        g.all_gather(out, values(rank, shape, dtype))
        results["-"] = out
    elif collective == "all_gather_to_list":
        outs = [torch.empty(shape, dtype=dtype) for _ in range(size)]
        g.all_gather_to_list(outs, values(rank, shape, dtype))
        results["-"] = torch.stack(outs)
    elif collective == "all_to_all":
        out = torch.empty((size, *shape), dtype=dtype)
        g.all_to_all(out, values(rank, (size, *shape), dtype))
        results["-"] = out
    elif collective == "broadcast":
        for source in range(size):
            t = values(rank, shape, dtype)
            g.broadcast(t, source_rank=source)
            results[f"source={source}"] = t
    else:
        raise ValueError(collective)
    return results


def global_rank(_: Gang) -> int:
    return dist.get_rank()


def members(g: Gang | None) -> list[int] | None:
    """The global ranks of ``g``'s members, proven by a collective (not by trusting metadata)."""
    return None if g is None else member_ranks(g)


def sub_gang_members(g: Gang, ranks: list[int], nested: list[int] | None) -> dict[str, Any]:
    sub = g.create_gang(ranks)
    result: dict[str, Any] = {"sub": members(sub), "rank": None if sub is None else sub.rank}
    if sub is not None and nested is not None:
        inner = sub.create_gang(nested)
        result["nested"] = members(inner)
        result["nested_rank"] = None if inner is None else inner.rank
        result["timeout"] = getattr(inner, "timeout", None) if inner is not None else None
        if inner is not None:
            inner.close()
    if sub is not None:
        result["sub_timeout"] = sub.timeout  # type: ignore[attr-defined]
        backend = sub.as_process_group()._get_backend(torch.device("cpu"))
        result["sub_backend_timeout"] = backend.options._timeout
        sub.close()
    return result


def parallel_layout(g: Gang, tp_size: int, pp_size: int, intra_node_size: int | None, fsdp: bool) -> dict[str, Any]:
    gangs = gang.create_parallel_gangs(g, tp_size=tp_size, pp_size=pp_size)
    if fsdp:
        gangs = gang.create_fsdp_gangs(gangs, intra_node_size)
    result: dict[str, Any] = {}
    for role, sub in gangs.items():
        result[role] = {
            "members": members(sub),
            "rank": sub.rank,
            "size": sub.size,
            "kind": type(sub).__name__,
            "is_root": sub is g,
        }
    for _, sub in gangs.items():
        if sub is not g:
            sub.close()
    return result


def try_call(g: Gang, name: str) -> str:
    """Run one bad call; return the exception type and message; then prove the gang still works."""
    from bad_call_workers import BAD_CALLS

    try:
        BAD_CALLS[name](g)
    except Exception as ex:
        outcome = f"{type(ex).__name__}: {ex}"
    else:
        outcome = "no error"
    t = torch.ones(1)
    g.all_reduce(t, ReduceOperation.SUM)
    assert t.item() == g.size
    return outcome


def asymmetric_history(g: Gang) -> list[Any]:
    """Ranks 1-3 join an extra sub-gang before all create [0, 2]; then [0, 2] is closed and made again.

    With torch's own local-synchronisation naming, ranks 0 and 2 would disagree on the group name
    here (their group counts differ) and wait for each other forever.
    """
    extra = g.create_gang([1, 2, 3])
    pair = g.create_gang([0, 2])
    first = members(pair)
    if pair is not None:
        pair.close()
    again = g.create_gang([0, 2])
    second = members(again)
    extra_members = members(extra)
    for sub in (extra, again):
        if sub is not None:
            sub.close()
    return [extra_members, first, second]


def close_and_reinit(rounds: int) -> list[float]:
    """Create the default gang, use it with a sub-gang, close it; ``rounds`` times in one process."""
    sums = []
    for _round in range(rounds):
        root = gang.ProcessGroupGang.create_default_process_group(torch.device("cpu"))
        sub = root.create_gang([0, 1])
        t = torch.ones(1)
        root.all_reduce(t, ReduceOperation.SUM)
        if sub is not None:
            sub.all_reduce(t, ReduceOperation.SUM)
        sums.append(t.item())
        root.close()
        assert sub is None or sub.closed
        assert not dist.is_initialized()
    return sums


def lifecycle_errors() -> list[str]:
    out = []
    root = gang.ProcessGroupGang.create_default_process_group(torch.device("cpu"))
    calls: list[Callable[[], object]] = [
        lambda: gang.ProcessGroupGang.create_default_process_group(torch.device("cpu")),
        lambda: gang.ProcessGroupGang.create_default_process_group(torch.device("meta")),
        lambda: gang.ProcessGroupGang.create_default_process_group("cpu"),  # type: ignore[arg-type]
        lambda: gang.ProcessGroupGang.create_default_process_group(torch.device("cpu"), timeout=5),  # type: ignore[arg-type]
    ]
    for call in calls:
        try:
            call()
        except Exception as ex:
            out.append(type(ex).__name__)
    root.close()
    root.close()  # idempotent
    try:
        root.barrier()
    except Exception as ex:
        out.append(type(ex).__name__)
    return out


def adopt_framework_group() -> dict[str, Any]:
    """Initialise the default group as a framework does (env://), then build a gang over it."""
    dist.init_process_group("gloo")  # what Ray Train, Lightning or Accelerate do before user code runs
    try:
        gang.ProcessGroupGang.create_default_process_group(torch.device("cpu"))
    except gang.InvalidOperationError as ex:
        explicit = str(ex)
    root = gang.create_default_gang()
    assert isinstance(root, gang.ProcessGroupGang)
    t = torch.tensor([float(root.rank + 1)])
    root.all_reduce(t, ReduceOperation.SUM)
    gangs = gang.create_parallel_gangs(root)
    pair = root.create_gang([0, 1])
    assert pair is not None
    u = torch.ones(1)
    pair.all_reduce(u, ReduceOperation.SUM)
    adopted = root.as_process_group() is dist.group.WORLD
    root.close()
    # The framework's group outlives the gang; the sub-gang made from it is gone.
    after = torch.ones(1)
    dist.all_reduce(after)
    result = {
        "explicit": explicit,
        "adopted": adopted,
        "sum": t.item(),
        "dp": gangs.dp.size,
        "pair": u.item(),
        "pair_closed": pair.closed,
        "still_initialised": dist.is_initialized(),
        "after": after.item(),
    }
    dist.destroy_process_group()  # the framework's job
    return result


def wrap_user_group(g: Gang) -> list[Any]:
    pg = dist.new_group([0, 1, 2, 3])
    wrapped = gang.ProcessGroupGang.from_process_group(pg, torch.device("cpu"))
    t = torch.tensor([float(wrapped.rank)])
    wrapped.all_reduce(t, ReduceOperation.SUM)
    sub = wrapped.create_gang([2, 3])
    got = members(sub)
    wrapped.close()
    # Closing a wrapped group does not destroy the caller's group.
    t2 = torch.ones(1)
    dist.all_reduce(t2, group=pg)
    return [t.item(), got, t2.item(), wrapped.as_process_group is not None]


def rank_and_pid(g: Gang, tag: str) -> tuple[int, int, str]:
    import os

    return g.rank, os.getpid(), tag


def fail_on(g: Gang, bad_rank: int) -> None:
    if g.rank == bad_rank:
        raise KeyError(f"bad things on {g.rank}")
    g.barrier()


_IN_WORKER = False  # set on the workers only: `WorkerOnlyError` cannot be rebuilt in the test process


def _rebuild_worker_only(text: str) -> WorkerOnlyError:
    if not _IN_WORKER:
        raise RuntimeError("a `WorkerOnlyError` can be rebuilt on a worker only")
    return WorkerOnlyError(text)


class WorkerOnlyError(Exception):
    """An exception that pickles everywhere but unpickles only on a worker (as one whose class the
    test process cannot import would)."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_rebuild_worker_only, (str(self),))


def raise_worker_only(g: Gang) -> None:
    global _IN_WORKER
    _IN_WORKER = True
    raise WorkerOnlyError(f"made on rank {g.rank}")


def sleep_forever(g: Gang) -> None:
    import time

    time.sleep(3600)


# -- the fairseq2 guide's examples, with our imports -------------------------------------------------


def guide_tensor_parallel_setup(root: Gang) -> dict[str, Any]:
    # "Tensor Parallel Distributed Gang Setup"
    from gang import create_parallel_gangs

    gangs = create_parallel_gangs(root, tp_size=root.size)  # the guide uses tp_size=8 on 8 devices
    tensor = torch.ones((8, 8), device=root.device)
    gangs.tp.all_reduce(tensor, ReduceOperation.SUM)
    return {
        "root": (gangs.root.size, gangs.root.rank),
        "tp": (gangs.tp.rank, gangs.tp.size),
        "sum": tensor[0, 0].item(),
    }


def guide_gang_vs_process_group(root: Gang) -> list[float]:
    # "Gang vs ProcessGroup usage comparison": the same two collectives, both ways.
    pg = dist.new_group([0, 1, 2, 3])
    tensor = torch.full((2,), float(dist.get_rank(pg) + 1))
    dist.all_reduce(tensor, group=pg)
    dist.broadcast(tensor, src=0, group=pg)
    via_gang = torch.full((2,), float(root.rank + 1))
    root.all_reduce(via_gang, ReduceOperation.SUM)
    root.broadcast(via_gang, source_rank=0)
    return [tensor[0].item(), via_gang[0].item()]


def guide_gang_vs_device_mesh(root: Gang) -> dict[str, Any]:
    # "Gang vs DeviceMesh usage comparison": dp and tp all-reduces on a 2x4 layout.
    from gang import create_parallel_gangs

    gangs = create_parallel_gangs(root, tp_size=4)
    dp_t = torch.ones((8, 8))
    gangs.dp.all_reduce(dp_t, ReduceOperation.SUM)
    tp_t = torch.ones((8, 8))
    gangs.tp.all_reduce(tp_t, ReduceOperation.SUM)
    return {
        "dp": dp_t[0, 0].item(),
        "tp": tp_t[0, 0].item(),
        "dp_members": members(gangs.dp),
        "tp_members": members(gangs.tp),
    }


def guide_fsdp_and_hsdp(root: Gang) -> dict[str, Any]:
    # "Initialize fully sharded data parallelism" and "... hybrid sharded data parallelism".
    from gang import create_fsdp_gangs, create_parallel_gangs

    gangs = create_parallel_gangs(root)
    fsdp = create_fsdp_gangs(gangs)
    hsdp = create_fsdp_gangs(gangs, intra_node_size=4)
    return {
        "fsdp_sdp_is_dp": fsdp.sdp is gangs.dp,
        "fsdp_rdp_size": fsdp.rdp.size,
        "fsdp_rdp_fake": type(fsdp.rdp).__name__,
        "hsdp_sdp": members(hsdp.sdp),
        "hsdp_rdp": members(hsdp.rdp),
    }


def guide_some_distributed_function(gang_: Gang) -> float:
    # "Running in a simulated environment": the function body works on any gang.
    tensor = torch.ones((8, 8), device=gang_.device)
    gang_.all_reduce(tensor, ReduceOperation.SUM)
    return tensor[0, 0].item()


def wrapped_group_timeouts(g: Gang) -> dict[str, Any]:
    """Wrap a user group made with its own timeout; what do the gang and its sub-gang use?"""
    pg = dist.new_group([0, 1, 2, 3], timeout=timedelta(seconds=17))
    wrapped = gang.ProcessGroupGang.from_process_group(pg, torch.device("cpu"))
    sub = wrapped.split([[0, 1], [2, 3]])
    assert isinstance(sub, gang.ProcessGroupGang)
    backend = sub.as_process_group()._get_backend(torch.device("cpu"))
    result = {"wrapped": wrapped.timeout, "sub": sub.timeout, "sub_backend": backend.options._timeout}
    wrapped.close()
    return result


def wrap_as_non_member(g: Gang) -> str:
    """``new_group`` hands a non-member a placeholder; wrapping it must say so clearly."""
    pg = dist.new_group([0, 1])
    try:
        gang.ProcessGroupGang.from_process_group(pg, torch.device("cpu"))
    except Exception as ex:
        return f"{type(ex).__name__}: {ex}"
    return "member"


def fallback_warnings(g: Gang) -> list[str]:
    """Create two groups through the public fallback; return the warnings it gave."""
    from gang import _torch_groups

    _torch_groups._warned_fallback = False  # whatever an earlier test in this process did
    groups = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            # Both stay alive until the end: torch names such a group after the number of groups
            # alive, so destroying the first before making the second would give the second the
            # first one's name and store keys (the hang the warning is about; it made this test flaky).
            pg = _torch_groups._public_fallback(list(range(g.size)), timedelta(seconds=30))
            assert pg is not None
            groups.append(pg)
    for pg in groups:
        dist.destroy_process_group(pg)
    return [str(w.message) for w in caught]


def dict_kinds(g: Gang) -> dict[str, Any]:
    """all_reduce_dict with an int on one rank and a float on another, then dicts that cannot agree."""
    result: dict[str, Any] = {}
    mixed: dict[str, Any] = {"a": 1 if g.rank == 0 else 2.5, "b": 2, "c": 1.25}
    result["mixed"] = gang.all_reduce_dict(g, mixed)
    for label, data in (
        ("keys", {"x": 1.0} if g.rank == 0 else {"y": 1.0}),
        ("kinds", {"t": torch.ones(2)} if g.rank == 0 else {"t": 1.0}),
    ):
        try:
            gang.all_reduce_dict(g, data)
            result[label] = "no error"
        except Exception as ex:
            result[label] = f"{type(ex).__name__}: {ex}"
    result["after"] = gang.all_sum(g, 1.0).item()
    return result


def numpy_ranks_and_cpu0(g: Gang) -> dict[str, Any]:
    """A real gang on ``cpu:0`` called with NumPy integer ranks."""
    world = dist.group.WORLD
    assert world is not None
    wrapped = gang.ProcessGroupGang.from_process_group(world, torch.device("cpu", 0))
    t = torch.full((2,), float(wrapped.rank))
    wrapped.broadcast(t, source_rank=np.int32(1))
    sub = wrapped.create_gang([np.int64(0), np.int64(1)])
    result = {"device": str(wrapped.device), "broadcast": t.tolist(), "sub": members(sub)}
    wrapped.close()
    return result


def outside_loopback(gang: Gang) -> list[str]:
    """The TCP sockets of this process that reach beyond loopback (none in a local world)."""
    return non_loopback_sockets(os.getpid())


def private_torch_api(g: Gang) -> dict[str, Any]:
    """Each private torch use of ``gang._torch_groups`` that no other test reaches: taken, not its fallback."""
    from torch._C._distributed_c10d import Backend

    from gang import _torch_groups, rendezvous

    name = f"private_api/{rendezvous.next_call('private_api')}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        named = _torch_groups.new_named_group(list(range(g.size)), name, None)  # the internal constructor
        alone = _torch_groups.alone_group()  # the internal constructor on the `fake` backend
    assert named is not None
    cpu = torch.device("cpu")
    result = {
        "warnings": [str(w.message) for w in caught],
        "named": named.group_name == name,
        "timeout": _torch_groups.group_timeout(named, cpu) == _torch_groups.default_timeout("gloo"),
        # Before torch 2.13 the `fake` backend leaves some outputs untouched: a group of one on gloo.
        "alone": _torch_groups.is_fake_backend(alone) and alone.group_name.startswith("gang_alone/")
        if torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
        else dist.get_process_group_ranks(alone) == [dist.get_rank()] and dist.get_backend(alone) == "gloo",
        # What `can_split` and CUDA's standalone groups read (NCCL itself is not in this build).
        "splitting": isinstance(named._get_backend(cpu).supports_splitting, bool),
        "nccl_timeout": hasattr(Backend.Options, "_timeout"),
    }
    dist.destroy_process_group(named)
    return result


def _copy_gloo_options(options: Any, memo: dict[int, Any]) -> Any:
    """A copy of gloo's backend options, which torch's ``split_group`` deep-copies (NCCL's can be)."""
    copy = type(options)()
    for name in ("_timeout", "_devices", "_threads", "global_ranks_in_group", "group_name"):
        setattr(copy, name, getattr(options, name))
    return copy


def split_group_stand_in(g: Gang, own_group: bool) -> dict[str, Any]:
    """``create_gang([1, 2, 3])`` then ``create_gang([0, 1])`` of that, with the CUDA split path on gloo.

    The stand-in for a NCCL world (a test-only seam, restored afterwards since the world is reused):
    ``torch.accelerator`` reports the CPU, the default group is bound to ``cpu:0`` and gloo's options
    can be deep-copied, so ``dist.split_group`` (which wants all three) runs on gloo. With
    ``own_group`` the gangs split a group whose only backend is gloo on the CPU (as a NCCL world's
    only backend is NCCL on CUDA): torch's ``split_group`` makes the sub-groups. Without it, the
    root's group maps ``cpu`` and ``cuda`` to one gloo backend, which torch would split twice.
    """
    from gang import ProcessGroupGang

    accelerator: Any = torch.accelerator
    world = dist.group.WORLD
    assert world is not None
    options: Any = dist.ProcessGroupGloo._Options  # type: ignore[attr-defined]
    own = dist.new_group(backend="cpu:gloo") if own_group else None  # before the binding, which it would take
    saved = (accelerator.is_available, accelerator.current_accelerator, world.bound_device_id)
    accelerator.is_available = lambda: True
    accelerator.current_accelerator = lambda check_available=False: torch.device("cpu")
    world.bound_device_id = torch.device("cpu", 0)
    options.__deepcopy__ = _copy_gloo_options
    try:
        root = g if own is None else ProcessGroupGang.from_process_group(own, torch.device("cpu"))
        result: dict[str, Any] = {}
        a = root.create_gang([1, 2, 3])
        result["a"] = members(a)
        if a is not None:
            result["a_split"] = ":split:" in a.as_process_group().group_desc
            b = a.create_gang([0, 1])
            result["b"] = members(b)
            result["b_split"] = None if b is None else ":split:" in b.as_process_group().group_desc
            a.close()
        if own is not None:
            root.close()
            dist.destroy_process_group(own)
        return result
    finally:
        accelerator.is_available, accelerator.current_accelerator, world.bound_device_id = saved
        del options.__deepcopy__
