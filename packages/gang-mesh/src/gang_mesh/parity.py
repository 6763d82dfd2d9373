"""A tiny decoder-only transformer and an FSDP2 (+ tensor parallel) training loop, to check meshes by parity.

Train the model on a mesh from :func:`gang_mesh.to_device_mesh` and on the equivalent
``init_device_mesh`` mesh (:func:`equivalent_init_mesh`) and compare the losses bit for bit: the
repository's parity tests, its ``examples/fsdp_tp_training.py`` and its mesh benchmark do exactly
that. Everything is deterministic: same seed, same data, same reductions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of :class:`TinyTransformer`."""

    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 2
    hidden: int = 64
    seq: int = 16


class Attention(nn.Module):
    """Causal self-attention; with tensor parallelism each rank holds some of the heads."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.heads
        self.q = nn.Linear(config.dim, config.dim, bias=False)
        self.k = nn.Linear(config.dim, config.dim, bias=False)
        self.v = nn.Linear(config.dim, config.dim, bias=False)
        self.o = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        # -1 heads: the local head count, which tensor parallelism divides.
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.o(y.transpose(1, 2).reshape(batch, seq, -1))
        return out


class FeedForward(nn.Module):
    """Two linear layers with a GELU between them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.dim, config.hidden)
        self.down = nn.Linear(config.hidden, config.dim)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down(functional.gelu(self.up(x)))
        return out


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.dim)
        self.ffn = FeedForward(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        out: Tensor = x + self.ffn(self.norm2(x))
        return out


class TinyTransformer(nn.Module):
    """Token and position embeddings, a few blocks, a final norm and an output projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.pos = nn.Parameter(torch.randn(config.seq, config.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.out = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.out(self.norm(x))
        return logits


def parallelize(model: TinyTransformer, mesh: DeviceMesh) -> TinyTransformer:
    """Apply tensor parallelism on the ``tp`` dimension, then FSDP2 (or HSDP) on the others.

    :param model: The model, identically initialised on every rank.
    :param mesh: A mesh whose dimension names are among ``rdp, sdp, dp, tp``.
    """
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(),
            "ffn.up": ColwiseParallel(),
            "ffn.down": RowwiseParallel(),
        }
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
    dp_names = tuple(name for name in names if name != "tp")
    if dp_names:
        dp_mesh = mesh[dp_names]
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def data_parallel_index(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's data-parallel replica index and the replica count (tensor parallel ranks share data)."""
    index, count = 0, 1
    for i, name in enumerate(mesh.mesh_dim_names or ()):
        if name != "tp":
            index = index * mesh.size(i) + mesh.get_local_rank(name)
            count *= mesh.size(i)
    return index, count


def batch_for(step: int, replica: int, batch_size: int, config: ModelConfig) -> Tensor:
    """The tokens of one replica at one step (a fixed, learnable pattern plus noise)."""
    generator = torch.Generator().manual_seed(1000 * step + replica)
    start = torch.randint(0, config.vocab, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
    return (start + stride * torch.arange(config.seq + 1)) % config.vocab


@dataclass
class TrainResult:
    """Per-step losses (this rank's local batch) and the tokens per second of the whole mesh."""

    losses: list[float]
    tokens_per_second: float


def train(
    mesh: DeviceMesh,
    *,
    steps: int = 5,
    batch_size: int = 2,
    seed: int = 0,
    config: ModelConfig | None = None,
    on_step: Callable[[int, float, float], None] | None = None,
) -> TrainResult:
    """Build the model from ``seed``, parallelize it over ``mesh`` and train it for ``steps`` steps.

    :param mesh: See :func:`parallelize`.
    :param steps: Optimizer steps.
    :param batch_size: Sequences per data-parallel replica and step.
    :param seed: The initialisation seed, the same on every rank.
    :param config: Model sizes.
    :param on_step: Called after each step with the step, this rank's loss and the step's tokens/s
        over the whole mesh.
    """
    config = config or ModelConfig()
    torch.manual_seed(seed)
    model = parallelize(TinyTransformer(config), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    replica, replicas = data_parallel_index(mesh)
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(steps):
        step_started = time.perf_counter()
        tokens = batch_for(step, replica, batch_size, config)
        logits = model(tokens[:, :-1])
        loss = functional.cross_entropy(logits.reshape(-1, config.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            step_time = max(time.perf_counter() - step_started, 1e-9)
            on_step(step, losses[-1], replicas * batch_size * config.seq / step_time)
    elapsed = time.perf_counter() - started
    return TrainResult(losses, steps * replicas * batch_size * config.seq / max(elapsed, 1e-9))


def equivalent_init_mesh(dims: Sequence[str], shape: Sequence[int]) -> DeviceMesh:
    """The ``init_device_mesh`` mesh with the same names and shape (on the CPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(dims))
