"""Print which global ranks share each gang for tp=2, pp=2 and HSDP on 8 local processes."""

from __future__ import annotations

import torch

from gang import Gang, create_fsdp_gangs, create_parallel_gangs
from gang.testing import member_ranks, spawn


def layout(root: Gang) -> dict[str, list[int]]:
    gangs = create_parallel_gangs(root, tp_size=2, pp_size=2)
    gangs = create_fsdp_gangs(gangs, intra_node_size=1)
    return {role: member_ranks(g) for role, g in gangs.items() if role != "root"}


def main() -> None:
    torch.set_num_threads(1)
    views = spawn(layout, 8)
    roles = list(views[0])
    print("rank | " + " | ".join(f"{role:>8}" for role in roles))
    for rank, view in enumerate(views):
        print(f"{rank:>4} | " + " | ".join(f"{view[role]!s:>8}" for role in roles))
    assert views[5]["tp"] == [4, 5] and views[5]["dp"] == [5, 7] and views[5]["pp"] == [1, 5]


if __name__ == "__main__":
    main()
