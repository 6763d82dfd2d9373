"""Where a traffic call's microseconds go: each layer of ``send``/``recv``, ``all_to_all_uneven``,
``exchange_rows`` and ``send_recv`` timed as a ratio to the raw ``torch.distributed`` call.

Run under torchrun, on the CPU (gloo)::

    torchrun --standalone --nproc-per-node 2 -m benchmarks.traffic_breakdown [--iters 2000] [--bytes 4]

Per operation, the layers are timed interleaved (rotating order, a barrier before every call, as
:mod:`benchmarks.small_messages` does), one message of ``--bytes`` per rank:

* ``dist``: the raw ``torch.distributed`` call (``dist.send``/``dist.recv``, ``all_to_all_single``
  with split sizes, ``batch_isend_irecv``; for ``exchange_rows`` the two raw calls it replaces);
* ``c10d``: the process group's own method with options built once (what the gang calls);
* ``gang._<op>``: the gang's protected method (no argument checks);
* ``gang.<op>``: the public call.

Each row shows the median time of the slowest rank, the median CPU time of rank 0's main thread,
the median of the per-iteration ratios to ``dist`` with its quartiles, and the same calls back to
back without a barrier (``hot``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import AllToAllOptions

import gang
from benchmarks.small_messages import cpu_gang, load, paired_parser, quantile, ratio_cells, time_paired, us
from gang import ProcessGroupGang
from gang.bench.traffic import skewed_splits

Call = Callable[[], object]
OPS = ("send", "all_to_all_uneven", "exchange_rows", "send_recv_ring")


def cases(g: ProcessGroupGang, op: str, numel: int) -> dict[str, Call]:
    """The layered callables of ``op`` on this rank (see the module docstring)."""
    pg, rank, size = g.as_process_group(), g.rank, g.size
    t = [torch.zeros(numel) for _ in range(4)]
    if op == "send":
        peer = rank ^ 1
        other = dist.get_global_rank(pg, peer)
        if rank % 2 == 0:
            return {
                "dist": lambda: dist.send(t[0], other, group=pg),
                "c10d": lambda: pg.send([t[1]], peer, 0).wait(),
                "gang._send_recv": lambda: g._send_recv([(t[2], peer)], [], False, "send"),
                "gang.send": lambda: g.send(t[3], peer),
            }
        return {
            "dist": lambda: dist.recv(t[0], other, group=pg),
            "c10d": lambda: pg.recv([t[1]], peer, 0).wait(),
            "gang._send_recv": lambda: g._send_recv([], [(t[2], peer)], False, "send"),
            "gang.send": lambda: g.recv(t[3], peer),
        }
    if op == "send_recv_ring":
        right, left = (rank + 1) % size, (rank - 1) % size
        gr, gl = dist.get_global_rank(pg, right), dist.get_global_rank(pg, left)
        o = [torch.zeros(numel) for _ in range(4)]

        def raw() -> None:
            ops = [dist.P2POp(dist.isend, t[0], gr, pg), dist.P2POp(dist.irecv, o[0], gl, pg)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        def c10d() -> None:
            first, second = (pg.send([t[1]], right, 0), pg.recv([o[1]], left, 0))
            first.wait()
            second.wait()

        return {
            "dist": raw,
            "c10d": c10d,
            "gang._send_recv": lambda: g._send_recv([(t[2], right)], [(o[2], left)], False, "send_recv"),
            "gang.send_recv": lambda: g.send_recv([(t[3], right)], [(o[3], left)]),
        }
    splits = skewed_splits(size, numel)
    out_splits = [splits[rank]] * size
    outs = [torch.zeros(sum(out_splits)) for _ in range(4)]
    if op == "all_to_all_uneven":
        opts = AllToAllOptions()
        return {
            "dist": lambda: dist.all_to_all_single(outs[0], t[0], out_splits, splits, group=pg),
            "c10d": lambda: pg.all_to_all_single(outs[1], t[1], out_splits, splits, opts).wait(),
            "gang._all_to_all_uneven": lambda: g._all_to_all_uneven(outs[2], t[2], out_splits, splits, False),
            "gang.all_to_all_uneven": lambda: g.all_to_all_uneven(outs[3], t[3], out_splits, splits),
        }
    if op == "exchange_rows":

        def two_calls() -> torch.Tensor:
            counts = torch.tensor(splits, dtype=torch.int64)
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=pg)
            osplits = received.tolist()
            out = t[0].new_empty((sum(osplits), *t[0].shape[1:]))
            dist.all_to_all_single(out, t[0], osplits, splits, group=pg)
            return out

        return {"dist": two_calls, "gang.exchange_rows": lambda: gang.exchange_rows(g, t[1], splits)}
    raise ValueError(op)


def main(argv: list[str] | None = None) -> None:
    """Time every layer of every operation of ``--ops`` on this torchrun rank; rank 0 prints."""
    parser = paired_parser(__doc__ or "", OPS)
    parser.add_argument("--bytes", type=int, default=4, help="bytes per message (float32)")
    parser.add_argument("--no-hot", action="store_true", help="leave out the back-to-back timing")
    args = parser.parse_args(argv)
    g, say = cpu_gang()

    say(f"# {args.bytes}-byte traffic on {g.size} gloo ranks, {args.iters} iterations; {load()}")
    say(f"{'layer':>24} | {'us':>9} {'cpu us':>9} {'ratio to dist [q1, q3]':>24} | {'hot us':>9} {'cpu us':>9}")
    for op in args.ops:
        calls = cases(g, op, max(1, args.bytes // 4))
        cold = time_paired(calls, args.warmup, args.iters)
        hot = None if args.no_hot else time_paired(calls, args.warmup, args.iters, barrier=False)
        for name in calls:
            hot_cells = "" if hot is None else f"{us(hot.wall[name])} {us(hot.cpu[name])}"
            say(
                f"{name:>24} | {us(cold.wall[name])} {us(cold.cpu[name])} "
                f"{ratio_cells(cold.wall[name], cold.wall['dist']):>24} | {hot_cells}"
            )
        if hot is not None:
            say(f"{'':>24}   hot gang/dist {quantile(hot.wall[name], 0.5) / quantile(hot.wall['dist'], 0.5):.3f}")
    say(f"# done; {load()}")
    g.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
