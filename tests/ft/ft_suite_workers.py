"""Failure, healing and retry scenarios on a :class:`ReplicaGang` (rank functions).

Each rank of a :class:`gang.testing.World` joins its own replica (replica id = its rank, one
process per replica) through a coordination store the test started, and keeps that gang in a
module global across calls. A scenario runs its steps and returns what each step and the caller saw.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

import gang.ft.replica as replica_module
from gang import Gang, NotSupportedError, ReduceOperation
from gang.ft import ReplicaGang
from gang.ft.heal import flatten

_GANG: dict[str, ReplicaGang] = {}
_STATE: dict[str, Any] = {}  # what the replica gang of this rank heals from or into


def _state() -> Mapping[str, Any]:
    return _STATE


def _load(state: Mapping[str, Any]) -> None:
    if _STATE.get("refuse"):
        raise ValueError("the shapes do not match this model")
    _STATE.clear()
    _STATE.update(state)


def _join(g: Gang, store: str, **kwargs: Any) -> ReplicaGang:
    # Every World rank is its own replica of one process, whatever its launcher says.
    return ReplicaGang.join(
        replica_id=g.rank,
        replica_rank=0,
        replica_size=1,
        store=store,
        state_dict=_state,
        load_state_dict=_load,
        min_replicas=g.size,
        **{"timeout": timedelta(seconds=20), **kwargs},
    )


def replica_gang(g: Gang, store: str) -> ReplicaGang:
    """This rank's :class:`ReplicaGang` (replica ``g.rank``, one process), joined on first use."""
    gang = _GANG.get(store)
    if gang is None or gang.closed:
        gang = _GANG[store] = _join(g, store)
    return gang


def close(g: Gang, store: str) -> None:
    """Close this rank's replica gang."""
    gang = _GANG.pop(store, None)
    if gang is not None:
        gang.close()


def model_state(seed: int) -> dict[str, Any]:
    """A state of several dtypes, nested containers and non-tensor leaves, different for every seed."""
    g = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(300, 7, generator=g),
        "half": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "steps": torch.randint(0, 1000, (11,), generator=g),
        "mask": torch.rand(6, generator=g) > 0.5,
        "optimizer": {"moments": [torch.randn(4, generator=g).double(), torch.zeros(0)], "lr": 0.1 * seed},
        "name": f"model-{seed}",
    }


def digest(state: Mapping[str, Any]) -> str:
    """A hash of every leaf of ``state``: tensors by dtype, shape and bytes, others by ``repr``."""
    skeleton, tensors = flatten(dict(state))
    h = hashlib.sha256(repr(skeleton).encode())
    for path, t in tensors:
        h.update(repr((path, t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _outcome(ft: ReplicaGang, body: Any) -> dict[str, Any]:
    """Run one step whose body is ``body(ft)``; return what the step and the caller saw."""
    raised = ""
    committed = None
    try:
        with ft.step():
            body(ft)
            committed = ft.should_commit()
    except Exception as ex:  # the caller's own exception, or GangError from max_retries
        raised = f"{type(ex).__name__}: {ex}"
    return {"committed": committed, "error": str(ft.errored()), "raised": raised, "step": ft.step_number}


def _exchange(ft: ReplicaGang) -> None:
    t = torch.ones(3)
    ft.all_reduce(t, ReduceOperation.SUM)


@contextmanager
def _fault(rank: int, operation: str) -> Iterator[None]:
    """Make ``operation`` fail on gang rank ``rank`` through the test-only seam."""

    def hook(gang: ReplicaGang, op: str) -> RuntimeError | None:
        return RuntimeError("injected failure") if gang.rank == rank and op == operation else None

    replica_module._fault_hook = hook
    try:
        yield
    finally:
        replica_module._fault_hook = None


def run_aborts(g: Gang, store: str) -> list[dict[str, Any]]:
    """Five steps: the last rank raises in its own code; its all_reduce fails (the seam); all is
    well; its all_reduce fails after the (committed) vote; all is well."""
    ft = replica_gang(g, store)
    last = g.size - 1

    def raises(gang: ReplicaGang) -> None:
        if gang.rank == last:
            raise KeyError("a bug in the training loop")
        _exchange(gang)

    outcomes = [_outcome(ft, raises)]
    with _fault(last, "all_reduce"):
        outcomes.append(_outcome(ft, _exchange))
    outcomes.append(_outcome(ft, _exchange))

    def fails_after_the_vote(gang: ReplicaGang) -> None:
        committed = gang.should_commit()
        with _fault(last, "all_reduce"):
            _exchange(gang)  # fails on the last rank: the group is dropped after a committed vote
        assert committed

    outcomes.append(_outcome(ft, fails_after_the_vote))
    outcomes.append(_outcome(ft, _exchange))  # a new group at once: no step lost
    status = ft.status()
    outcomes.append({"quorum": status.quorum, "step": status.step, "last_error": str(status.last_error)})
    return outcomes


def run_async_steps(g: Gang, store: str) -> list[dict[str, Any]]:
    """Three steps of collectives started with ``async_op=True``: the last rank's all_reduce fails
    (the seam) while the others' handles are pending; then handles left unwaited, which the vote
    waits for; then P2P, which a ReplicaGang refuses by name."""
    ft = replica_gang(g, store)
    last = g.size - 1

    def pending(gang: ReplicaGang) -> None:
        work = gang.all_reduce(torch.ones(3), ReduceOperation.SUM, async_op=True)
        work.wait()  # records the failure (here or, released by the failing member, on the peers)
        assert work.is_completed()

    with _fault(last, "all_reduce"):
        outcomes = [_outcome(ft, pending)]
    sums: dict[str, Any] = {}

    def unwaited(gang: ReplicaGang) -> None:
        sums["sum"] = torch.full((3,), float(gang.rank))
        sums["gathered"] = torch.empty(gang.size, 2)
        gang.all_reduce(sums["sum"], ReduceOperation.SUM, async_op=True)
        gang.all_gather(sums["gathered"], torch.full((2,), float(gang.rank)), async_op=True)

    outcomes.append(_outcome(ft, unwaited) | {"sum": sums["sum"].tolist(), "gathered": sums["gathered"].tolist()})

    def point_to_point(gang: ReplicaGang) -> None:
        try:
            gang.send(torch.ones(1), (gang.rank + 1) % gang.size, async_op=True)
        except NotSupportedError as ex:
            sums["refused"] = str(ex)

    outcomes.append(_outcome(ft, point_to_point) | {"refused": sums.get("refused", "")})
    return outcomes


def run_heal(g: Gang, store: str) -> dict[str, Any]:
    """The lower half shares a state; the upper half holds states of its own, restores step 0 and
    is healed by the lower half."""
    ft = replica_gang(g, store)
    behind = g.rank >= g.size // 2
    _STATE.clear()
    _STATE.update(model_state(10 + g.rank if behind else 1))
    before = {k: v for k, v in _STATE.items() if isinstance(v, torch.Tensor)}
    bytes_before = list(ft._heal_bytes)
    if behind:
        ft.load_state_dict({"step_number": 0})
    start = ft.step_number
    outcome = _outcome(ft, _exchange)
    sent, received = (a - b for a, b in zip(ft._heal_bytes, bytes_before, strict=True))
    in_place = all(_STATE[k] is t for k, t in before.items())
    moved = {"sent": sent, "received": received, "start": start, "in_place": in_place}
    return outcome | moved | {"digest": digest(_STATE)}


def run_start_and_retries(g: Gang, store: str) -> list[dict[str, Any]]:
    """A fresh gang with ``max_retries=2`` whose ranks start from different states; the last
    rank is then made to heal with a ``load_state_dict`` that raises, twice."""
    _STATE.clear()
    _STATE.update(model_state(100 + g.rank))
    ft = _join(g, store, max_retries=2)
    try:
        first = _outcome(ft, _exchange) | {"digest": digest(_STATE), "reference": digest(model_state(100))}
        outcomes = [first]
        if g.rank == g.size - 1:
            ft.load_state_dict({"step_number": 0})
            _STATE["refuse"] = True
        outcomes += [_outcome(ft, _exchange) for _ in range(2)]
        return outcomes
    finally:
        _STATE.pop("refuse", None)
        ft.close()


def run_close_after_a_failed_collective(g: Gang, store: str) -> dict[str, Any]:
    """A fresh gang whose timeout is an hour: the last rank's all_reduce fails (the seam) while the
    others wait in theirs, then every rank closes its gang. ``close()`` waits for the dropped
    groups to be destroyed: a member still waiting in the all_reduce is released only when the
    peers it waits on (which failed on their own) really close their connections."""
    ft = _join(g, store, timeout=timedelta(hours=1))
    try:
        with _fault(g.size - 1, "all_reduce"):
            outcome = _outcome(ft, _exchange)
    finally:
        ft.close()
    return outcome


def run_ddp_buckets(g: Gang, store: str) -> dict[str, Any]:
    """One DDP step over this rank's replica gang with ``bucket_cap_mb`` so small that every
    parameter gets its own gradient bucket; each rank trains on its own batch. Returns the
    gradients DDP left (averaged over the quorum by ``replicate_ddp``'s hook), the gradients of a
    plain copy of the model on the same batch, and how many all-gathers the step ran (one per
    bucket, counted through the test-only seam)."""
    ft = replica_gang(g, store)
    torch.manual_seed(7)
    layers = [torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)]
    plain = torch.nn.Sequential(*layers)
    model = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(plain), process_group=ft.as_process_group(), init_sync=False, bucket_cap_mb=1e-5
    )
    ft.replicate_ddp(model)
    data = torch.Generator().manual_seed(100 + g.rank)
    x, y = torch.randn(8, 6, generator=data), torch.randn(8, 3, generator=data)
    ((plain(x) - y) ** 2).mean().backward()
    gathers = []

    def count(gang: ReplicaGang, op: str) -> None:
        gathers.append(op)

    replica_module._fault_hook = count
    try:
        with ft.step():
            ((model(x) - y) ** 2).mean().backward()
            committed = ft.should_commit()
    finally:
        replica_module._fault_hook = None
    return {
        "committed": committed,
        "gathers": gathers,
        "ddp": [p.grad for p in model.parameters()],
        "plain": [p.grad for p in plain.parameters()],
    }


def run_stalled_log(g: Gang, store: str) -> list[dict[str, Any]]:
    """Two replicas of two processes each (world ranks 0-1 are replica ``a``, 2-3 replica ``b``).
    Every process joins; ``b`` then waits (live, heartbeating) while ``a`` runs one step, whose
    quorum waits ``quorum_timeout`` for ``b`` and goes on without it. Returns the ``stalled``
    records this process logged on the ``gang.ft`` logger (their ``record.gang_ft`` fields)."""
    records: list[dict[str, Any]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "gang_ft", {})
            if fields.get("event") == "stalled":
                records.append(fields)

    handler = Keep()
    logging.getLogger("gang.ft").addHandler(handler)
    mine = "a" if g.rank < 2 else "b"
    ft = ReplicaGang.join(
        replica_id=mine,
        replica_rank=g.rank % 2,
        replica_size=2,
        store=store,
        state_dict=_state,
        load_state_dict=_load,
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=1),
        heartbeat_timeout=timedelta(seconds=20),  # b stays live on a loaded machine
    )
    try:
        g.barrier()  # every process registered: a's round waits for b
        if mine == "a":
            with ft.step():
                assert ft.quorum == ("a",) and ft.should_commit()
        g.barrier()  # b stays live until a's step is over
    finally:
        ft.close()
        logging.getLogger("gang.ft").removeHandler(handler)
    return records
