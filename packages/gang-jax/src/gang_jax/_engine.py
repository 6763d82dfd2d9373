"""What runs a :class:`~gang_jax.JaxGang`'s collectives on torch tensors: JAX in this process, or a child.

:class:`Engine` is the interface; :class:`LocalEngine` runs the collectives on this process's JAX
runtime (a :class:`~gang_jax._collectives.Communicator`), which :func:`start_runtime` and
:func:`stop_runtime` bring up and down. The isolated engine (:mod:`gang_jax._isolated`) forwards
the same calls to a child process (:mod:`gang_jax._server`) that holds a :class:`LocalEngine` per
gang. Arguments were checked by :class:`gang.Gang`; engines raise the backend's own exception
(one of :data:`gang.errors.BACKEND_ERRORS`), which the gang turns into a ``GangError``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import jax
import numpy as np
import torch
from jax.extend.backend import clear_backends
from torch import Tensor

from gang import ReduceOperation
from gang_jax._collectives import Communicator, HostCall
from gang_jax._convert import as_raw_bits, to_numpy
from gang_jax._rendezvous import Rendezvous


def start_runtime(where: Rendezvous, timeout: timedelta) -> None:
    """Initialise ``jax.distributed`` in this process; ``timeout`` bounds the join, the heartbeat and the shutdown."""
    seconds = max(1, math.ceil(timeout.total_seconds()))
    jax.distributed.initialize(
        where.coordinator_address,
        where.num_processes,
        where.process_id,
        initialization_timeout=seconds,
        heartbeat_timeout_seconds=seconds,
        shutdown_timeout_seconds=seconds,
    )


def stop_runtime() -> None:
    """Shut ``jax.distributed`` down, so that :func:`start_runtime` works again afterwards."""
    # Drop the XLA clients first: they hold the distributed runtime, and JAX refuses to initialise
    # it again while a client exists.
    clear_backends()  # type: ignore[no-untyped-call]
    jax.distributed.shutdown()  # type: ignore[no-untyped-call]


def _process_devices() -> dict[int, jax.Device]:
    """Map each JAX process index to the first CPU device it owns (device ids are not dense)."""
    owned: dict[int, jax.Device] = {}
    for device in sorted(jax.devices("cpu"), key=lambda d: d.id):
        owned.setdefault(device.process_index, device)
    return owned


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

    Each (collective, dtype, shape, reduction or source) gets a
    :class:`~gang_jax._collectives.HostCall` on first use: the input is copied into a device
    buffer that the call keeps (small inputs) or aliased by JAX (large ones), and the result is
    copied from JAX's output buffer straight into the caller's tensor, the one copy a collective
    on host tensors must make. 64-bit reductions run inside a scoped ``jax.enable_x64``
    (entering it costs tens of microseconds, so nothing else does); data movement sends 8-byte
    items as two 32-bit words.

    :param comm: The compiled collectives of the gang.
    :param members: The JAX process index of each member, in gang rank order.
    """

    def __init__(self, comm: Communicator, members: tuple[int, ...]) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.members = members
        self._calls: dict[tuple[Any, ...], HostCall] = {}
        self._token = torch.zeros(1, dtype=torch.int32)

    @classmethod
    def of_processes(cls, members: list[int]) -> LocalEngine:
        """The engine of a gang of ``members`` (JAX process indices, this one among them) on this process's runtime.

        :raises ValueError: If this process is not a member, or a member owns no CPU device.
        """
        devices = _process_devices()
        me = jax.process_index()
        if me not in members:
            raise ValueError(f"`members` must contain this process ({me}), but is {members} instead.")
        missing = [m for m in members if m not in devices]
        if missing:
            raise ValueError(f"`members` must be JAX processes that own a CPU device, but {missing} own none.")
        return cls(Communicator([devices[m] for m in members], members.index(me)), tuple(members))

    def _run(self, key: tuple[Any, ...], source: Tensor, target: Tensor, *, bits: bool, wide: bool = False) -> None:
        """Run the collective ``key`` (its first item names it) from ``source`` into ``target``."""
        if not source.is_contiguous():
            source = source.contiguous()
        call = self._calls.get(key)
        if call is not None and call.staged and not wide:
            # The steady state of a loop: as little as possible between the call and the collective.
            call.run_staged(source.data_ptr(), target.data_ptr())
            return
        with jax.enable_x64(True) if wide else nullcontext():
            if call is None:
                call = self._calls[key] = self._prepare(key, source, target, bits)

            def array() -> np.ndarray[Any, Any]:
                x = to_numpy(source)
                return as_raw_bits(x) if bits else x

            call.run(source.data_ptr(), array, target.data_ptr())

    def _prepare(self, key: tuple[Any, ...], source: Tensor, target: Tensor, bits: bool) -> HostCall:
        x = to_numpy(source)
        if bits:
            x = as_raw_bits(x)
        name = key[0]
        if name == "all_reduce":
            program = self.comm.all_reduce_program(x.shape, x.dtype, key[3])
        elif name == "reduce_scatter":
            program = self.comm.reduce_scatter_program(x.shape, x.dtype, key[3])
        elif name == "all_gather":
            program = self.comm.all_gather_program(x.shape, x.dtype)
        elif name == "all_to_all":
            x = x.reshape(self.size, -1)
            program = self.comm.all_to_all_program(x.shape, x.dtype)
        else:
            program = self.comm.broadcast_program(x.shape, x.dtype, key[3])
        return self.comm.host_call(*program, (1, *x.shape), x.dtype, target.numel() * target.element_size())

    def barrier(self) -> None:
        """Wait for every member (a one-element all-reduce)."""
        self.all_reduce(self._token, ReduceOperation.SUM)

    def all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        """Reduce ``tensor`` over the members, in place."""
        wide = tensor.element_size() >= 8  # float64, int64, complex128: in JAX's 64-bit mode
        self._run(("all_reduce", tensor.dtype, tensor.shape, op), tensor, tensor, bits=False, wide=wide)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """Gather every member's raw bits of ``input`` into ``output``."""
        self._run(("all_gather", input.dtype, input.shape), input, output, bits=True)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOperation) -> None:
        """Reduce row ``rank`` of every member's ``input`` into ``output``."""
        wide = input.element_size() >= 8
        self._run(("reduce_scatter", input.dtype, input.shape, op), input, output, bits=False, wide=wide)

    def all_to_all(self, output: Tensor, input: Tensor) -> None:
        """Exchange rows of raw bits."""
        self._run(("all_to_all", input.dtype, input.shape), input, output, bits=True)

    def broadcast(self, tensor: Tensor, source_rank: int) -> None:
        """Broadcast raw bits from ``source_rank``."""
        if tensor.numel() == 0:
            self.barrier()
            return
        self._run(("broadcast", tensor.dtype, tensor.shape, source_rank), tensor, tensor, bits=True)

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
        self._calls.clear()
        self.comm.clear()
