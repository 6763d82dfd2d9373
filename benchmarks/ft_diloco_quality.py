"""What quantizing DiLoCo's exchange costs in quality, on a small language-model-like task.

``python -m benchmarks.ft_diloco_quality [--out results.json] [--plot PATH]`` trains one model
four ways on the same tokens and writes ``<out stem>_ft_diloco_quality.json`` and a PNG of the
loss curves (``--plot``; by default next to the JSON):

* **data parallel**: synchronous data parallelism, one AdamW step per step on the mean gradient of
  the 3 replicas' batches;
* **DiLoCo** with ``quantize=None``, ``"int8"`` and ``"float8"``: 3 replicas, each AdamW on its own
  batches, syncing every ``SYNC_EVERY`` local steps with an outer SGD (Nesterov momentum).

The task: sequences from a fixed random order-2 Markov chain over ``VOCAB`` tokens (each pair of
previous tokens allows ``BRANCH`` next tokens with fixed Zipf-like probabilities: the best possible
loss is the chain's entropy, ``entropy`` in the JSON); the model is a 2-layer MLP over the
embeddings of the last ``CONTEXT`` tokens predicting the next (``params`` in the JSON, a few MB in
``float32``). Replica ``r`` trains on its own stream; the loss reported is the cross entropy of the
global model (data parallel: the model) on a fixed held-out batch, after every outer step.

The 3 replicas are simulated in one process. The arithmetic is the real exchange's: the
pseudo-gradients (global minus local parameters, ``float32``) are averaged as
:class:`gang.ft.DiLoCo` averages them, full precision summed in rank order and divided,
quantized by :func:`gang.ft.quantize.reference_mean`, which the real exchange equals bit for bit
(its tests run it on real processes against the same function), then the outer optimizer steps
from the global parameters with that average as their gradient. Runs in about a minute on one
CPU core.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional

from gang.ft.quantize import reference_mean

REPLICAS = 3
VOCAB = 64
CONTEXT = 8
EMBED = 32
HIDDEN = 2048
BRANCH = 4
BATCH = 64
"""Examples per replica per local step."""
STEPS = 300
"""Local (inner) steps."""
SYNC_EVERY = 25
INNER_LR, OUTER_LR, MOMENTUM = 1e-3, 0.7, 0.9
EVAL_BATCH = 4096
RUNS = ("data_parallel", "diloco", "diloco_int8", "diloco_float8")


class Chain:
    """The order-2 Markov chain the tokens come from (fixed by its seed)."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.next = torch.stack([torch.randperm(VOCAB, generator=g)[:BRANCH] for _ in range(VOCAB * VOCAB)])
        weights = torch.tensor([1.0 / (k + 1) ** 1.5 for k in range(BRANCH)])
        self.probs = weights / weights.sum()

    def entropy(self) -> float:
        """The best possible cross entropy (nats per token)."""
        return float(-(self.probs * self.probs.log()).sum())

    def examples(self, count: int, seed: int) -> tuple[Tensor, Tensor]:
        """``count`` examples (contexts of ``CONTEXT`` tokens and the next token), from ``count``
        streams warmed up past their start."""
        g = torch.Generator().manual_seed(seed)
        tokens = [torch.randint(VOCAB, (count,), generator=g) for _ in range(2)]
        for _ in range(CONTEXT + 8):
            choice = torch.multinomial(self.probs, count, replacement=True, generator=g)
            tokens.append(self.next[tokens[-2] * VOCAB + tokens[-1], choice])
        stream = torch.stack(tokens[-(CONTEXT + 1) :], dim=1)
        return stream[:, :CONTEXT], stream[:, CONTEXT]


def build_model() -> nn.Module:
    """The 2-layer MLP language model (the same initial weights every time)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, EMBED),
        nn.Flatten(),
        nn.Linear(CONTEXT * EMBED, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, VOCAB),
    )


def loss_of(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The cross entropy of ``model`` on ``batch``."""
    x, y = batch
    loss: Tensor = functional.cross_entropy(model(x), y)
    return loss


def inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=INNER_LR)


def batch_of(chain: Chain, replica: int, step: int) -> tuple[Tensor, Tensor]:
    """Replica ``replica``'s batch at local step ``step`` (the same tokens in every run)."""
    return chain.examples(BATCH, seed=1_000_003 * (replica + 1) + step)


def evaluate(model: nn.Module, held_out: tuple[Tensor, Tensor]) -> float:
    with torch.no_grad():
        return float(loss_of(model, held_out))


def run_data_parallel(chain: Chain, held_out: tuple[Tensor, Tensor]) -> list[float]:
    """Synchronous data parallelism: each step, the mean of the replicas' gradients (summed in rank order)."""
    model = build_model()
    optimizer = inner(model)
    curve = [evaluate(model, held_out)]
    for t in range(STEPS):
        grads: list[list[Tensor]] = []
        for r in range(REPLICAS):
            model.zero_grad()
            loss_of(model, batch_of(chain, r, t)).backward()  # type: ignore[no-untyped-call]
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        for p, gs in zip(model.parameters(), zip(*grads, strict=True), strict=True):
            p.grad = sum(gs[1:], gs[0].clone()).div_(REPLICAS)
        optimizer.step()
        if (t + 1) % SYNC_EVERY == 0:
            curve.append(evaluate(model, held_out))
    return curve


def run_diloco(chain: Chain, held_out: tuple[Tensor, Tensor], quantize: str | None) -> list[float]:
    """DiLoCo over 3 replicas simulated in one process, averaging as the real exchange does."""
    glob = build_model()
    outer = torch.optim.SGD(glob.parameters(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    models = [build_model() for _ in range(REPLICAS)]
    optimizers = [inner(m) for m in models]
    curve = [evaluate(glob, held_out)]
    for t in range(STEPS):
        for r, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            optimizer.zero_grad()
            loss_of(model, batch_of(chain, r, t)).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        if (t + 1) % SYNC_EVERY:
            continue
        with torch.no_grad():
            rows = [
                torch.cat([(g - p).reshape(-1) for g, p in zip(glob.parameters(), m.parameters(), strict=True)])
                for m in models
            ]
            if quantize is None:
                mean = rows[0].clone()
                for row in rows[1:]:
                    mean.add_(row)
                mean.div_(REPLICAS)
            else:
                mean = reference_mean(rows, quantize)
            at = 0
            for g in glob.parameters():
                g.grad = mean[at : at + g.numel()].view_as(g).clone()
                at += g.numel()
        outer.step()
        with torch.no_grad():
            for model in models:
                for p, g in zip(model.parameters(), glob.parameters(), strict=True):
                    p.copy_(g)
        curve.append(evaluate(glob, held_out))
    return curve


def plot(curves: dict[str, list[float]], entropy: float, path: Path) -> None:
    """The loss curves as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6.4, 3.6), dpi=100)
    labels = {
        "data_parallel": "data parallel (every step)",
        "diloco": "DiLoCo, full precision",
        "diloco_int8": 'DiLoCo, quantize="int8"',
        "diloco_float8": 'DiLoCo, quantize="float8"',
    }
    styles = {"data_parallel": "-", "diloco": "-", "diloco_int8": "--", "diloco_float8": ":"}
    steps = [k * SYNC_EVERY for k in range(STEPS // SYNC_EVERY + 1)]
    for name, curve in curves.items():
        axes.plot(steps, curve, styles[name], label=labels[name], linewidth=1.6)
    axes.axhline(entropy, color="grey", linewidth=0.8, label="best possible (the chain's entropy)")
    axes.set_xlabel(f"local steps ({REPLICAS} replicas, {BATCH} examples each per step)")
    axes.set_ylabel("held-out cross entropy (nats)")
    axes.set_title(f"DiLoCo, sync every {SYNC_EVERY} steps: quantized exchange against full precision", fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results.json", help="the results go to <stem>_ft_diloco_quality.json")
    parser.add_argument("--plot", default="", help="the PNG of the loss curves (default: next to the JSON)")
    args, _ = parser.parse_known_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out = out.with_name(out.stem + "_ft_diloco_quality.json")
    chain = Chain()
    held_out = chain.examples(EVAL_BATCH, seed=7)
    started = time.monotonic()
    print(f"# load before: {os.getloadavg()[0]:.1f}", flush=True)
    curves: dict[str, list[float]] = {"data_parallel": run_data_parallel(chain, held_out)}
    for name, quantize in (("diloco", None), ("diloco_int8", "int8"), ("diloco_float8", "float8")):
        curves[name] = run_diloco(chain, held_out, quantize)
    final = {name: curve[-1] for name, curve in curves.items()}
    result: dict[str, Any] = {
        "task": {
            "replicas": REPLICAS,
            "vocab": VOCAB,
            "context": CONTEXT,
            "params": sum(p.numel() for p in build_model().parameters()),
            "param_bytes": sum(p.numel() * p.element_size() for p in build_model().parameters()),
            "batch": BATCH,
            "steps": STEPS,
            "sync_every": SYNC_EVERY,
            "inner": f"AdamW(lr={INNER_LR})",
            "outer": f"SGD(lr={OUTER_LR}, momentum={MOMENTUM}, nesterov=True)",
            "entropy": chain.entropy(),
            "initial_loss": curves["data_parallel"][0],
            "uniform_loss": math.log(VOCAB),
        },
        "steps": [k * SYNC_EVERY for k in range(STEPS // SYNC_EVERY + 1)],
        "curves": curves,
        "final": final,
        "int8_vs_full": final["diloco_int8"] / final["diloco"] - 1,
        "float8_vs_full": final["diloco_float8"] / final["diloco"] - 1,
        "diloco_vs_data_parallel": final["diloco"] / final["data_parallel"] - 1,
        "seconds": round(time.monotonic() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    picture = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(curves, chain.entropy(), picture)
    for name, value in final.items():
        print(f"{name:>14}: final held-out loss {value:.4f}")
    print(
        f"int8 {100 * result['int8_vs_full']:+.2f} %, float8 {100 * result['float8_vs_full']:+.2f} % against full "
        f"precision; full-precision DiLoCo {100 * result['diloco_vs_data_parallel']:+.2f} % against data parallel "
        f"(entropy {chain.entropy():.4f}); {result['seconds']} s, load after {os.getloadavg()[0]:.1f}"
    )
    print(f"wrote {out} and {picture}")


if __name__ == "__main__":
    main()
