"""The :class:`JaxGang`: a :class:`gang.Gang` whose collectives run on JAX."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, final

import jax
import numpy as np
import torch
from jax.extend.backend import clear_backends
from torch import Tensor
from torch.distributed import ProcessGroup
from typing_extensions import override

from gang import Gang, InvalidOperationError, NotSupportedError, ReduceOperation
from gang.extend import check_int, check_rank, check_timeout, operation_error
from gang_jax._collectives import Communicator
from gang_jax._convert import as_raw_bits, to_numpy
from gang_jax._rendezvous import resolve

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""How long :meth:`JaxGang.create_default` waits for every process to join, when no timeout is given."""


def _process_devices() -> dict[int, jax.Device]:
    """Map each JAX process index to the first CPU device it owns (device ids are not dense)."""
    owned: dict[int, jax.Device] = {}
    for device in sorted(jax.devices("cpu"), key=lambda d: d.id):
        owned.setdefault(device.process_index, device)
    return owned


@final
class JaxGang(Gang):
    """A gang whose collectives run on JAX's multi-process CPU collectives.

    Gang rank ``i`` is the process owning the ``i``-th device of the gang's mesh (one device per
    process: the first CPU device the process owns). Collectives take torch CPU tensors (updated
    in place) or NumPy arrays and give the same results as :class:`gang.ProcessGroupGang`. 64-bit
    types are handled whatever ``jax_enable_x64`` says. Create the root with
    :meth:`create_default`; sub-gangs come from :meth:`create_gang` and :meth:`split`.

    :param members: The JAX process index of each member, in gang rank order.
    :param owns_runtime: Whether closing this gang shuts ``jax.distributed`` down.
    :param debug: Whether every collective first checks that all ranks make the same call
        (``None``: on when the environment variable ``GANG_DEBUG`` says so). Sub-gangs inherit it.
    :raises ValueError: If this process is not one of ``members`` or a member owns no CPU device.
    """

    def __init__(self, members: list[int], *, owns_runtime: bool = False, debug: bool | None = None) -> None:
        devices = _process_devices()
        me = jax.process_index()
        if me not in members:
            raise ValueError(f"`members` must contain this process ({me}), but is {members} instead.")
        missing = [m for m in members if m not in devices]
        if missing:
            raise ValueError(f"`members` must be JAX processes that own a CPU device, but {missing} own none.")
        self._members = tuple(members)
        self._owns_runtime = owns_runtime
        self._comm = Communicator([devices[m] for m in members], members.index(me))
        super().__init__(rank=self._comm.rank, size=self._comm.size, device=torch.device("cpu"), debug=debug)

    @classmethod
    def create_default(
        cls,
        *,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        timeout: timedelta | None = None,
        debug: bool | None = None,
    ) -> JaxGang:
        """Initialise ``jax.distributed`` and return a gang of every JAX process.

        Missing arguments come from ``JAX_COORDINATOR_ADDRESS``, then from the launcher as
        :mod:`gang.env` reads it (torchrun, SLURM ``srun``, Open MPI ``mpirun``): the number of
        processes and this process's index are the world size and rank. Under torchrun rank 0
        picks a free port on ``MASTER_ADDR`` and shares it through the agent's store, so it never
        clashes with the store's port; under SLURM and Open MPI the coordinator is the rendezvous
        address of :func:`gang.env.get_master_address` on the port after its port. Without a
        launcher, JAX's own cluster detection (Kubernetes, Cloud TPU, ...) fills in what it can,
        and a process without any gets a gang of one. If ``jax.distributed`` is already
        initialised and no argument is given, the gang wraps it and :meth:`close` leaves it running.

        :param coordinator_address: ``host:port`` of the JAX coordinator (served by process 0).
        :param num_processes: The number of processes.
        :param process_id: This process's index, in ``[0, num_processes)``.
        :param timeout: How long to wait for every process to join (default 5 minutes). It is
            also JAX's heartbeat and shutdown timeout: when a process of the job dies, JAX's
            coordination service notices within ``timeout`` and then *terminates every other
            process* (``SIGABRT``, exit status 134, "Terminating process because the JAX
            distributed service detected fatal errors ... Task N heartbeat timeout" on stderr).
            Survivors whose collective talks to the dead process directly get a
            :class:`~gang.GangError` first. See "JAX gangs" in the failures guide.
        :param debug: Turn debug mode on or off for this gang and its sub-gangs (``None``: from
            ``GANG_DEBUG``); see :attr:`gang.Gang.debug`.
        :raises TypeError: If an argument has the wrong type.
        :raises ValueError: If ``num_processes`` or ``process_id`` is out of range, or ``timeout``
            is not positive.
        :raises InvalidOperationError: If ``jax.distributed`` is already initialised and arguments are given.
        :raises GangError: If the rendezvous fails or times out.
        """
        if coordinator_address is not None and not isinstance(coordinator_address, str):
            raise TypeError(f"`coordinator_address` must be a `str`, but is {coordinator_address!r} instead.")
        if num_processes is not None:
            num_processes = check_int("num_processes", num_processes, minimum=1)
        if process_id is not None:
            if num_processes is None:
                process_id = check_int("process_id", process_id, minimum=0)
            else:
                process_id = check_rank("process_id", process_id, num_processes)
        timeout = check_timeout(timeout, default=DEFAULT_TIMEOUT)

        if jax.distributed.is_initialized():
            if (coordinator_address, num_processes, process_id) != (None, None, None):
                raise InvalidOperationError(
                    "`jax.distributed` is already initialised; call `create_default()` without arguments to wrap it."
                )
            return cls(list(range(jax.process_count())), owns_runtime=False, debug=debug)

        where = resolve(coordinator_address, num_processes, process_id, timeout)
        seconds = max(1, math.ceil(timeout.total_seconds()))
        try:
            jax.distributed.initialize(
                where.coordinator_address,
                where.num_processes,
                where.process_id,
                initialization_timeout=seconds,
                heartbeat_timeout_seconds=seconds,
                shutdown_timeout_seconds=seconds,
            )
        except (RuntimeError, ValueError, OSError) as ex:
            raise operation_error(
                "create_default",
                (where.process_id, where.num_processes),
                f"coordinator {where.coordinator_address}: {ex}",
            ) from ex
        return cls(list(range(jax.process_count())), owns_runtime=True, debug=debug)

    # -- properties -----------------------------------------------------------------------------

    @property
    @override
    def supports_process_group(self) -> bool:
        return False

    @property
    def members(self) -> tuple[int, ...]:
        """The JAX process index of each member, in gang rank order."""
        return self._members

    @property
    def jax_device(self) -> jax.Device:
        """The JAX device this process contributes to the gang's mesh."""
        return self._comm.device

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The one-dimensional mesh (axis ``"gang"``) of the members' devices, in rank order."""
        return self._comm.mesh

    @property
    def num_compiled(self) -> int:
        """How many compiled collectives this gang holds (one per collective, reduction, shape and dtype)."""
        return self._comm.cache_size

    # -- implementation ---------------------------------------------------------------------------

    @contextmanager
    def _translate(self, operation: str, dtype: torch.dtype | None = None) -> Iterator[None]:
        # 64-bit reductions need JAX's 64-bit mode; entering it costs tens of microseconds, so
        # only they pay for it (bits are moved as 32-bit words, see `as_raw_bits`).
        wide = dtype is not None and dtype.itemsize == 8
        try:
            with jax.enable_x64(True) if wide else nullcontext():
                yield
        except (RuntimeError, ValueError, OSError) as ex:  # JaxRuntimeError derives from RuntimeError
            raise operation_error(operation, self, ex) from ex

    def _communicator(self) -> Communicator:
        """The collectives of this gang, for :mod:`gang_jax.functional`."""
        return self._comm

    @override
    def _split(self, groups: list[list[int]]) -> Gang | None:
        # No communication is needed: every member computes the same meshes from the same groups.
        for group in groups:
            if self.rank in group:
                if group == list(range(self.size)):
                    return JaxGang(list(self._members))
                return JaxGang([self._members[r] for r in group])
        return None

    @override
    def _as_process_group(self) -> ProcessGroup:
        raise NotSupportedError("`JaxGang` has no torch process group; use its collectives instead.")

    @override
    def _barrier(self) -> None:
        with self._translate("barrier"):
            np.asarray(self._comm.all_reduce(np.zeros(1, dtype=np.int32), ReduceOperation.SUM))

    @override
    def _all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        with self._translate("all_reduce", tensor.dtype):
            _write(tensor, self._comm.all_reduce(to_numpy(tensor), op))

    @override
    def _all_gather(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        with self._translate("all_gather"):
            _write_bits(output_tensor, self._gather_bits(input_tensor))

    @override
    def _all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        with self._translate("all_gather_to_list"):
            rows = self._gather_bits(input_tensor)
            for i, out in enumerate(output_tensors):
                np.copyto(_raw_view(out), rows[i])

    @override
    def _reduce_scatter(self, output_tensor: Tensor, input_tensor: Tensor, op: ReduceOperation) -> None:
        with self._translate("reduce_scatter", input_tensor.dtype):
            _write(output_tensor, self._comm.reduce_scatter(to_numpy(input_tensor), op))

    @override
    def _all_to_all(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        with self._translate("all_to_all"):
            bits = as_raw_bits(to_numpy(input_tensor)).reshape(self.size, -1)
            _write_bits(output_tensor, np.asarray(self._comm.all_to_all(bits)))

    @override
    def _broadcast(self, tensor: Tensor, source_rank: int) -> None:
        with self._translate("broadcast"):
            if tensor.numel() == 0:
                self._barrier()
                return
            _write_bits(tensor, np.asarray(self._comm.broadcast_bits(as_raw_bits(to_numpy(tensor)), source_rank)))

    def _gather_bits(self, input_tensor: Tensor) -> np.ndarray[Any, Any]:
        """All-gather the raw bits of ``input_tensor``; return ``[size, n_words]``."""
        block = np.asarray(self._comm.all_gather(as_raw_bits(to_numpy(input_tensor))))
        rows: np.ndarray[Any, Any] = block[0]
        return rows

    @override
    def _close(self) -> None:
        self._comm.clear()
        if self._owns_runtime and jax.distributed.is_initialized():
            try:
                # Drop the XLA clients first: they hold the distributed runtime, and JAX refuses to
                # initialise it again while a client exists (so `create_default` works after this).
                clear_backends()  # type: ignore[no-untyped-call]
                jax.distributed.shutdown()  # type: ignore[no-untyped-call]
            except RuntimeError as ex:
                raise operation_error("close", self, ex) from ex


def _raw_view(tensor: Tensor) -> np.ndarray[Any, Any]:
    return as_raw_bits(to_numpy(tensor))


def _write(tensor: Tensor, result: jax.Array) -> None:
    """Copy ``result`` into ``tensor`` (same number of elements and dtype)."""
    np.copyto(to_numpy(tensor), np.asarray(result).reshape(tuple(tensor.shape)))


def _write_bits(tensor: Tensor, bits: np.ndarray[Any, Any]) -> None:
    """Copy raw bits into ``tensor``."""
    np.copyto(_raw_view(tensor), bits.reshape(-1))
