"""Functions run on the worker processes of the fault-injection suite (imported there by name).

Each survivor reports what it saw as a dict: the GangError text, its cause, and whether
``close()`` then returned. Victims exit, get killed, or hang, as the scenario says.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch

import gang
from gang import Gang, GangError, ReduceOperation


def _survive(g: Gang, step: Any) -> dict[str, Any]:
    try:
        step()
    except GangError as ex:
        g.close()
        return {"error": str(ex), "cause": repr(ex.__cause__), "closed": g.closed}
    return {"error": None, "closed": False}


def exit_before_collective(g: Gang, victim: int) -> dict[str, Any]:
    g.barrier()
    if g.rank == victim:
        os._exit(7)
    return _survive(g, lambda: g.all_reduce(torch.ones(8), ReduceOperation.SUM))


def killed_mid_stream(g: Gang, victim: int, after: int) -> dict[str, Any]:
    def stream() -> None:
        for i in range(10_000):
            if g.rank == victim and i == after:
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.full((256,), float(g.rank))
            g.all_reduce(t, ReduceOperation.SUM)

    return _survive(g, stream)


def killed_while_pending(g: Gang, victim: int, kind: str) -> dict[str, Any]:
    """The survivors start an operation with ``async_op=True`` that needs ``victim``, tell it so, and
    wait; ``victim`` is SIGKILLed once every survivor's handle is pending.

    ``kind`` is ``"recv"`` (from the victim), ``"all_reduce"``, or ``"send_recv"`` (a ring shift in a
    gang of two, whose send to the victim tells it the handle is pending).
    """
    g.barrier()
    signal_size = 64 if kind == "send_recv" else 1
    if g.rank == victim:
        for survivor in range(g.size):
            if survivor != victim:
                g.recv(torch.zeros(signal_size), survivor)
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "send_recv":
        work = g.send_recv([(torch.ones(64), victim)], [(torch.zeros(64), victim)], async_op=True)
    else:
        if kind == "recv":
            work = g.recv(torch.zeros(64), victim, async_op=True)
        else:
            work = g.all_reduce(torch.ones(64), ReduceOperation.SUM, async_op=True)
        g.send(torch.ones(1), victim)  # "my handle is pending"
    return _survive(g, work.wait)


def hang(g: Gang, victim: int, seconds: float) -> dict[str, Any]:
    if g.rank == victim:
        time.sleep(seconds)
        return {"victim": True}
    return _survive(g, lambda: g.all_reduce(torch.ones(4), ReduceOperation.SUM))


def hang_in_sub_gang(g: Gang, victim: int, seconds: float) -> dict[str, Any]:
    sub = g.create_gang([0, 1])
    if sub is None:
        return {"member": False}
    if sub.rank == victim:
        time.sleep(seconds)
        return {"victim": True}
    result = _survive(sub, lambda: sub.all_reduce(torch.ones(4), ReduceOperation.SUM))
    result["timeout"] = getattr(sub, "timeout", None)
    return result


def never_arrives(victim: int, seconds: float, timeout_s: float) -> dict[str, Any]:
    """Rank ``victim`` never joins the rendezvous; the others try to create the default gang."""
    if gang.get_rank() == victim:
        time.sleep(seconds)
        return {"victim": True}
    try:
        gang.ProcessGroupGang.create_default_process_group(torch.device("cpu"), timeout=timedelta(seconds=timeout_s))
    except GangError as ex:
        return {"error": str(ex)}
    return {"error": None}


def store_host_dies(after: int, timeout_s: float) -> dict[str, Any]:
    """Rank 0 hosts the rendezvous store (no agent store) and dies in the middle of a stream."""
    root = gang.ProcessGroupGang.create_default_process_group(torch.device("cpu"), timeout=timedelta(seconds=timeout_s))

    def stream() -> None:
        for i in range(10_000):
            if root.rank == 0 and i == after:
                os._exit(9)
            root.all_reduce(torch.ones(64), ReduceOperation.SUM)
            if i % 5 == 0:  # sub-gangs talk to the store too
                sub = root.create_gang(list(range(root.size)))
                assert sub is not None
                sub.barrier()
                sub.close()

    return _survive(root, stream)


def close_on_error_path(g: Gang, failing: int) -> dict[str, Any]:
    """The fairseq2 pattern: `try: ... finally: gangs.close()` with one rank failing early."""
    gangs = gang.create_parallel_gangs(g, tp_size=2)
    try:
        if g.rank == failing:
            raise RuntimeError("model code failed on one rank")
        return _survive(g, lambda: gangs.dp.all_reduce(torch.ones(4), ReduceOperation.SUM) or g.barrier())
    except RuntimeError:
        gangs.close()
        return {"failing": True, "closed": g.closed}
    finally:
        gangs.close()


# -- debug mode ----------------------------------------------------------------------------------


def mismatched_shapes(g: Gang) -> str:
    assert g.debug
    try:
        g.all_reduce(torch.ones(3 + g.rank), ReduceOperation.SUM)
    except GangError as ex:
        return str(ex)
    return "no error"


def mismatched_collectives(g: Gang) -> str:
    assert g.debug
    try:
        if g.rank == 0:
            g.broadcast(torch.ones(2), source_rank=0)
        else:
            g.all_reduce(torch.ones(2), ReduceOperation.MAX)
    except GangError as ex:
        return str(ex)
    return "no error"


def mismatched_in_sub_gang(g: Gang) -> str:
    sub = g.create_gang([0, 1])
    if sub is None:
        return "not a member"
    assert sub.debug
    try:
        sub.reduce_scatter(torch.empty(1), torch.ones(2, 1), ReduceOperation.SUM if sub.rank else ReduceOperation.MIN)
    except GangError as ex:
        return str(ex)
    finally:
        sub.close()
    return "no error"


def matching_calls_work(g: Gang) -> list[float]:
    t = torch.full((4,), float(g.rank))
    g.all_reduce(t, ReduceOperation.SUM)
    out = torch.empty(g.size, 4)
    g.all_gather(out, t)
    objs: list[object] = [g.rank]
    g.broadcast_objects(objs, source_rank=1)
    return [t[0].item(), out.sum().item(), float(objs[0])]  # type: ignore[arg-type]


def debug_flag(g: Gang) -> bool:
    return g.debug


def made_and_closed() -> int:
    """Create the default gang of fresh processes and close it at once, with no collective between.

    gloo's group constructor can return on one member while another is still inside it; a member
    that destroyed the group at once then broke the other's constructor ("Connection closed by
    peer").
    """
    root = gang.ProcessGroupGang.create_default_process_group(torch.device("cpu"))
    root.close()
    return 1
