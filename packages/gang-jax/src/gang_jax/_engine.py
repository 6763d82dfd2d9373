"""What runs a :class:`~gang_jax.JaxGang`'s collectives on torch tensors: JAX in this process, or a child.

:class:`Engine` is the interface; :class:`LocalEngine` runs the collectives on this process's JAX
runtime (a :class:`~gang_jax._collectives.Communicator`). The isolated engine
(:mod:`gang_jax._isolated`) forwards the same calls to a child process that holds a
:class:`LocalEngine`. Arguments were checked by :class:`gang.Gang`; engines raise
:class:`~gang.GangError` or the backend's own exception, which the gang turns into a ``GangError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import jax
import numpy as np
from torch import Tensor

from gang import GangError, ReduceOperation
from gang_jax._collectives import Communicator
from gang_jax._convert import as_raw_bits, to_numpy

FAILURES = (RuntimeError, ValueError, OSError)
"""What a failing collective raises (JAX's ``JaxRuntimeError`` derives from ``RuntimeError``; an
isolated engine raises :class:`RuntimeError` subclasses)."""


def operation_failed(operation: str, rank: int, size: int, cause: BaseException) -> GangError:
    """The :class:`~gang.GangError` for ``operation`` failing with ``cause`` (the caller chains it)."""
    return GangError(f"`{operation}` failed on rank {rank} of a gang of size {size}: {cause}")


class Engine(ABC):
    """The collectives of one gang on torch CPU tensors (updated in place)."""

    rank: int
    size: int
    members: tuple[int, ...]
    """The JAX process index of each member, in gang rank order."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every member."""

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        """Reduce ``tensor`` over the members, in place."""

    @abstractmethod
    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """Write every member's ``input`` into ``output`` (``[size, *input.shape]`` elements)."""

    @abstractmethod
    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOperation) -> None:
        """Reduce row ``rank`` of every member's ``input`` (``[size, ...]``) into ``output``."""

    @abstractmethod
    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """Send row ``j`` of ``input`` to member ``j``; row ``i`` of ``output`` comes from member ``i``."""

    @abstractmethod
    def broadcast(self, tensor: Tensor, source_rank: int) -> None:
        """Copy ``source_rank``'s ``tensor`` into every member's ``tensor``, bit for bit."""

    @abstractmethod
    def split(self, ranks: list[int]) -> Engine:
        """The engine of the sub-gang of ``ranks`` (ranks of this gang, sorted, holding this process)."""

    @property
    @abstractmethod
    def num_compiled(self) -> int:
        """How many compiled programs the engine holds."""

    @abstractmethod
    def close(self) -> None:
        """Release what the engine holds (idempotent)."""


class LocalEngine(Engine):
    """Runs the collectives on this process's JAX runtime.

    Torch tensors cross into JAX as NumPy views (no copy); results are copied back into the
    caller's tensors, which is the one copy a collective on host tensors must make. 64-bit
    reductions run inside a scoped ``jax.enable_x64`` (entering it costs tens of microseconds, so
    nothing else does); data movement sends 8-byte items as two 32-bit words.

    :param comm: The compiled collectives of the gang.
    :param members: The JAX process index of each member, in gang rank order.
    """

    def __init__(self, comm: Communicator, members: tuple[int, ...]) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.members = members

    def barrier(self) -> None:
        """Wait for every member (a one-element all-reduce)."""
        block = np.zeros((1, 1), dtype=np.int32)
        key, body = self.comm.all_reduce_program((1,), block.dtype, ReduceOperation.SUM)
        self.comm.run_host(key, body, block)

    def all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        """Reduce ``tensor`` over the members, in place."""
        x = to_numpy(tensor)
        key, body = self.comm.all_reduce_program(x.shape, x.dtype, op)
        if x.dtype.itemsize == 8:
            with jax.enable_x64(True):
                result = self.comm.run_host(key, body, x[None])
        else:
            result = self.comm.run_host(key, body, x[None])
        np.copyto(x, result[0])

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """Gather every member's raw bits of ``input`` into ``output``."""
        bits = as_raw_bits(to_numpy(input))
        key, body = self.comm.all_gather_program(bits.shape, bits.dtype)
        _write_bits(output, self.comm.run_host(key, body, bits[None]))

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOperation) -> None:
        """Reduce row ``rank`` of every member's ``input`` into ``output``."""
        x = to_numpy(input)
        key, body = self.comm.reduce_scatter_program(x.shape, x.dtype, op)
        if x.dtype.itemsize == 8:
            with jax.enable_x64(True):
                result = self.comm.run_host(key, body, x[None])
        else:
            result = self.comm.run_host(key, body, x[None])
        np.copyto(to_numpy(output), result.reshape(tuple(output.shape)))

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """Exchange rows of raw bits."""
        bits = as_raw_bits(to_numpy(input)).reshape(self.size, -1)
        key, body = self.comm.all_to_all_program(bits.shape, bits.dtype)
        _write_bits(output, self.comm.run_host(key, body, bits[None]))

    def broadcast(self, tensor: Tensor, source_rank: int) -> None:
        """Broadcast raw bits from ``source_rank``."""
        if tensor.numel() == 0:
            self.barrier()
            return
        bits = as_raw_bits(to_numpy(tensor))
        key, body = self.comm.broadcast_program(bits.shape, bits.dtype, source_rank)
        _write_bits(tensor, self.comm.run_host(key, body, bits[None]))

    def split(self, ranks: list[int]) -> LocalEngine:
        """A new engine on the sub-mesh of ``ranks`` (no communication: every member derives the same mesh)."""
        devices = [self.comm.devices[r] for r in ranks]
        return LocalEngine(Communicator(devices, ranks.index(self.rank)), tuple(self.members[r] for r in ranks))

    @property
    def num_compiled(self) -> int:
        """The compiled programs of this gang."""
        return self.comm.cache_size

    def close(self) -> None:
        """Drop the compiled programs and staging buffers."""
        self.comm.clear()


def _write_bits(tensor: Tensor, bits: np.ndarray[Any, Any]) -> None:
    """Copy raw bits into ``tensor``."""
    np.copyto(as_raw_bits(to_numpy(tensor)), bits.reshape(-1))
