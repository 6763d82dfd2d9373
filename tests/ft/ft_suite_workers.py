"""The conformance matrix and the bad-call catalogue run on a :class:`ReplicaGang` (rank functions).

Each rank of a :class:`gang.testing.World` joins its own replica (replica id = its rank, one
process per replica) through a coordination store the test started, and keeps that gang in a
module global across calls. A suite function runs inside one ``with gang.step():`` and returns
what it saw; the test compares it with the plain torch gang of the same world.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from conformance_workers import DTYPES, _run_one
from core_workers import try_call

from gang import Gang, ReduceOperation
from gang.ft import ReplicaGang

_GANG: dict[str, ReplicaGang] = {}
OPS = ["SUM", "MEAN", "PRODUCT", "MIN", "MAX"]
KINDS = ["all_gather", "all_gather_to_list", "all_to_all", "broadcast_first", "broadcast_last"]
SHAPES: list[tuple[int, ...]] = [(2, 3), (), (0,), (1, 1, 5)]


def _state() -> Mapping[str, Any]:
    return {}


def _load(state: Mapping[str, Any]) -> None:
    pass


def replica_gang(g: Gang, store: str) -> ReplicaGang:
    """This rank's :class:`ReplicaGang` (replica ``g.rank``, one process), joined on first use."""
    gang = _GANG.get(store)
    if gang is None or gang.closed:
        # Every World rank is its own replica of one process, whatever its launcher says.
        saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        try:
            gang = _GANG[store] = ReplicaGang.join(
                replica_id=g.rank,
                replica_rank=0,  # every rank of the World is a replica of its own
                replica_size=1,
                store=store,
                state_dict=_state,
                load_state_dict=_load,
                min_replicas=g.size,
                timeout=timedelta(seconds=20),
            )
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return gang


def cases() -> list[tuple[str, str | None, str, tuple[int, ...]]]:
    """Every (collective, reduction, dtype, shape) of the conformance matrix."""
    out: list[tuple[str, str | None, str, tuple[int, ...]]] = []
    for dtype in DTYPES:
        for op in OPS:
            if op == "MEAN" and dtype.startswith("int"):
                continue
            out += [("all_reduce", op, dtype, (2, 3)), ("reduce_scatter", op, dtype, (2, 3))]
        out += [(kind, None, dtype, (2, 3)) for kind in KINDS]
    out += [
        (kind, "SUM", "float32", shape)
        for kind in ("all_reduce", "all_gather", "broadcast_last")
        for shape in SHAPES[1:]
    ]
    return out


def run_conformance(g: Gang, store: str) -> dict[str, Any]:
    """Run every case on the plain gang and, inside one committed step, on the replica gang."""
    ft = replica_gang(g, store)
    plain = {repr(case): _run_one(g, case[0], _op(case[1]), DTYPES[case[2]], case[3]) for case in cases()}
    with ft.step():
        assert (ft.rank, ft.size) == (g.rank, g.size)
        replica = {repr(case): _run_one(ft, case[0], _op(case[1]), DTYPES[case[2]], case[3]) for case in cases()}
        objects: list[object] = [{"rank": ft.rank}, "x"] if ft.rank == 1 else [None, None]
        ft.broadcast_objects(objects, source_rank=1)
        ft.barrier()
        committed = ft.should_commit()
    return {"plain": plain, "replica": replica, "objects": objects, "committed": committed, "error": repr(ft.errored())}


def _op(name: str | None) -> ReduceOperation | None:
    return None if name is None else ReduceOperation[name]


def run_bad_calls(g: Gang, store: str, names: list[str]) -> dict[str, Any]:
    """Make every bad call inside one step; each is followed by an all_reduce proving all ranks go on."""
    ft = replica_gang(g, store)
    plain = {name: try_call(g, name) for name in names}
    with ft.step():
        replica = {name: try_call(ft, name) for name in names}
        committed = ft.should_commit()
    return {"plain": plain, "replica": replica, "committed": committed, "error": repr(ft.errored())}


def close(g: Gang, store: str) -> None:
    """Close this rank's replica gang."""
    gang = _GANG.pop(store, None)
    if gang is not None:
        gang.close()
