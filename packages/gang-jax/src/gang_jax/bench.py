"""The JAX implementations of ``python -m gang.bench``: raw JAX and :class:`gang_jax.JaxGang`.

``gang.bench`` finds :class:`JaxImpls` through the entry point ``jax`` of the group ``gang.bench``
(declared in this package's ``pyproject.toml``), so the core package never imports this one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gang.bench.collectives import Case, gang_call, reference, without_gloo_notice
from gang_jax._convert import to_numpy
from gang_jax.gang import JaxGang

__all__ = ["JaxImpls"]

_INT_BY_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class JaxImpls:
    """Raw JAX (``jit(shard_map(...))`` over a mesh of the processes' devices) and :class:`JaxGang`.

    Created on every rank of the job (a :class:`JaxGang` of every process is initialised);
    :meth:`close` closes that gang.
    """

    names = ("jax", "gang-jax")
    """The implementation names."""
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

    def _raw(self, op: str, numel: int, dtype: torch.dtype) -> Case:
        """The raw JAX case: the input is already a ``jax.Array`` on the device, the result stays one."""
        lax: Any = jax.lax  # untyped
        source, expected = reference(op, self.gang.rank, self.n, numel, dtype)
        block = to_numpy(source.reshape(-1))
        state = {"x": self._global(block), "out": None}
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
        else:
            raise ValueError(op)

        def run() -> None:
            state["out"] = fn(state["x"]).block_until_ready()

        def reset() -> None:
            state["x"] = self._global(block)

        def result() -> torch.Tensor:
            local = np.asarray(state["out"].addressable_shards[0].data)
            bits = local.view(_INT_BY_SIZE[local.dtype.itemsize]).copy()  # torch has no NumPy bfloat16
            return torch.from_numpy(bits).view(dtype).reshape(expected.shape)

        return Case(run, reset, result, expected)

    def cases(self, op: str, numel: int, dtype: torch.dtype) -> dict[str, Case]:
        """Return the ``jax`` and ``gang-jax`` cases of ``op`` on a full buffer of ``numel`` elements of ``dtype``.

        Raw JAX runs 32-bit types at most (64-bit ones need ``jax_enable_x64``, which
        :class:`JaxGang` turns on for its own calls only), so 64-bit dtypes time ``gang-jax`` alone.
        """
        out = {"gang-jax": gang_call(self.gang, op, numel, dtype)}
        if dtype.itemsize <= 4:
            out = {"jax": self._raw(op, numel, dtype), **out}
        return out

    def close(self) -> None:
        """Close the gang."""
        self.gang.close()
