"""What the hook tests run on a gang of any kind: every operation once, observed by a hook."""

from __future__ import annotations

from typing import Any

import torch

import gang.trace
from gang import Gang, ReduceOperation


def observe(root: Gang) -> dict[str, Any]:
    """Run every operation of ``root`` and of a sub-gang (async handles and traffic included) under a hook.

    Returns the hook's events (``(when, operation, seq, p2p_seq, gang_name, shapes, bytes, error)``)
    and the results, to compare with a run without the hook.
    """
    events: list[tuple[Any, ...]] = []

    def seen(when: str) -> Any:
        def hook(r: gang.trace.OpRecord) -> None:
            error = r.error
            events.append((when, r.operation, r.seq, r.p2p_seq, r.gang_name, r.shapes, r.bytes, error))
            assert r.gang is not None
            if when == "ended":
                assert r.duration_s is not None and r.duration_s >= 0

        return hook

    hook = gang.trace.add_hook(started=seen("started"), ended=seen("ended"))
    try:
        results = run_ops(root, events)
    finally:
        hook.remove()
    return {"events": events, "results": results}


def run_ops(root: Gang, events: list[tuple[Any, ...]] | None = None) -> list[list[float]]:
    """Every operation once; returns what each left in its output (the same with or without hooks)."""
    size, rank = root.size, root.rank
    out: list[list[float]] = []
    t = torch.full((2,), float(rank + 1))
    root.all_reduce(t, ReduceOperation.SUM)
    out.append(t.tolist())
    work = root.all_reduce(t, ReduceOperation.MAX, async_op=True)
    if events is not None:
        out.append([float(sum(1 for e in events if e[0] == "ended" and e[2] == 2))])  # not ended before wait
    work.wait()
    out.append(t.tolist())
    gathered = torch.zeros(size, 2)
    root.all_gather(gathered, t)
    out.append(gathered.flatten().tolist())
    scattered = torch.zeros(2)
    root.reduce_scatter(scattered, torch.ones(size, 2), ReduceOperation.SUM)
    out.append(scattered.tolist())
    root.broadcast(t, 0)
    root.barrier()
    objects: list[object] = [rank]
    root.broadcast_objects(objects, 0)
    out.append([float(objects[0])])  # type: ignore[arg-type]
    sub = root.create_gang(list(range(size)))
    assert sub is not None
    if size > 1:
        right, left = (sub.rank + 1) % size, (sub.rank - 1) % size
        received = torch.zeros(3)
        sub.send_recv([(torch.full((3,), float(rank)), right)], [(received, left)], async_op=True).wait()
        out.append(received.tolist())
        rows = torch.zeros(size, 1)
        splits = [1] * size
        sub.all_to_all_uneven(rows, torch.full((size, 1), float(rank)), splits, splits)
        out.append(rows.flatten().tolist())
    sub.close()
    return out


def unmatched_transfer(root: Gang, case: str, directory: str) -> str | None:
    """Post one point-to-point transfer whose sides do not match, then dump the flight recorder.

    ``case="shape"``: rank 0 sends 4 floats, rank 1 receives 8. ``case="missing"``: rank 1 waits to
    receive 4 floats that rank 0 never sends. Returns the error the transfer raised on this rank, if any.
    """
    from gang import GangError

    error = None
    try:
        if root.rank == 0 and case == "shape":
            root.send(torch.ones(4), 1)
        elif root.rank == 1:
            root.recv(torch.zeros(8 if case == "shape" else 4), 0)
    except GangError as ex:
        error = type(ex).__name__
    gang.trace.dump(f"test: {case}", directory)
    return error
