"""Compiled JAX collectives over the devices of a gang's member processes.

Each collective is a ``jax.jit`` of a ``jax.shard_map`` over a one-dimensional mesh whose ``i``-th
device belongs to the process of gang rank ``i``. Every process contributes one block (its own
data with a leading axis of length 1), so the global array is ``[size, ...]`` sharded along the
mesh axis, and only the member processes take part. Compiled functions are cached per
(collective, reduction, shape, dtype) on the :class:`Communicator`, so loops never recompile.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.dlpack
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gang import ReduceOperation

AXIS = "gang"
"""The name of the mesh axis that the collectives run along."""

_Body = Callable[[jax.Array], jax.Array]
_Collective = Callable[..., jax.Array]

# Typed handles on JAX's (untyped) collective primitives.
_psum = cast(_Collective, jax.lax.psum)
_pmin = cast(_Collective, jax.lax.pmin)
_pmax = cast(_Collective, jax.lax.pmax)
_all_to_all = cast(_Collective, jax.lax.all_to_all)
_all_gather = cast(_Collective, jax.lax.all_gather)
_ppermute = cast(_Collective, jax.lax.ppermute)
_SPEC = cast(Callable[..., PartitionSpec], PartitionSpec)(AXIS)
_Key = tuple[Any, ...]
_Program = tuple[_Key, Callable[[], _Body]]
memmove = ctypes.memmove


def _reduce_rows(rows: jax.Array, op: ReduceOperation, size: int) -> jax.Array:
    """Reduce ``rows`` (one row per rank) along axis 0, keeping it, exactly as ``op`` defines."""
    if op is ReduceOperation.MIN:
        return jnp.min(rows, axis=0, keepdims=True)
    if op is ReduceOperation.MAX:
        return jnp.max(rows, axis=0, keepdims=True)
    if op is ReduceOperation.PRODUCT:
        return jnp.prod(rows, axis=0, keepdims=True, dtype=rows.dtype)
    total = jnp.sum(rows, axis=0, keepdims=True, dtype=rows.dtype)
    if op is ReduceOperation.MEAN:
        return (total / size).astype(rows.dtype)
    return total


def _all_reduce_body(size: int, dtype: np.dtype[Any], op: ReduceOperation) -> _Body:
    boolean = dtype == np.bool_

    def body(block: jax.Array) -> jax.Array:
        x = block.astype(jnp.uint8) if boolean else block
        if boolean:
            # Logical reductions: any for SUM/MAX, all for PRODUCT/MIN.
            any_op = op in (ReduceOperation.SUM, ReduceOperation.MAX, ReduceOperation.MEAN)
            r = _pmax(x, AXIS) if any_op else _pmin(x, AXIS)
            return r.astype(jnp.bool_)
        if op is ReduceOperation.SUM:
            return _psum(x, AXIS)
        if op is ReduceOperation.MEAN:
            return (_psum(x, AXIS) / size).astype(x.dtype)
        if op is ReduceOperation.MIN:
            return _pmin(x, AXIS)
        if op is ReduceOperation.MAX:
            return _pmax(x, AXIS)
        rows = _all_gather(x, AXIS, axis=0, tiled=True)
        return _reduce_rows(rows, op, size)

    return body


def _reduce_scatter_body(size: int, dtype: np.dtype[Any], op: ReduceOperation) -> _Body:
    boolean = dtype == np.bool_

    def body(block: jax.Array) -> jax.Array:
        x = block[0]  # [size, *shape]: row j goes to rank j
        # An all-to-all then a local reduction, for every op: measured 3-5x faster than
        # `psum_scatter` for 1M-element chunks on gloo CPU, and as fast for small ones.
        rows = _all_to_all(x, AXIS, 0, 0, tiled=True)  # row i came from rank i
        if boolean:
            any_op = op in (ReduceOperation.SUM, ReduceOperation.MAX, ReduceOperation.MEAN)
            u = rows.astype(jnp.uint8)
            r = jnp.max(u, axis=0, keepdims=True) if any_op else jnp.min(u, axis=0, keepdims=True)
            return r.astype(jnp.bool_)
        return _reduce_rows(rows, op, size)

    return body


def _all_gather_block(block: jax.Array) -> jax.Array:
    # [1, *shape] -> [1, size, *shape]. Gathered along axis 0 (tiled) and then reshaped, which is a
    # bitcast: gathering along axis 1 made XLA pick a layout with that axis outermost for the
    # gather, then copy the whole result into the row-major layout.
    rows = _all_gather(block, AXIS, axis=0, tiled=True)  # [size, *shape]
    return rows.reshape(1, *rows.shape)


def _all_gather_body(size: int, dtype: np.dtype[Any]) -> _Body:
    return _all_gather_block


def _all_to_all_block(block: jax.Array) -> jax.Array:
    return _all_to_all(block[0], AXIS, 0, 0, tiled=True)[None]


def _all_to_all_body(size: int, dtype: np.dtype[Any]) -> _Body:
    return _all_to_all_block


def _broadcast_body(size: int, dtype: np.dtype[Any], source: int) -> _Body:
    # Works on raw unsigned bits: 0 + b == b exactly, whatever the bits mean (NaN, -0.0, ...).
    def body(block: jax.Array) -> jax.Array:
        mine = jnp.where(jax.lax.axis_index(AXIS) == source, block, jnp.zeros_like(block))
        return _psum(mine, AXIS)

    return body


def _ppermute_body(size: int, dtype: np.dtype[Any], perm: tuple[tuple[int, int], ...]) -> _Body:
    def body(block: jax.Array) -> jax.Array:
        return _ppermute(block, AXIS, perm)  # a rank that receives nothing gets zeros

    return body


@dataclass(frozen=True)
class Kernel:
    """One kind of compiled collective: what :meth:`Communicator.program` compiles per shape, dtype and arguments.

    :ivar name: Its name (the first item of its cache keys).
    :ivar body: ``body(size, dtype, *args)`` returns the per-device function of the ``shard_map``
        (a block with a leading axis of length 1 in, one out).
    :ivar arithmetic: Whether it computes on values (64-bit types then run under
        ``jax.enable_x64``); otherwise it moves raw bits, and torch callers hand it unsigned
        integers of up to 32 bits (see :func:`gang_jax._convert.as_raw_bits`).
    :ivar rows: Whether torch callers hand it their input as ``[size, -1]`` (row ``j`` for rank ``j``).
    """

    name: str
    body: Callable[..., _Body]
    arithmetic: bool = False
    rows: bool = False


ALL_REDUCE = Kernel("all_reduce", _all_reduce_body, arithmetic=True)
REDUCE_SCATTER = Kernel("reduce_scatter", _reduce_scatter_body, arithmetic=True)
ALL_GATHER = Kernel("all_gather", _all_gather_body)
ALL_TO_ALL = Kernel("all_to_all", _all_to_all_body, rows=True)
BROADCAST = Kernel("broadcast", _broadcast_body)
"""Broadcast from the rank given as the argument; works on raw bits, whatever they mean."""
PPERMUTE = Kernel("ppermute", _ppermute_body)
"""Send each rank's block along the ``(source, target)`` pairs given as the argument (point-to-point)."""


def _first_block(out: jax.Array) -> jax.Array:
    """This process's block of the global array ``out`` (``addressable_data(0)`` without its checks)."""
    arrays = getattr(out, "_arrays", None)
    return cast(jax.Array, arrays[0]) if arrays else out.addressable_data(0)


class HostCall:
    """One collective on host memory, ready to run: copy in, run the compiled program, copy out.

    Inputs up to :data:`STAGED_BYTES` are copied (``memmove``) into the plan's device buffer, or
    from :data:`ALIAS_BYTES` handed to JAX as DLPack views (:meth:`run_aliased`); larger ones are
    handed to JAX as NumPy views. JAX aliases both kinds of view on CPU (no copy). The result is copied from JAX's
    output buffer straight into the destination. Both copies are plain byte copies, so the
    caller may pass any dtype whose bytes the program expects.

    :ivar staged: Whether the input is copied into a device buffer (then :meth:`run_staged`
        runs the call from addresses alone).
    :ivar nbytes_in: The bytes of the input that are copied in (``0``: the input is ignored).
    :ivar nbytes_out: The bytes of the result that are copied out.
    :ivar alias: Set by the caller for inputs of :data:`ALIAS_BYTES` or more: turns the source
        tensor into an object of the call's shape and dtype that JAX takes through DLPack without
        a copy (see :meth:`run_aliased`); ``None``: the input is copied in.
    """

    __slots__ = ("_device", "_dtype", "_plan", "_shape", "_staged", "alias", "nbytes_in", "nbytes_out", "staged")

    def __init__(
        self,
        plan: _Plan,
        staged: tuple[int, jax.Array] | None,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        device: jax.Device,
        nbytes_out: int,
        *,
        copy_in: bool = True,
    ) -> None:
        self._plan = plan
        self._staged = staged
        self.staged = staged is not None
        self._shape = shape
        self._dtype = dtype
        self._device = device
        self.nbytes_in = int(np.prod(shape)) * dtype.itemsize if copy_in else 0
        self.nbytes_out = nbytes_out
        self.alias: Callable[[Any], Any] | None = None

    def run_staged(self, source: int, target: int) -> None:
        """Run a staged call on the ``nbytes_in`` bytes at address ``source``; write the result to ``target``.

        This is the path of every call of a loop, so it is kept short: the time between a
        process waking up and posting its collective is spent here.
        """
        staged = self._staged
        assert staged is not None
        memmove(staged[0], source, self.nbytes_in)
        self._invoke(staged[1], target)

    def run_aliased(self, source: Any, target: int) -> None:
        """Run a staged call on ``source`` itself (an object with ``__dlpack__`` of the call's shape and dtype,
        which JAX aliases on the CPU: no copy in); write the result to ``target``.

        Taking a DLPack view costs about 30 us whatever the size, a ``memmove`` about 25 us per MiB
        (measured on the development machine), so large inputs are aliased (:data:`ALIAS_BYTES`).
        """
        local = jax.dlpack.from_dlpack(source, device=self._device)
        self._invoke(self._plan.build(local), target)

    def _invoke(self, block: jax.Array, target: int) -> None:
        """Run the plan's program on the global array ``block``; copy the result to ``target``."""
        plan = self._plan
        if plan.out is None:
            self._finish(plan.fn(block), target)
            return
        # The output lands in the buffer donated to the program (XLA aliases it), whose address is
        # known: no object of the result is looked into.
        address, buffer = plan.out
        out = plan.host_fn(block, buffer)
        out.block_until_ready()
        plan.out = (address, out)
        if plan.aliased is None:
            plan.aliased = _first_block(out).unsafe_buffer_pointer() == address
            if not plan.aliased:  # XLA chose another buffer: copy from it, and stop donating
                plan.out = None
                address = _first_block(out).unsafe_buffer_pointer()
        if self.nbytes_out:
            memmove(target, address, self.nbytes_out)

    def run(self, source: int, source_array: Callable[[], np.ndarray[Any, Any]], target: int) -> None:
        """Run on the ``nbytes_in`` bytes at address ``source``; write ``nbytes_out`` result bytes to ``target``.

        :param source_array: Returns the source as a NumPy array of the call's shape and dtype
            (used instead of ``source`` when the input is not staged).
        """
        if self.staged:
            self.run_staged(source, target)
            return
        local = jax.device_put(source_array().reshape(self._shape), self._device)
        self._finish(self._plan.fn(self._plan.build(local)), target)

    def _finish(self, out: jax.Array, target: int) -> None:
        out.block_until_ready()  # as raw JAX waits, on the global array
        if self.nbytes_out:
            memmove(target, _first_block(out).unsafe_buffer_pointer(), self.nbytes_out)


class _Plan:
    """One compiled collective for one (collective, reduction, shape, dtype), with what calls it cheaply.

    ``fn`` is the compiled program and ``build`` turns this process's single-device block into
    the global array it takes. For blocks up to :data:`STAGED_BYTES` the plan also owns a device
    buffer that torch callers copy their data into (``staged``: its address and the global array
    wrapping it, made once), and an output buffer (``out``: its address and the global array)
    that ``host_fn``, the same program taking the output buffer as a donated second argument,
    writes its result into; each result becomes the next call's output buffer. So a call in a
    loop allocates and wraps nothing, and the result is read at a known address.
    """

    __slots__ = ("aliased", "build", "fn", "host_fn", "out", "staged")

    def __init__(self, fn: Callable[..., jax.Array], build: Callable[[jax.Array], jax.Array]) -> None:
        self.fn = fn
        self.build = build
        self.staged: tuple[int, jax.Array] | None = None
        self.host_fn: Callable[..., jax.Array] = fn
        self.out: tuple[int, jax.Array] | None = None
        self.aliased: bool | None = None


_NOT_YET: Any = object()
"""What :meth:`Communicator.call` finds for a call it has no plan for yet."""

STAGED_BYTES = 16 << 20
"""Blocks up to this size are copied into a device buffer that the plan keeps; larger ones are
handed to JAX without a copy (``jax.device_put`` of a NumPy view aliases host memory on CPU, but
measured slower per call than a ``memmove`` into a resident buffer up to several MiB)."""

ALIAS_BYTES = 2 << 20
"""Staged calls on inputs of this size or more take the input through DLPack (no copy) instead of a
``memmove`` into the device buffer (see :meth:`HostCall.run_aliased`): 30 us against 50 us at 2 MiB,
107 us at 4 MiB (one process, CPU time)."""

STAGING_LIMIT = 256 << 20
"""The most bytes of staging buffers one gang keeps; calls beyond it stage without a buffer."""


def _builder(shape: tuple[int, ...], dtype: np.dtype[Any], sharding: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    """Return a function that wraps this process's block into the global array of ``shape``.

    ``jax.make_array_from_single_device_arrays`` re-derives the abstract value and checks the
    block on every call (about 30 us); the blocks given here are made by the plan itself, with
    the right shape, dtype and device, so the abstract value is computed once and the checks are
    skipped. If this JAX has no such constructor, the public function is used.
    """
    try:
        from jax._src import core
        from jax._src.array import ArrayImpl

        aval = core.update_aval_with_sharding(core.ShapedArray(shape, dtype, weak_type=False), sharding)

        def fast(local: jax.Array) -> jax.Array:
            return cast(jax.Array, ArrayImpl(aval, sharding, [cast(Any, local)], committed=True, _skip_checks=True))

        return fast
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - depends on the JAX version
        return lambda local: jax.make_array_from_single_device_arrays(shape, sharding, [local])


class Communicator:
    """Runs compiled collectives among the processes owning ``devices`` (gang rank ``i`` owns ``devices[i]``).

    Every collective takes this process's block (its data with a leading axis of length 1) and
    returns this process's result block, also with a leading axis of length 1. :meth:`run` takes
    ``jax.Array`` or NumPy blocks; :meth:`host_call` prepares a :class:`HostCall` that works on
    host memory, the path torch callers use.

    :param devices: One JAX device per member, in gang rank order.
    :param rank: This process's index in ``devices``.
    """

    def __init__(self, devices: list[jax.Device], rank: int) -> None:
        self.devices = devices
        self.rank = rank
        self.size = len(devices)
        self.device = devices[rank]
        self.mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
        self.sharding = NamedSharding(self.mesh, _SPEC)
        self._plans: dict[_Key, _Plan] = {}
        self._local: dict[_Key, _Plan | None] = {}
        """The plans of :meth:`call` (``None``: one that runs through the blocks of :meth:`run`)."""
        self._staged_bytes = 0

    @property
    def cache_size(self) -> int:
        """The number of compiled programs held (JAX's own count: a retrace would show here)."""
        total = 0
        for plan in [*self._plans.values(), *filter(None, self._local.values())]:
            for fn in {id(plan.fn): plan.fn, id(plan.host_fn): plan.host_fn}.values():
                count = getattr(fn, "_cache_size", None)
                total += int(count()) if callable(count) else 1
        return total

    def clear(self) -> None:
        """Drop every compiled collective and staging buffer."""
        self._plans.clear()
        self._local.clear()
        self._staged_bytes = 0

    def _plan(self, key: _Key, body: Callable[[], _Body], shape: tuple[int, ...], dtype: np.dtype[Any]) -> _Plan:
        plan = self._plans.get(key)
        if plan is None:
            mapped = jax.shard_map(body(), mesh=self.mesh, in_specs=_SPEC, out_specs=_SPEC)
            global_shape = (self.size, *shape[1:])
            plan = _Plan(jax.jit(mapped), _builder(global_shape, dtype, self.sharding))
            self._plans[key] = plan
        return plan

    def _output_buffer(self, plan: _Plan, body: _Body, staged_input: jax.Array) -> None:
        """Give ``plan`` its donated output buffer and the program that writes into it.

        The first buffer is made by a compiled program with exactly the sharding of the
        program's results (XLA may simplify it, e.g. on a mesh of one device), so every call has
        the signature of the steady state and JAX caches the program once.
        """

        def with_output(block: jax.Array, output: jax.Array) -> jax.Array:
            return body(block)

        mapped = jax.shard_map(with_output, mesh=self.mesh, in_specs=(_SPEC, _SPEC), out_specs=_SPEC)
        host_fn = jax.jit(mapped, donate_argnums=1, keep_unused=True)
        result = jax.eval_shape(plan.fn, staged_input)
        like = jax.ShapeDtypeStruct(result.shape, result.dtype, sharding=self.sharding)  # type: ignore[no-untyped-call]
        sharding = host_fn.lower(staged_input, like).compile().output_shardings
        buffer = jax.jit(lambda: jnp.zeros(result.shape, result.dtype), out_shardings=sharding)()
        buffer.block_until_ready()
        plan.host_fn = host_fn
        plan.out = (_first_block(buffer).unsafe_buffer_pointer(), buffer)

    def run(self, key: _Key, body: Callable[[], _Body], block: jax.Array | np.ndarray[Any, Any]) -> jax.Array:
        """Run a collective on this process's ``block`` (leading axis 1); return this process's result block."""
        dtype = np.dtype(block.dtype)
        plan = self._plan(key, body, tuple(block.shape), dtype)
        if isinstance(block, jax.Array) and block.devices() == {self.device}:
            local = block
        else:
            local = jax.device_put(block, self.device)
        if local.dtype != dtype:  # a 64-bit NumPy block outside JAX's 64-bit mode
            raise ValueError(f"`x` of dtype {dtype} needs `jax.enable_x64` to be staged.")
        out = plan.fn(plan.build(local))
        result: jax.Array = out.addressable_data(0)
        return result

    def host_call(
        self,
        key: _Key,
        body: Callable[[], _Body],
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        nbytes_out: int,
        *,
        copy_in: bool = True,
    ) -> HostCall:
        """The collective ``key`` on host memory: a block of ``shape`` (leading axis 1) and ``dtype``.

        :param nbytes_out: The bytes of the result to copy out (``0``: none, as for a barrier).
        :param copy_in: Whether the input matters (``False``: a rank that only receives, whose
            block the program ignores, is not copied in).
        """
        plan = self._plan(key, body, shape, dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if plan.staged is None and 0 < nbytes <= STAGED_BYTES and self._staged_bytes + nbytes <= STAGING_LIMIT:
            plan.staged = self._staging_buffer(plan, shape, dtype)
            self._output_buffer(plan, body(), plan.staged[1])
            self._staged_bytes += nbytes
        staged = plan.staged
        return HostCall(plan, staged, shape, dtype, self.device, nbytes_out, copy_in=copy_in)

    def _staging_buffer(self, plan: _Plan, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[int, jax.Array]:
        """A device buffer that this plan owns: its address and the global array wrapping it.

        On CPU a JAX buffer is host memory at a fixed address; writing it is safe here because
        every call waits for its result, so no computation reads the buffer while it is written,
        and the buffer never leaves the plan.
        """
        local = jax.device_put(np.zeros(shape, dtype), self.device)
        local.block_until_ready()
        return local.unsafe_buffer_pointer(), plan.build(local)

    def program(self, kernel: Kernel, shape: tuple[int, ...], dtype: np.dtype[Any], args: tuple[Any, ...]) -> _Program:
        """The (cache key, body factory) of ``kernel`` with ``args`` on a block of ``shape`` and ``dtype``."""
        return (kernel.name, *args, tuple(shape), dtype), lambda: kernel.body(self.size, dtype, *args)

    def call(
        self,
        kernel: Kernel,
        x: jax.Array,
        args: tuple[Any, ...] = (),
        *,
        pre: Callable[[jax.Array], jax.Array] | None = None,
        post: Callable[[jax.Array, np.dtype[Any]], jax.Array] | None = None,
    ) -> jax.Array:
        """Run ``kernel`` with ``args`` on this process's array ``x`` (its block); return this process's result.

        :param pre: Applied to the block before the kernel, inside the compiled program.
        :param post: ``post(result, x.dtype)``, applied to the kernel's result inside the program.

        The program takes ``x`` itself as this process's shard and returns this process's result
        as its shard (the leading axis of length 1 that the kernels add is taken off inside the
        program), so a call runs the compiled program and nothing else on JAX's side, as a raw
        ``jit(shard_map(...))`` call does. Where that cannot be, a 0-d ``x``, one with no rows, or
        a 0-d result, the leading axis is added and taken off outside the program.
        """
        shape, dtype = x.shape, x.dtype
        key = (kernel.name, pre, post, args, shape, dtype)
        plan = self._local.get(key, _NOT_YET)
        if plan is _NOT_YET:
            plan = self._local[key] = self._local_plan(kernel, args, tuple(shape), np.dtype(dtype), pre, post)
        if plan is None:
            block = x[None] if pre is None else pre(x[None])
            key, body = self.program(kernel, tuple(block.shape), np.dtype(block.dtype), args)
            out = self.run(key, body, block)
            return (out if post is None else post(out, np.dtype(dtype)))[0]
        local = x if x.devices() == {self.device} else jax.device_put(x, self.device)
        return _first_block(plan.fn(plan.build(local)))

    def _local_plan(
        self,
        kernel: Kernel,
        args: tuple[Any, ...],
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        pre: Callable[[jax.Array], jax.Array] | None,
        post: Callable[[jax.Array, np.dtype[Any]], jax.Array] | None,
    ) -> _Plan | None:
        """The plan of :meth:`call` for ``x`` of ``shape`` and ``dtype`` (``None``: it runs through the blocks)."""
        if not shape or shape[0] == 0:
            return None
        if pre is None:
            inner = dtype
        else:
            inner = np.dtype(jax.eval_shape(pre, jax.ShapeDtypeStruct(shape, dtype)).dtype)  # type: ignore[no-untyped-call]
        body = kernel.body(self.size, inner, *args)

        def block(b: jax.Array) -> jax.Array:  # [1, *shape] -> the result with its leading axis of length 1
            y = body(b if pre is None else pre(b))
            return y if post is None else post(y, dtype)

        rows = jax.shard_map(block, mesh=self.mesh, in_specs=_SPEC, out_specs=_SPEC)
        like = jax.ShapeDtypeStruct((self.size, *shape), dtype, sharding=self.sharding)  # type: ignore[no-untyped-call]
        if len(jax.eval_shape(rows, like).shape) == 1:  # a 0-d result cannot be a shard
            return None
        mapped = jax.shard_map(lambda b: block(b[None])[0], mesh=self.mesh, in_specs=_SPEC, out_specs=_SPEC)
        return _Plan(jax.jit(mapped), _builder((self.size * shape[0], *shape[1:]), dtype, self.sharding))
