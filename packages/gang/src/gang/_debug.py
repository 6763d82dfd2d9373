"""Debug mode (:attr:`gang.Gang.debug`): the checks across ranks that every call is the same call.

The public methods of :class:`~gang.Gang` run these after their argument checks and before the
operation, while the gang's debug mode is on; a kind of gang that adds operations of its own
(:class:`gang_jax.JaxGang`'s JAX programs) runs :func:`verify_same_call` the same way.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gang.errors import GangError
from gang.extend import all_gather_bytes, check_values_exchangeable
from gang.work import _block

if TYPE_CHECKING:
    from gang.gang import Gang


def debug_from_env() -> bool:
    """Return whether the environment variable ``GANG_DEBUG`` turns debug mode on (``1``, ``true``, ``yes``, ``on``;
    any case, surrounding spaces ignored)."""
    return os.environ.get("GANG_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def verify_same_call(gang: Gang, call: str, detail: str = "") -> list[str]:
    """Debug mode: exchange a description of the call; raise on every rank if they differ.

    The exchange is the same two all-gathers on every rank whatever each rank called, so
    mismatched ranks meet here instead of deadlocking in different collectives. ``detail``
    travels with the call but may differ between ranks; every rank's is returned.
    """
    check_values_exchangeable(gang, "debug mode")

    def gather(output_tensor: Tensor, input_tensor: Tensor) -> None:
        _block(gang._all_gather(output_tensor, input_tensor, False))

    rows = all_gather_bytes(gang, f"{call}\0{detail}".encode(), gather=gather)
    texts = [(row or b"").decode(errors="replace").split("\0", 1) for row in rows]
    calls = [text[0] for text in texts]
    if len(set(calls)) > 1:
        listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
        raise GangError(
            f"Debug mode: the ranks of a gang of size {gang.size} made different calls "
            f"(this is rank {gang.rank}): {listing}."
        )
    return [text[-1] if len(text) > 1 else "" for text in texts]


def verify_splits(gang: Gang, output: Tensor, output_splits: list[int], input_splits: list[int]) -> None:
    """Debug mode: check on every rank that rank i's ``input_splits[j]`` is rank j's ``output_splits[i]``."""
    call = f"all_to_all_uneven({spec(output, rows='*')})"
    details = verify_same_call(gang, call, json.dumps([input_splits, output_splits]))
    if gang._assumes_same_data:
        return  # every simulated rank made this rank's call: its own checks are in its `_all_to_all_uneven`
    table = [json.loads(d) for d in details]
    wrong = [
        f"rank {i} sends {table[i][0][j]} rows to rank {j}, but rank {j} receives {table[j][1][i]} rows from rank {i}"
        for i in range(gang.size)
        for j in range(gang.size)
        if table[i][0][j] != table[j][1][i]
    ]
    if wrong:
        raise GangError(
            f"Debug mode: the splits of `all_to_all_uneven` do not match across the ranks of a gang of size "
            f"{gang.size} (this is rank {gang.rank}): {'; '.join(wrong)}."
        )


def verify_pairs(gang: Gang, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> None:
    """Debug mode: exchange with each peer what this rank sends it and receives from it; raise on both sides
    if they differ.

    Each side posts one send and one receive of its description per peer (lengths first,
    then the text), so the two meet whatever each called. A peer that makes no matching call
    at all is not seen here: the exchange then fails at the gang's timeout.
    """
    if gang._assumes_same_data:
        return  # the simulated peers make the matching calls
    check_values_exchangeable(gang, "debug mode")
    peers = sorted({p for _, p in sends} | {p for _, p in recvs})
    if not peers:
        return
    mine = {p: [[spec(t) for t, q in sends if q == p], [spec(t) for t, q in recvs if q == p]] for p in peers}
    payloads = {p: json.dumps(mine[p]).encode() for p in peers}
    lengths = {p: torch.tensor([len(payloads[p])], dtype=torch.int64, device=gang.device) for p in peers}
    theirs = {p: torch.zeros(1, dtype=torch.int64, device=gang.device) for p in peers}
    _block(gang._send_recv([(lengths[p], p) for p in peers], [(theirs[p], p) for p in peers], False, "debug mode"))
    texts = {p: torch.frombuffer(bytearray(payloads[p]), dtype=torch.uint8).to(gang.device) for p in peers}
    received = {p: torch.zeros(int(theirs[p].item()), dtype=torch.uint8, device=gang.device) for p in peers}
    _block(
        gang._send_recv(
            [(texts[p], p) for p in peers if texts[p].numel()],
            [(received[p], p) for p in peers if received[p].numel()],
            False,
            "debug mode",
        )
    )
    wrong = []
    for p in peers:
        other = json.loads(bytes(received[p].cpu().numpy().tobytes()).decode(errors="replace") or "[[], []]")
        if mine[p][0] != other[1]:
            wrong.append(pair_mismatch(gang.rank, p, mine[p][0], other[1]))
        if other[0] != mine[p][1]:
            wrong.append(pair_mismatch(p, gang.rank, other[0], mine[p][1]))
    if wrong:
        raise GangError(f"Debug mode: point-to-point calls do not match: {'; '.join(wrong)}.")


def spec(t: Tensor, rows: str | None = None) -> str:
    """``float32[4, 8]``: a tensor's dtype and shape as debug mode's messages name them (``rows`` replaces dim 0)."""
    dims = [str(n) for n in t.shape]
    if rows is not None and dims:
        dims[0] = rows
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(dims)}]"


def pair_mismatch(sender: int, receiver: int, sent: list[str], received: list[str]) -> str:
    """How debug mode names the transfers from ``sender`` to ``receiver`` that do not match."""
    return (
        f"rank {sender} sends {', '.join(sent) or 'nothing'} to rank {receiver}, "
        f"but rank {receiver} receives {', '.join(received) or 'nothing'} from rank {sender}"
    )


def describe(t: Tensor) -> str:
    """``shape=[4, 8], dtype=float32``: a tensor as debug mode's comparison of collective calls names it."""
    return f"shape={list(t.shape)}, dtype={str(t.dtype).removeprefix('torch.')}"
