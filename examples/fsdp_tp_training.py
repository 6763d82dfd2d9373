"""Train a tiny transformer with FSDP2 + tensor parallelism on a mesh built from gangs.

Run it on 4 local CPU processes::

    torchrun --standalone --nproc-per-node 4 examples/fsdp_tp_training.py

Without a launcher (``python examples/fsdp_tp_training.py``) it starts those 4 processes itself.
Rank 0 prints the loss and the throughput of every step.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

from gang import ProcessGroupGang, create_fsdp_gangs, create_parallel_gangs
from gang_mesh import to_device_mesh
from gang_mesh.parity import ModelConfig, train

LOCAL_PROCESSES = 4


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp-size", type=int, default=2, help="tensor parallel size (default 2)")
    parser.add_argument(
        "--intra-node-size", type=int, default=None, help="sdp size for HSDP (default: plain FSDP over dp)"
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per replica and step (default 4)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Train on the processes of this launch; return this rank's losses.

    :param argv: Command-line arguments (``sys.argv[1:]`` when ``None``).
    """
    args = parse(argv)
    root = ProcessGroupGang.create_default_process_group(torch.device("cpu"))
    gangs = create_fsdp_gangs(create_parallel_gangs(root, tp_size=args.tp_size), args.intra_node_size)
    try:
        # Size-1 gangs have no process group: leave them out of the mesh. Without an sdp gang
        # (intra-node size 1) shard over the whole dp gang instead.
        sharded = ("rdp", "sdp") if gangs.sdp.size > 1 else ("dp",)
        dims = tuple(name for name in (*sharded, "tp") if getattr(gangs, name).size > 1)
        mesh = to_device_mesh(gangs, dims)
        if root.rank == 0:
            print(f"mesh {mesh.mesh_dim_names} of shape {tuple(mesh.shape)}: {mesh.mesh.tolist()}", flush=True)

        def report(step: int, loss: float, tokens_per_second: float) -> None:
            if root.rank == 0:
                print(f"step {step:3d}  loss {loss:.4f}  {tokens_per_second:9.0f} tokens/s", flush=True)

        result = train(mesh, steps=args.steps, batch_size=args.batch_size, config=ModelConfig(), on_step=report)
        if root.rank == 0:
            print(
                f"done: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
                f"{result.tokens_per_second:.0f} tokens/s overall",
                flush=True,
            )
        losses: list[float] = result.losses
        return losses
    finally:
        gangs.close()


def _local(argv: list[str]) -> list[float]:
    losses: list[float] = main(argv)
    return losses


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:
        main()
    else:
        from gang.testing import launch

        launch(_local, LOCAL_PROCESSES, sys.argv[1:])
