"""The JAX implementations of ``python -m gang.bench``: raw JAX and :class:`gang_jax.JaxGang`.

``gang.bench`` finds :class:`JaxImpls` through the entry point ``jax`` of the group ``gang.bench``
(declared in this package's ``pyproject.toml``), so the core package never imports this one.

:class:`JaxImpls` also times point-to-point traffic (:data:`SENDRECV`): a ``send_recv`` ring
shift through the gang against the raw JAX ``ppermute`` program on resident arrays.
``python -m gang_jax.bench`` runs it on 2 local processes, paired in one run, and prints one row
per size (``--sizes``, ``--iters``, ``--nproc``, ``--out`` for the JSON rows).

Each API has its own yardstick. :mod:`gang_jax.functional` (``gang-jax-functional``) takes and
returns resident ``jax.Array`` s, as the raw program does (``jax``), so it is paired with it.
``JaxGang`` (``gang-jax``) takes torch tensors and writes its result into them, which must copy
the result (raw JAX on resident arrays copies nothing), so it is paired with raw JAX fed from torch
tensors as a user would do it without gang (``jax-from-torch``: the tensor handed to JAX through
DLPack, the program, the result copied back into a tensor).

``jax-lane`` is a control: the raw program on resident arrays, each call run on the gang's worker thread
(:mod:`gang_jax._lane`) as the gang's calls are. Paired with ``jax`` it is the cost of that thread hand-off
alone at the load the run saw; ``gang-jax-functional`` paired with it is everything else the functional call
does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.dlpack
import numpy as np
import torch
import torch.distributed as dist
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gang import ReduceOperation
from gang.bench.cases import Case, reference
from gang.bench.collectives import gang_call, iterations, time_interleaved, untraced, without_gloo_notice
from gang.bench.metrics import Row, make_row, median, paired_ratio
from gang_jax import functional
from gang_jax._convert import to_numpy
from gang_jax.gang import JaxGang

__all__ = ["JaxImpls"]

_INT_BY_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class JaxImpls:
    """Raw JAX (``jit(shard_map(...))`` over a mesh of the processes' devices) and :class:`JaxGang`.

    Created on every rank of the job (a :class:`JaxGang` of every process is initialised);
    :meth:`close` closes that gang.
    """

    names = ("jax", "gang-jax-functional", "jax-lane", "jax-from-torch", "gang-jax", "gang-jax-untraced")
    """The implementation names: raw JAX and :mod:`gang_jax.functional` on resident arrays, the raw program run on
    the gang's worker thread (a control), raw JAX fed from torch tensors and :class:`JaxGang` on torch tensors
    (and with its flight recorder off)."""
    device_types = ("cpu",)
    """JaxGang works on CPU tensors."""

    def __init__(self) -> None:
        self.gang = JaxGang.create_default()
        self.n = self.gang.size
        devices: dict[int, Any] = {}
        for device in sorted(jax.devices(), key=lambda d: d.id):
            devices.setdefault(device.process_index, device)
        self.me = devices[jax.process_index()]
        self.mesh = Mesh(np.array([devices[p] for p in range(jax.process_count())], dtype=object), ("x",))
        self.spec = cast(Callable[..., Any], PartitionSpec)("x")
        self.sharding = NamedSharding(self.mesh, self.spec)
        with without_gloo_notice():  # JAX's collectives connect on their first call
            for case in self.cases("all_reduce", 1, torch.float32).values():
                case()

    def _global(self, block: np.ndarray[Any, Any]) -> Any:
        """The global array ``[n * len(block)]`` whose shard on this process is ``block`` (already on device)."""
        local = jax.device_put(block, self.me)
        shape = (self.n * block.shape[0],)
        return jax.make_array_from_single_device_arrays(shape, self.sharding, [local])

    def _compile(self, body: Callable[[Any], Any]) -> Callable[[Any], Any]:
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=self.spec, out_specs=self.spec)
        return cast(Callable[[Any], Any], jax.jit(mapped))

    def _program(self, op: str) -> Callable[[Any], Any]:
        """The raw JAX program of ``op`` on a global array (one block per process, tiled along its axis)."""
        lax: Any = jax.lax  # untyped
        if op == "all_reduce":
            fn = self._compile(lambda b: lax.psum(b, "x"))
        elif op == "all_gather":
            fn = self._compile(lambda b: lax.all_gather(b, "x", tiled=True))
        elif op == "reduce_scatter":
            fn = self._compile(lambda b: lax.psum_scatter(b, "x", scatter_dimension=0, tiled=True))
        elif op == "all_to_all":
            fn = self._compile(lambda b: lax.all_to_all(b, "x", 0, 0, tiled=True))
        elif op == "broadcast":
            fn = self._compile(lambda b: lax.psum(jax.numpy.where(lax.axis_index("x") == 0, b, 0), "x"))
        elif op == SENDRECV:
            ring = [(i, (i + 1) % self.n) for i in range(self.n)]
            fn = self._compile(lambda b: lax.ppermute(b, "x", ring))
        else:
            raise ValueError(op)
        return fn

    def _raw(self, op: str, numel: int, dtype: torch.dtype) -> Case:
        """The raw JAX case: the input is already a ``jax.Array`` on the device, the result stays one."""
        if op == SENDRECV:
            source, expected = sendrecv_reference(self.gang.rank, self.n, numel, dtype)
        else:
            source, expected = reference(op, self.gang.rank, self.n, numel, dtype)
        block = to_numpy(source.reshape(-1))
        state = {"x": self._global(block), "out": None}
        fn = self._program(op)

        def run() -> None:
            state["out"] = fn(state["x"]).block_until_ready()

        def reset() -> None:
            state["x"] = self._global(block)

        def result() -> torch.Tensor:
            return _to_torch(state["out"].addressable_shards[0].data, dtype, expected.shape)

        return Case(run, reset, result, expected)

    def _on_lane(self, case: Case) -> Case:
        """``case`` with each call run on the gang's worker thread, as the gang runs its own (the control)."""
        lane, g, run = self.gang._lane, self.gang, case.run

        def on_lane() -> None:
            lane.call("jax-lane", g, run, 600.0)

        return Case(on_lane, case.reset, case.result, case.expected)

    def _raw_from_torch(self, op: str, numel: int, dtype: torch.dtype) -> Case:
        """Raw JAX fed from torch tensors as a user would without gang, by the quickest public calls: the tensor
        handed to JAX through DLPack (quicker than ``jax.device_put`` of its NumPy view), the program, and the
        result copied back into the tensor through NumPy (quicker than DLPack); in place for ``all_reduce`` and
        ``broadcast``, as the gang writes it."""
        source, expected = reference(op, self.gang.rank, self.n, numel, dtype)
        inp = source.reshape(-1).clone()
        out = inp if op in ("all_reduce", "broadcast") else torch.empty(expected.numel(), dtype=dtype)
        target = out.view(_TORCH_INT_BY_SIZE[dtype.itemsize]).numpy()  # the same memory (NumPy has no bfloat16)
        fn, sharding = self._program(op), self.sharding
        shape = (self.n * inp.numel(),)

        def run() -> None:
            local = jax.dlpack.from_dlpack(inp)
            result = fn(jax.make_array_from_single_device_arrays(shape, sharding, [local]))
            np.copyto(target, np.asarray(result.addressable_data(0)).view(target.dtype))

        def reset() -> None:
            inp.copy_(source.reshape(-1))

        return Case(run, reset, lambda: out.view(expected.shape), expected)

    def _functional(self, op: str, numel: int, dtype: torch.dtype) -> Case:
        """:mod:`gang_jax.functional` on a resident ``jax.Array`` (in the gang's layout), its result left one."""
        g, sum_ = self.gang, ReduceOperation.SUM
        source, expected = reference(op, g.rank, self.n, numel, dtype)
        x = jax.device_put(to_numpy(source), self.me)
        calls: dict[str, Callable[[], jax.Array]] = {
            "all_reduce": lambda: functional.all_reduce(g, x, sum_),
            "all_gather": lambda: functional.all_gather(g, x),
            "reduce_scatter": lambda: functional.reduce_scatter(g, x, sum_),
            "all_to_all": lambda: functional.all_to_all(g, x),
            "broadcast": lambda: functional.broadcast(g, x, 0),
        }
        call = calls[op]
        state: dict[str, jax.Array] = {}

        def run() -> None:
            state["out"] = call()

        return Case(run, lambda: None, lambda: _to_torch(state["out"], dtype, expected.shape), expected)

    def cases(self, op: str, numel: int, dtype: torch.dtype) -> dict[str, Case]:
        """Return the cases of ``op`` on a full buffer of ``numel`` elements of ``dtype``, one per implementation.

        Raw JAX runs 32-bit types at most (64-bit ones need ``jax_enable_x64``, which
        :class:`JaxGang` turns on for its own calls only), so 64-bit dtypes time ``gang-jax`` alone.
        """
        out = {"gang-jax": self._sendrecv(numel, dtype) if op == SENDRECV else gang_call(self.gang, op, numel, dtype)}
        if op != SENDRECV:
            out["gang-jax-untraced"] = untraced(gang_call(self.gang, op, numel, dtype))
        if dtype.itemsize <= 4:
            out = {"jax": self._raw(op, numel, dtype), **out}
            if op != SENDRECV:
                out["gang-jax-functional"] = self._functional(op, numel, dtype)
                out["jax-lane"] = self._on_lane(self._raw(op, numel, dtype))
                out["jax-from-torch"] = self._raw_from_torch(op, numel, dtype)
        return out

    def _sendrecv(self, numel: int, dtype: torch.dtype) -> Case:
        """The gang's case of :data:`SENDRECV`: ``send_recv`` to the next rank and from the previous one."""
        g = self.gang
        source, expected = sendrecv_reference(g.rank, g.size, numel, dtype)
        inp, out = source.clone(), torch.empty_like(expected)

        def reset() -> None:
            inp.copy_(source)

        def run() -> None:
            g.send_recv([(inp, (g.rank + 1) % g.size)], [(out, (g.rank - 1) % g.size)])

        return Case(run, reset, lambda: out, expected)

    def close(self) -> None:
        """Close the gang."""
        self.gang.close()


def _to_torch(x: jax.Array, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """A copy of the process-local array ``x`` as a torch tensor of ``dtype`` and ``shape``."""
    local = np.asarray(x)
    bits = local.view(_INT_BY_SIZE[local.dtype.itemsize]).copy()  # torch has no NumPy bfloat16
    return torch.from_numpy(bits).view(dtype).reshape(shape)


SENDRECV = "sendrecv"
"""The point-to-point case: every rank sends its buffer to the next rank and receives the previous one's."""


def sendrecv_reference(rank: int, size: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, expected)`` of :data:`SENDRECV` on ``rank``: a pattern of the rank, and the previous rank's."""
    k = torch.arange(numel, dtype=torch.int64)
    return ((7 * rank + k) % 127).to(dtype), ((7 * ((rank - 1) % size) + k) % 127).to(dtype)


def measure_sendrecv(sizes: list[int], *, iters: int | None = None) -> list[Row]:
    """Time :data:`SENDRECV` through ``jax`` and ``gang-jax`` at each size (bytes per rank), paired in one run.

    Called on every rank of torch's default process group (its barriers pace the iterations); returns
    one row per implementation and size, with ``wrong`` (wrong elements over every rank) and, on the
    gang's rows, ``paired_ratio`` (the median of the per-iteration ratios to raw JAX).
    """
    impls = JaxImpls()
    rows: list[Row] = []
    try:
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            cases = impls.cases(SENDRECV, numel, torch.float32)
            warmup, timed = iterations(numel * 4, False, iters)
            times = time_interleaved(dict(cases), warmup, timed)
            wrong = torch.tensor([case.check() for case in cases.values()], dtype=torch.int64)
            dist.all_reduce(wrong)
            for (name, ts), bad in zip(times.items(), wrong.tolist(), strict=True):
                row = make_row(name, SENDRECV, numel * 4, impls.n, median(ts), iters=timed, wrong=int(bad))
                if name == "gang-jax":
                    row["paired_ratio"] = paired_ratio(ts, times["jax"])
                rows.append(row)
    finally:
        impls.close()
    return rows


def _measure_on_rank(_: object, sizes: list[int], iters: int | None) -> list[Row]:
    return measure_sendrecv(sizes, iters=iters)


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from gang.testing import World

    parser = argparse.ArgumentParser(prog="python -m gang_jax.bench", description="JaxGang send_recv against raw JAX")
    parser.add_argument("--nproc", type=int, default=2, help="local processes (default: 2)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 4096, 1 << 18, 1 << 22], help="bytes per rank")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per size (default: by size)")
    parser.add_argument("--out", default=None, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    with World(args.nproc, env={"OMP_NUM_THREADS": "1"}) as world:
        rows = world.run(_measure_on_rank, args.sizes, args.iters)[0]
    print(f"{'impl':>9} {'bytes':>10} {'time_us':>10} {'p2p ratio':>9} {'#wrong':>6}")
    for row in rows:
        ratio = f"{row['paired_ratio']:.3f}" if "paired_ratio" in row else ""
        print(f"{row['impl']:>9} {row['bytes']:>10} {row['time_us']:>10.1f} {ratio:>9} {row['wrong']:>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(row["wrong"] for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(_main())
