"""The main demo: a tour of gang on 4 local CPU ranks (``nox -s demo`` launches it with torchrun).

Builds the root gang, data/tensor parallel gangs, FSDP and HSDP gangs, runs every collective on
each, and prints what every rank sees as one table per layout.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gang import (
    Gang,
    Gangs,
    ProcessGroupGang,
    ReduceOperation,
    all_gather_objects,
    create_fsdp_gangs,
    create_parallel_gangs,
)
from gang.testing import member_ranks


def fmt(t: torch.Tensor) -> str:
    values = t.reshape(-1).tolist()
    return "[" + ",".join(f"{v:g}" for v in values) + "]"


def run_every_collective(gang: Gang) -> dict[str, str]:
    """Run each collective once on ``gang`` with rank-dependent inputs; describe the results."""
    me = float(dist.get_rank())  # the global rank, so the table shows who talked to whom
    view: dict[str, str] = {}
    t = torch.tensor([me + 1])
    gang.all_reduce(t, ReduceOperation.SUM)
    view["all_reduce(sum)"] = fmt(t)
    out = torch.empty(gang.size, 1)
    gang.all_gather(out, torch.tensor([me]))
    view["all_gather"] = fmt(out)
    rs = torch.empty(1)
    gang.reduce_scatter(
        rs, (torch.arange(gang.size, dtype=torch.float32) + 10 * me).view(gang.size, 1), ReduceOperation.MAX
    )
    view["reduce_scatter(max)"] = fmt(rs)
    a2a = torch.empty(gang.size, 1)
    gang.all_to_all(a2a, torch.full((gang.size, 1), me))
    view["all_to_all"] = fmt(a2a)
    b = torch.tensor([me])
    gang.broadcast(b, source_rank=gang.size - 1)
    view["broadcast(last)"] = fmt(b)
    objs: list[object] = [f"hello from {int(me)}"]
    gang.broadcast_objects(objs, source_rank=0)
    view["broadcast_objects(0)"] = str(objs[0])
    return view


def describe(gangs: Gangs, roles: list[str]) -> dict[str, dict[str, str]]:
    rows = {}
    for role in roles:
        gang = getattr(gangs, role)
        rows[role] = {"gang": f"{type(gang).__name__}(rank={gang.rank}, size={gang.size})"}
        rows[role]["members"] = str(member_ranks(gang))
        rows[role].update(run_every_collective(gang))
    return rows


def print_table(title: str, views: list[dict[str, dict[str, str]]]) -> None:
    print(f"\n=== {title} ===")
    for role in views[0]:
        columns = list(views[0][role])
        widths = {c: max(len(c), *(len(v[role][c]) for v in views)) for c in columns}
        print(f"\n  gangs.{role}")
        print("  rank | " + " | ".join(c.ljust(widths[c]) for c in columns))
        print("  -----+-" + "-+-".join("-" * widths[c] for c in columns))
        for rank, view in enumerate(views):
            print(f"  {rank:>4} | " + " | ".join(view[role][c].ljust(widths[c]) for c in columns))


def main() -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    root = ProcessGroupGang.create_default_process_group(torch.device("cpu"))
    if root.rank == 0:
        print(f"gang tour: {root.size} ranks, gloo on CPU, root created in {time.perf_counter() - start:.2f}s")

    layouts = [
        ("data x tensor parallel (tp_size=2) with FSDP", create_fsdp_gangs(create_parallel_gangs(root, tp_size=2))),
        ("hybrid sharding (HSDP, intra_node_size=2)", create_fsdp_gangs(create_parallel_gangs(root), 2)),
    ]
    for title, gangs in layouts:
        roles = ["root", "dp", "tp", "sdp", "rdp"]
        views = all_gather_objects(root, describe(gangs, roles))
        if root.rank == 0:
            print_table(title, views)
        for _, gang in gangs.items():
            if gang is not root:
                gang.close()
    root.close()


if __name__ == "__main__":
    main()
