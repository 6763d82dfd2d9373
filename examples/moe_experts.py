"""An expert-parallel top-k mixture-of-experts layer over ``gangs.ep``, built on ``gang.exchange_rows``.

Each rank of the expert-parallel gang holds ``EXPERTS_PER_RANK`` experts and its own tokens (a
different number on each rank, none on one of them). The router (the same on every rank) picks
the top ``TOP_K`` experts of each token. The layer then:

1. *dispatches*: sorts the (token, expert) pairs by expert and sends each row to the rank that holds
   its expert with ``exchange_rows`` (which exchanges the row counts first, then the rows), and the
   experts' local indices with ``all_to_all_uneven`` and the counts ``exchange_rows`` returned;
2. runs each received row through its expert;
3. *combines*: sends the results back with ``exchange_rows`` again (the reverse exchange) and sums
   them per token, weighted by the router's gates.

Both exchanges are wrapped in a ``torch.autograd.Function`` whose backward runs the reverse
exchange (``all_to_all_uneven`` with the two split lists swapped), so the layer trains. The outputs
and all gradients (the tokens', every expert's, the router's summed over the gang) are compared with
a dense single-process reference that holds every expert and every token. Run it with plain
``python`` (4 local processes; ``--ep 2`` for two expert-parallel gangs of 2).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

import gang
from gang import Gang, ReduceOperation, create_parallel_gangs
from gang.testing import spawn

WIDTH = 8
EXPERTS_PER_RANK = 2
TOP_K = 2
TOKENS = (5, 0, 3, 8, 1, 6, 0, 2)
"""Tokens on each rank of the expert-parallel gang (rank ``r`` has ``TOKENS[r % len(TOKENS)]``)."""


def tokens_of(rank: int) -> Tensor:
    """The tokens of rank ``rank`` of the expert-parallel gang (also what the reference concatenates)."""
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(TOKENS[rank % len(TOKENS)], WIDTH, generator=g, dtype=torch.float64)


def make_expert(index: int) -> nn.Module:
    """Expert ``index`` (global numbering), initialised the same way wherever it is made."""
    torch.manual_seed(100 + index)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH, dtype=torch.float64), nn.Tanh())


def make_router(experts: int, starve: int | None) -> nn.Linear:
    """The router (the same on every rank); with ``starve``, the experts of that rank are never picked."""
    torch.manual_seed(0)
    router = nn.Linear(WIDTH, experts, dtype=torch.float64)
    if starve is not None:
        with torch.no_grad():
            router.bias[starve * EXPERTS_PER_RANK : (starve + 1) * EXPERTS_PER_RANK] = -1e4
    return router


class ExchangeRows(torch.autograd.Function):
    """``gang.exchange_rows`` with a backward: the gradients go back by the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, ep: Gang, input_splits: list[int]) -> tuple[Tensor, Tensor]:
        output, output_splits = gang.exchange_rows(ep, rows, input_splits)
        ctx.ep, ctx.splits = ep, (list(input_splits), list(output_splits))
        counts = torch.tensor(output_splits, dtype=torch.int64)
        ctx.mark_non_differentiable(counts)
        return output, counts

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _counts: Tensor | None) -> tuple[Tensor, None, None]:
        input_splits, output_splits = ctx.splits
        grad_rows = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        # The reverse exchange: what arrived from rank i goes back to rank i.
        ctx.ep.all_to_all_uneven(grad_rows, grad.contiguous(), input_splits, output_splits)
        return grad_rows, None, None


def exchange(ep: Gang, rows: Tensor, input_splits: list[int]) -> tuple[Tensor, list[int]]:
    """Send ``rows`` (``input_splits[j]`` to rank ``j``), differentiably; return the rows received and their counts."""
    output, counts = ExchangeRows.apply(rows, ep, input_splits)  # type: ignore[no-untyped-call]
    return output, counts.tolist()


class MoE(nn.Module):
    """A top-``TOP_K`` mixture-of-experts layer whose experts are spread over the ranks of ``ep``."""

    def __init__(self, ep: Gang, starve: int | None = None) -> None:
        super().__init__()
        self.ep = ep
        self.router = make_router(ep.size * EXPERTS_PER_RANK, starve)
        first = ep.rank * EXPERTS_PER_RANK
        self.experts = nn.ModuleList(make_expert(first + e) for e in range(EXPERTS_PER_RANK))
        self.received = 0
        """How many rows the last forward sent to this rank's experts."""

    def forward(self, x: Tensor) -> Tensor:
        ep = self.ep
        top, chosen = self.router(x).topk(TOP_K, dim=-1)
        gates = top.softmax(dim=-1).reshape(-1)  # per (token, choice)
        experts = chosen.reshape(-1)
        order = torch.argsort(experts, stable=True)  # the (token, choice) pairs, by expert
        token = order // TOP_K
        owner = experts[order] // EXPERTS_PER_RANK
        input_splits = torch.bincount(owner, minlength=ep.size).tolist()

        # Dispatch: each row to its expert's rank, and which of that rank's experts it is for.
        received, output_splits = exchange(ep, x[token], input_splits)
        self.received = received.shape[0]
        local = torch.empty(received.shape[0], dtype=torch.int64)
        ep.all_to_all_uneven(local, experts[order] % EXPERTS_PER_RANK, output_splits, input_splits)

        # Each received row through its expert.
        results = torch.zeros_like(received)
        for e, expert in enumerate(self.experts):
            rows = (local == e).nonzero().squeeze(1)
            results = results.index_copy(0, rows, expert(received[rows]))

        # Combine: the results go back (the reverse exchange), weighted by the gates, summed per token.
        back, counts = exchange(ep, results, output_splits)
        assert counts == input_splits
        return torch.zeros_like(x).index_add(0, token, back * gates[order].unsqueeze(1))


def dense(x: Tensor, router: nn.Linear, experts: Sequence[nn.Module]) -> Tensor:
    """The reference: every token through its top-``TOP_K`` experts, in one process."""
    top, chosen = router(x).topk(TOP_K, dim=-1)
    gates = top.softmax(dim=-1)
    out = torch.zeros_like(x)
    for choice in range(TOP_K):
        for index, expert in enumerate(experts):
            picked = chosen[:, choice] == index
            contribution = expert(x) * (gates[:, choice] * picked).unsqueeze(1)
            out = out + contribution
    return out


def loss_of(y: Tensor, rank: int) -> Tensor:
    """This rank's part of the loss (the loss is their sum over the ranks)."""
    g = torch.Generator().manual_seed(50 + rank)
    target = torch.randn(y.shape, generator=g, dtype=torch.float64)
    return ((y - target) ** 2).sum()


def compare(ep: Gang, starve: int | None = None) -> tuple[list[str], int]:
    """Run the layer forward and backward on ``ep``; return what differs from the dense reference (empty: equal).

    Also returns how many rows this rank's experts received.
    """
    moe = MoE(ep, starve)
    x = tokens_of(ep.rank).requires_grad_()
    y = moe(x)
    loss_of(y, ep.rank).backward()  # type: ignore[no-untyped-call]
    router_grad = moe.router.weight.grad
    assert router_grad is not None
    ep.all_reduce(router_grad, ReduceOperation.SUM)  # the router is replicated: its gradient is summed

    # The reference sees every rank's tokens and holds every expert.
    router = make_router(ep.size * EXPERTS_PER_RANK, starve)
    experts = [make_expert(index) for index in range(ep.size * EXPERTS_PER_RANK)]
    xs = [tokens_of(rank).requires_grad_() for rank in range(ep.size)]
    ys = torch.split(dense(torch.cat(xs), router, experts), [len(t) for t in xs])
    torch.stack([loss_of(y_r, rank) for rank, y_r in enumerate(ys)]).sum().backward()  # type: ignore[no-untyped-call]

    problems = []

    def differs(what: str, ours: Tensor | None, theirs: Tensor | None) -> None:
        ours = torch.zeros_like(theirs) if ours is None and theirs is not None else ours
        theirs = torch.zeros_like(ours) if theirs is None and ours is not None else theirs
        if ours is not None and theirs is not None and not torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12):
            problems.append(f"ep rank {ep.rank}: {what} differs by {(ours - theirs).abs().max()}")

    differs("output", y.detach(), ys[ep.rank].detach())
    differs("token gradient", x.grad, xs[ep.rank].grad)
    differs("router gradient", router_grad, router.weight.grad)
    for e, expert in enumerate(moe.experts):
        theirs = experts[ep.rank * EXPERTS_PER_RANK + e]
        for (name, p), q in zip(expert.named_parameters(), theirs.parameters(), strict=True):
            differs(f"expert {ep.rank * EXPERTS_PER_RANK + e} {name} gradient", p.grad, q.grad)
    return problems, moe.received


CASES = {"every expert chosen": None, "the last rank's experts never chosen": -1}
"""The two router set-ups the example runs: the value is the ep rank whose experts are starved (-1: the last)."""


def check(root: Gang, ep_size: int) -> dict[str, Any]:
    """Split ``root`` with ``ep_size`` and run :func:`compare` on ``gangs.ep`` for each of :data:`CASES`.

    Returns this rank's place in its ep gang, its token count, and per case what differs (empty lists:
    equal) and how many rows its experts received.
    """
    ep = create_parallel_gangs(root, ep_size=ep_size).ep
    runs = {case: compare(ep, None if starve is None else starve % ep.size) for case, starve in CASES.items()}
    return {
        "ep_rank": ep.rank,
        "tokens": TOKENS[ep.rank % len(TOKENS)],
        "problems": {case: problems for case, (problems, _) in runs.items()},
        "received": {case: received for case, (_, received) in runs.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="local processes")
    parser.add_argument("--ep", type=int, default=4, help="expert parallel size")
    args = parser.parse_args()
    results = spawn(check, args.nproc, args.ep)
    print(f"ep={args.ep}, tokens per rank {[result['tokens'] for result in results]}")
    bad = 0
    for case in CASES:
        problems = [problem for result in results for problem in result["problems"][case]]
        print(
            f"{case}: " + ("outputs and gradients equal the dense reference" if not problems else "\n".join(problems))
        )
        bad += len(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    # The local processes unpickle `check` by module name: make this file importable, run it as that.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(importlib.import_module("moe_experts").main())
