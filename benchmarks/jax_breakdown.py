"""Where a ``JaxGang`` call's microseconds go: each layer of a ``send_recv`` ring (and an all-reduce,
an all-to-all) timed against the raw JAX program on resident arrays.

Run on 2 local processes (``gang.testing.World``)::

    python -m benchmarks.jax_breakdown [--iters 1000] [--bytes 4 4096 1048576] [--nproc 2]

Layers, timed interleaved (rotating order, a torch barrier before every call), one buffer of
``--bytes`` per rank:

* ``jax``: the raw compiled program on a resident global array (what ``gang_jax.bench`` times);
* ``program``: the gang's own compiled program on its staged buffers (no copies, no Python of the gang);
* ``host call``: the gang's :class:`~gang_jax._collectives.HostCall` from the tensor's address
  into the output's (the two ``memmove`` s added);
* ``engine``: :meth:`LocalEngine.run` of the operation (the engine's dispatch added);
* ``gang._op``: the gang's protected method (the lane and the error guard added);
* ``gang.op``: the public call (the argument checks added).

Each row: the median time of the slowest rank, rank 0's median main-thread CPU time, and the median
of the per-iteration ratios to ``jax`` with its quartiles.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from gang import ReduceOperation

Call = Callable[[], object]


def _layers(op: str, numel: int) -> tuple[list[str], list[list[float]], list[list[float]], int]:
    from gang_jax._engine import Op
    from gang_jax.bench import SENDRECV, JaxImpls

    impls = JaxImpls()
    g = impls.gang
    engine: Any = g._engine
    rank, size = g.rank, g.size
    right, left = (rank + 1) % size, (rank - 1) % size
    raw = impls._raw(SENDRECV if op == "send_recv" else op, numel * (size if op == "all_to_all" else 1), torch.float32)
    shape = (size, numel) if op == "all_to_all" else (numel,)
    t = [torch.ones(shape) for _ in range(4)]
    o = [torch.zeros(shape) for _ in range(4)]
    if op == "send_recv":
        engine.exchange(right if rank == 0 else left, [t[0]], [o[0]])  # compile and stage
        if size == 2:
            peer = 1 - rank
            key = next(k for k in engine._calls if k[1] == peer)
        call = engine._calls[key]
        calls: dict[str, Call] = {
            "jax": raw.run,
            "host call": lambda: call.run_staged(t[0].data_ptr(), o[0].data_ptr()),
            "engine": lambda: engine.run(Op.SEND_RECV, (o[1],), (t[1],), ((right,), (left,))),
            "gang._op": lambda: g._send_recv([(t[2], right)], [(o[2], left)], False, "send_recv"),
            "gang.op": lambda: g.send_recv([(t[3], right)], [(o[3], left)]),
        }
    elif op == "all_reduce":
        engine.run(Op.ALL_REDUCE, (o[0],), (o[0],), (ReduceOperation.SUM,))
        key = next(k for k in engine._calls if k[0] is Op.ALL_REDUCE)
        call = engine._calls[key]
        calls = {
            "jax": raw.run,
            "host call": lambda: call.run_staged(o[0].data_ptr(), o[0].data_ptr()),
            "engine": lambda: engine.run(Op.ALL_REDUCE, (o[1],), (o[1],), (ReduceOperation.SUM,)),
            "gang._op": lambda: g._all_reduce(o[2], ReduceOperation.SUM, False),
            "gang.op": lambda: g.all_reduce(o[3], ReduceOperation.SUM),
        }
    else:
        engine.run(Op.ALL_TO_ALL, (o[0],), (t[0],), ())
        key = next(k for k in engine._calls if k[0] is Op.ALL_TO_ALL)
        call = engine._calls[key]
        calls = {
            "jax": raw.run,
            "host call": lambda: call.run_staged(t[0].data_ptr(), o[0].data_ptr()),
            "engine": lambda: engine.run(Op.ALL_TO_ALL, (o[1],), (t[1],), ()),
            "gang._op": lambda: g._all_to_all(o[2], t[2], False),
            "gang.op": lambda: g.all_to_all(o[3], t[3]),
        }
    plan = call._plan
    if plan.out is not None:
        staged = call._staged

        def program() -> None:
            out = plan.host_fn(staged[1], plan.out[1])
            out.block_until_ready()
            plan.out = (plan.out[0], out)

        calls = {"jax": calls.pop("jax"), "program": program, **calls}
    names = list(calls)
    for _ in range(20):
        for name in names:
            calls[name]()
    return names, *_time(calls, names), size


def _time(calls: dict[str, Call], names: list[str]) -> tuple[list[list[float]], list[list[float]]]:
    iters = int(os.environ["BREAKDOWN_ITERS"])
    wall = torch.zeros(len(names), iters, dtype=torch.float64)
    cpu = torch.zeros(len(names), iters, dtype=torch.float64)
    clock, cpu_clock = time.perf_counter, time.thread_time
    for it in range(iters):
        for k in range(len(names)):
            index = (k + it) % len(names)
            dist.barrier()
            c0, w0 = cpu_clock(), clock()
            calls[names[index]]()
            w1, c1 = clock(), cpu_clock()
            wall[index, it], cpu[index, it] = w1 - w0, c1 - c0
    dist.all_reduce(wall, dist.ReduceOp.MAX)
    return wall.tolist(), cpu.tolist()


def _on_rank(_: object, op: str, numel: int) -> Any:
    torch.set_num_threads(1)
    return _layers(op, numel)


def _q(values: list[float], q: float) -> float:
    data = sorted(values)
    return data[int(q * (len(data) - 1))]


def main(argv: list[str] | None = None) -> None:
    """Print the layers of every operation and size on ``--nproc`` local processes."""
    from gang.testing import World

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--bytes", type=int, nargs="+", default=[4, 4096, 1 << 20])
    parser.add_argument("--ops", nargs="+", default=["send_recv"], choices=["send_recv", "all_reduce", "all_to_all"])
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"# JaxGang layers on {args.nproc} processes, {args.iters} iterations; load {os.getloadavg()}", flush=True)
    env = {"OMP_NUM_THREADS": "1", "BREAKDOWN_ITERS": str(args.iters)}
    for op in args.ops:
        for nbytes in args.bytes:
            with World(args.nproc, env=env) as world:
                names, wall, cpu, _ = cast(Any, world.run(_on_rank, op, max(1, nbytes // 4), timeout=900)[0])
            print(f"{op} {nbytes} B: {'layer':>10} | {'us':>8} {'cpu us':>8} | ratio to jax [q1, q3]")
            base = wall[0]
            for name, w, c in zip(names, wall, cpu, strict=True):
                ratios = [a / b for a, b in zip(w, base, strict=True)]
                pad = len(op) + len(str(nbytes)) + 4
                print(
                    f"{'':>{pad}} {name:>10} | {_q(w, 0.5) * 1e6:8.1f} {_q(c, 0.5) * 1e6:8.1f}"
                    f" | {_q(ratios, 0.5):.3f} [{_q(ratios, 0.25):.3f}, {_q(ratios, 0.75):.3f}]",
                    flush=True,
                )
    print(f"# done; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
