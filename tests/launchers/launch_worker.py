"""What each process runs under a real launcher (srun, sbatch, mpirun, torchrun).

It uses only what a user would: the environment helpers, ``create_default_gang()``, the layout
factories with ``intra_node_size = local world size / tp size``, a collective on every gang, close
and re-initialisation, and ``JaxGang.create_default()`` with no argument. Every gang's members
are proven by all-gathering (global rank, node) through it. The result of each process is
written as JSON to ``<out>/<tag>-<rank>.json``; the test that started the launcher checks them
together.

Usage: ``python launch_worker.py OUT TAG [--tp N] [--node-var NAME] [--meet DIR COUNT]``. ``--node-var``
names the launcher variable that numbers this process's node (``SLURM_NODEID``, torchrun's
``GROUP_RANK``; 0 when absent). ``--meet`` waits until ``COUNT`` processes (of every launch
sharing ``DIR``) have arrived, before the rendezvous and again after the first collective, so
concurrent launches are really concurrent.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import gang
from gang import Gang, ReduceOperation, create_fsdp_gangs, create_parallel_gangs
from gang.env import get_launcher, get_master_address
from gang.testing import member_ranks

MEET_TIMEOUT_S = 120.0
LAUNCHER_VARIABLES = ("SLURM_", "OMPI_", "PMIX_", "MASTER_", "TORCHELASTIC_", "GROUP_RANK")


def meet(folder: Path, count: int, stage: str, me: str) -> None:
    """A file barrier across launches: wait until ``count`` processes wrote ``stage``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stage}-{me}").touch()
    deadline = time.monotonic() + MEET_TIMEOUT_S
    while len(list(folder.glob(f"{stage}-*"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(folder.glob(f'{stage}-*')))} of {count} processes reached {stage}")
        time.sleep(0.05)


def members(g: Gang, node: int) -> list[list[int]]:
    """All-gather (global rank, node) through ``g``: who is really in it, in gang rank order."""
    return [[r, n] for r, n in zip(member_ranks(g, gang.get_rank()), member_ranks(g, node), strict=True)]


def total(g: Gang) -> float:
    """A second collective on ``g``: the sum of ones, which must be its size."""
    t = torch.ones(3)
    g.all_reduce(t, ReduceOperation.SUM)
    return float(t[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("tag")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--node-var", default="")
    parser.add_argument("--meet", nargs=2, default=None)
    args = parser.parse_args()

    launcher = get_launcher()
    node = int(os.environ.get(args.node_var, "0")) if args.node_var else 0
    me = f"{args.tag}-{launcher.rank}"
    result: dict[str, object] = {
        "launcher": launcher.name,
        "helpers": [gang.get_rank(), gang.get_world_size(), gang.get_local_rank(), gang.get_local_world_size()],
        "node": node,
        "device": str(gang.get_default_device()),
        "address": list(get_master_address()),
        "env": {k: v for k, v in os.environ.items() if k.startswith(LAUNCHER_VARIABLES)},
    }
    if args.meet:
        meet(Path(args.meet[0]), int(args.meet[1]), "start", me)

    root = gang.create_default_gang()
    result["root_rank"] = [root.rank, root.size]
    result["root_members"] = members(root, node)
    if args.meet:
        meet(Path(args.meet[0]), int(args.meet[1]), "wired", me)
    gangs = create_parallel_gangs(root, tp_size=args.tp)
    gangs = create_fsdp_gangs(gangs, intra_node_size=gang.get_local_world_size() // args.tp)
    for name in ("root", "dp", "rdp", "sdp", "tp", "pp"):
        g = getattr(gangs, name)
        result[name] = {"members": members(g, node), "sum": total(g), "size": g.size}
    root.close()

    again = gang.create_default_gang()
    result["again"] = {"members": members(again, node), "sum": total(again)}
    again.close()

    from gang_jax import JaxGang

    jax_gang = JaxGang.create_default()
    result["jax"] = {"rank": jax_gang.rank, "size": jax_gang.size, "members": members(jax_gang, node)}
    jax_gang.close()

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{me}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
