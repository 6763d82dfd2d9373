"""Run on every rank by ``test_pipelining.py``: torch's own pipelining over ``gangs.pp``.

Each rank builds its stage of a small float64 model, runs a few training steps with
``torch.distributed.pipelining`` (``PipelineStage(..., group=gangs.pp.as_process_group())``), averages
the gradients over ``gangs.dp`` and takes an SGD step. In the same process it trains the unsplit
model on the whole batch and reports both, so the test can compare losses and gradients step by step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from gang import Gang, Gangs, ReduceOperation, create_parallel_gangs

WIDTH = 6
LAYERS = 4
BATCH = 16
MICROBATCHES = 4
STEPS = 3
LR = 0.1

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

_GANGS: dict[tuple[int, int], Gangs] = {}


def _gangs(root: Gang, pp: int) -> Gangs:
    key = (id(root), pp)
    if key not in _GANGS:
        _GANGS[key] = create_parallel_gangs(root, pp_size=pp)
    return _GANGS[key]


def unsplit_model() -> nn.Sequential:
    """The whole model: ``LAYERS`` blocks of ``Linear + Tanh``, float64, the same on every rank."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH, dtype=torch.float64), nn.Tanh()) for _ in range(LAYERS)]
    return nn.Sequential(*blocks)


def batch(step: int) -> tuple[Tensor, Tensor]:
    """The global batch of ``step`` (inputs and targets), the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error: a mean, so the schedules' default ``scale_grads=True`` matches it."""
    return ((output - target) ** 2).mean()


def reference(blocks: range) -> tuple[list[float], list[dict[str, Tensor]]]:
    """Train the unsplit model on whole batches; per step the loss and the gradients of ``blocks``."""
    model = unsplit_model()
    losses: list[float] = []
    grads = []
    for step in range(STEPS):
        x, y = batch(step)
        model.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(loss.item())
        grads.append(_grads(nn.Sequential(*(model[block] for block in blocks)), blocks))
        _sgd(model)
    return losses, grads


def _grads(held: nn.Sequential, blocks: range) -> dict[str, Tensor]:
    """The gradients of ``held`` (the model's ``blocks``, in order), named by block."""
    out = {}
    for block, module in zip(blocks, held, strict=True):
        for name, param in module.named_parameters():
            assert param.grad is not None
            out[f"{block}.{name}"] = param.grad.clone()
    return out


def _sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            assert param.grad is not None
            param.sub_(LR * param.grad)


def pipelined(root: Gang, pp: int, schedule: str) -> dict[str, Any]:
    """Train through torch's pipelining over ``gangs.pp`` (``dp = root.size / pp``); report it and the reference.

    Returns this rank's stage, its per-step losses (the last stage's: the mean of its microbatches,
    then over ``dp``; ``None`` elsewhere) and gradients, and the unsplit model's of the same blocks.
    """
    gangs = _gangs(root, pp)
    stage_index, dp = gangs.pp.rank, gangs.dp
    per_stage = LAYERS // pp
    blocks = range(stage_index * per_stage, (stage_index + 1) * per_stage)
    whole = unsplit_model()
    module = nn.Sequential(*(whole[block] for block in blocks))
    stage = PipelineStage(module, stage_index, pp, root.device, group=gangs.pp.as_process_group())
    runner = SCHEDULES[schedule](stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)

    rows = BATCH // dp.size
    losses: list[float | None] = []
    grads = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[dp.rank * rows : (dp.rank + 1) * rows], y[dp.rank * rows : (dp.rank + 1) * rows]
        module.zero_grad()
        micro: list[Tensor] = []
        if stage.is_first:
            runner.step(x)
        elif stage.is_last:
            runner.step(target=y, losses=micro)
        else:
            runner.step()
        for param in module.parameters():
            assert param.grad is not None
            dp.all_reduce(param.grad, ReduceOperation.MEAN)
        if stage.is_last:
            loss = torch.stack(micro).mean()
            dp.all_reduce(loss, ReduceOperation.MEAN)
            losses.append(loss.item())
        else:
            losses.append(None)
        grads.append(_grads(module, blocks))
        _sgd(module)

    ref_losses, ref_grads = reference(blocks)
    return {
        "stage": stage_index,
        "dp_size": dp.size,
        "losses": losses,
        "grads": grads,
        "reference_losses": ref_losses,
        "reference_grads": ref_grads,
    }
