"""A pipeline written with ``Gang.send_recv`` alone: a 1F1B schedule that trains like the unsplit model.

Each rank of the pipeline gang holds one stage (a ``Linear + Tanh`` block) of a small float64
model. A training step splits the batch into microbatches and runs the one-forward-one-backward
(1F1B) schedule: each stage runs a few forwards to fill the pipeline, then alternates one forward
and one backward, then drains the backwards. Between two consecutive actions a stage makes *one*
``send_recv`` call that sends what the last action produced (an activation to the next stage after a
forward, a gradient to the previous stage after a backward) and receives what the next action needs
(an activation from the previous stage, a gradient from the next). ``send_recv`` posts both at once,
so two neighbours that send each other something in the same call never wait on each other.

The losses and every stage's gradients are compared with the unsplit model trained on the whole
batch in one process. Run it with plain ``python`` (it starts 4 local processes with a gloo
:class:`~gang.ProcessGroupGang`), or ``python examples/pipeline_send_recv.py --jax`` to run the same
code on a :class:`~gang_jax.JaxGang`. Under torchrun it uses the processes it was given.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gang import Gang, ProcessGroupGang
from gang.bench.collectives import without_gloo_notice
from gang.testing import launch

WIDTH = 8
ROWS = 2  # per microbatch
MICROBATCHES = 4
STEPS = 3
LR = 0.1


def schedule(stage: int, stages: int, microbatches: int = MICROBATCHES) -> list[tuple[str, int]]:
    """The 1F1B order of one stage's actions: ``("F", m)`` the forward of microbatch ``m``, ``("B", m)`` its backward.

    The stage first runs ``stages - 1 - stage`` forwards (the warm-up that fills the pipeline), then
    alternates one forward and one backward, then runs the backwards left.
    """
    warmup = min(stages - 1 - stage, microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(microbatches - warmup):
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(microbatches - warmup, microbatches)]


def make_block(index: int) -> nn.Module:
    """Block ``index`` of the model, initialised the same way on every rank."""
    torch.manual_seed(index)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH, dtype=torch.float64), nn.Tanh())


def batch(step: int) -> tuple[Tensor, Tensor]:
    """The whole batch of ``step``: inputs and targets, ``MICROBATCHES * ROWS`` rows."""
    g = torch.Generator().manual_seed(1000 + step)
    shape = (MICROBATCHES * ROWS, WIDTH)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error."""
    return ((output - target) ** 2).mean()


@dataclass
class Trained:
    """What one stage saw while training: per step, the loss (last stage only) and its gradients."""

    stage: int
    losses: list[float]
    grads: list[list[Tensor]]


class Stage:
    """One stage of the pipeline: its block, and what it keeps between a forward and its backward."""

    def __init__(self, pp: Gang) -> None:
        self.pp = pp
        self.index = pp.rank
        self.first, self.last = self.index == 0, self.index == pp.size - 1
        self.block = make_block(self.index)
        self.inputs: dict[int, Tensor] = {}
        self.outputs: dict[int, Tensor] = {}

    def forward(self, m: int, activation: Tensor, target: Tensor) -> Tensor:
        """Run microbatch ``m``; return what goes to the next stage (the last stage: the loss)."""
        x = activation.requires_grad_(not self.first)
        y: Tensor = self.block(x)
        if self.last:  # the mean over microbatches of the microbatch losses is the batch's loss
            y = loss_fn(y, target) / MICROBATCHES
        self.inputs[m], self.outputs[m] = x, y
        return y.detach()

    def backward(self, m: int, grad: Tensor | None) -> Tensor | None:
        """Back-propagate microbatch ``m``; return the gradient for the previous stage (none for the first)."""
        x, y = self.inputs.pop(m), self.outputs.pop(m)
        y.backward(grad)  # type: ignore[no-untyped-call]  # on the last stage `y` is the loss: no gradient
        return x.grad

    def train_step(self, x: Tensor, target: Tensor) -> float:
        """One step of 1F1B over the microbatches of ``x``; return the loss (0.0 but on the last stage)."""
        pp, xs, ys = self.pp, x.chunk(MICROBATCHES), target.chunk(MICROBATCHES)
        prev_rank, next_rank = self.index - 1, self.index + 1
        actions = schedule(self.index, pp.size)
        loss = 0.0
        produced: tuple[Tensor, int] | None = None  # what the last action sends, and to whom
        for kind, m in actions:
            # One call: send what the last action produced, receive what this action needs.
            sends = [] if produced is None else [produced]
            needed = torch.empty(ROWS, WIDTH, dtype=torch.float64)
            if kind == "F" and not self.first:
                recvs = [(needed, prev_rank)]
            elif kind == "B" and not self.last:
                recvs = [(needed, next_rank)]
            else:
                recvs = []
            pp.send_recv(sends, recvs)
            if kind == "F":
                out = self.forward(m, xs[m].clone() if self.first else needed, ys[m])
                loss += out.item() if self.last else 0.0
                produced = None if self.last else (out, next_rank)
            else:
                grad = self.backward(m, None if self.last else needed)
                produced = None if grad is None else (grad, prev_rank)
        if produced is not None:  # the first stage's last backward sends nothing; others send their last gradient
            pp.send_recv([produced])
        return loss

    def sgd(self) -> list[Tensor]:
        """Take an SGD step; return the gradients it used."""
        grads = []
        with torch.no_grad():
            for param in self.block.parameters():
                assert param.grad is not None
                grads.append(param.grad.clone())
                param.sub_(LR * param.grad)
                param.grad = None
        return grads


def train(pp: Gang, steps: int = STEPS) -> Trained:
    """Train this rank's stage of the pipeline over ``pp`` (one stage per rank) for ``steps`` steps."""
    stage = Stage(pp)
    losses, grads = [], []
    for step in range(steps):
        losses.append(stage.train_step(*batch(step)))
        grads.append(stage.sgd())
    return Trained(pp.rank, losses, grads)


def reference(stages: int, steps: int = STEPS) -> list[Trained]:
    """Train the unsplit model (every block in one process, the whole batch at once), reported per stage."""
    blocks = [make_block(index) for index in range(stages)]
    model = nn.Sequential(*blocks)
    losses, grads = [], []
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(loss.item())
        per_block = []
        with torch.no_grad():
            for block in blocks:
                per_block.append([p.grad.clone() for p in block.parameters() if p.grad is not None])
                for p in block.parameters():
                    assert p.grad is not None
                    p.sub_(LR * p.grad)
                    p.grad = None
        grads.append(per_block)
    return [Trained(s, losses if s == stages - 1 else [0.0] * steps, [g[s] for g in grads]) for s in range(stages)]


def mismatches(trained: Trained, expected: Trained) -> list[str]:
    """What differs between a stage's training and the unsplit model's (float64: within 1e-12)."""
    out = []
    for step, (ours, theirs) in enumerate(zip(trained.losses, expected.losses, strict=True)):
        if abs(ours - theirs) > 1e-12 * max(1.0, abs(theirs)):
            out.append(f"stage {trained.stage}, step {step}: loss {ours} != {theirs}")
    for step, (ours_g, theirs_g) in enumerate(zip(trained.grads, expected.grads, strict=True)):
        for index, (a, b) in enumerate(zip(ours_g, theirs_g, strict=True)):
            if not torch.allclose(a, b, rtol=1e-12, atol=1e-14):
                out.append(f"stage {trained.stage}, step {step}: gradient {index} differs by {(a - b).abs().max()}")
    return out


def check(pp: Gang) -> list[str]:
    """Train over ``pp`` and return what differs from the unsplit model (empty: equal)."""
    return mismatches(train(pp), reference(pp.size)[pp.rank])


def _worker(use_jax: bool) -> tuple[Trained, list[str]]:
    if use_jax:
        from gang_jax import JaxGang

        gang: Gang = JaxGang.create_default()
    else:
        gang = ProcessGroupGang.create_default_process_group(torch.device("cpu"))
    with gang, without_gloo_notice():  # the line JAX's CPU collectives print when they connect
        trained = train(gang)
        return trained, mismatches(trained, reference(gang.size)[gang.rank])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jax", action="store_true", help="run the pipeline on a JaxGang")
    parser.add_argument("--nproc", type=int, default=4, help="the number of stages (local processes)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun: this process is one stage
        results = [_worker(args.jax)]
        stages = int(os.environ["WORLD_SIZE"])
    else:
        results = launch(_worker, args.nproc, args.jax)
        stages = args.nproc
    kind = "JaxGang" if args.jax else "ProcessGroupGang"
    for trained, problems in results:
        if trained.stage == stages - 1:
            print(f"{kind}, {stages} stages: loss per step {[round(loss, 6) for loss in trained.losses]}")
        for problem in problems:
            print(problem)
    bad = sum(len(problems) for _, problems in results)
    print(f"{bad} mismatches" if bad else "losses and gradients equal the unsplit model")
    return 1 if bad else 0


if __name__ == "__main__":
    if "RANK" not in os.environ:
        # The local processes unpickle `_worker` by module name: make this file importable.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        sys.exit(importlib.import_module("pipeline_send_recv").main())
    sys.exit(main())
