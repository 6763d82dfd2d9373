"""The deterministic model, data and update rule shared by the ft replicas and their reference."""

from __future__ import annotations

import zlib

import torch
from torch import Tensor

IN, OUT, BATCH = 8, 4, 16
LR = 0.05


def initial_params() -> Tensor:
    """The flat parameters (weight then bias) every replica starts from."""
    return torch.randn(IN * OUT + OUT, generator=torch.Generator().manual_seed(1234))


def batch(replica_id: str, step: int) -> tuple[Tensor, Tensor]:
    """The batch replica ``replica_id`` trains on in step ``step`` (the same after a restart)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{replica_id}/{step}".encode()))
    x = torch.randn(BATCH, IN, generator=g)
    return x, x @ torch.ones(IN, OUT) + torch.randn(BATCH, OUT, generator=g)


def gradient(params: Tensor, replica_id: str, step: int) -> Tensor:
    """The gradient of the mean squared error of ``replica_id``'s batch of ``step`` at ``params``."""
    p = params.detach().clone().requires_grad_(True)
    x, y = batch(replica_id, step)
    weight, bias = p[: IN * OUT].view(IN, OUT), p[IN * OUT :]
    loss = ((x @ weight + bias - y) ** 2).mean()
    (grad,) = torch.autograd.grad(loss, p)
    return grad


def update(params: Tensor, table: Tensor) -> Tensor:
    """One SGD step from the gathered gradients (one row per member, in rank order)."""
    return params - LR * (table.sum(0) / table.shape[0])


def reference(schedule: list[list[str]]) -> Tensor:
    """Replay committed steps ``1..len(schedule)`` in one process; entry ``s - 1`` lists step ``s``'s members."""
    params = initial_params()
    for step, members in enumerate(schedule, start=1):
        params = update(params, torch.stack([gradient(params, m, step) for m in members]))
    return params
