"""A gang over a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Protocol, TypeVar, final

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    PrefixStore,
    ReduceScatterOptions,
    Store,
    TCPStore,
)
from torch.distributed import ProcessGroup
from torch.overrides import has_torch_function_unary
from typing_extensions import override

from gang._torch_groups import new_named_group

__all__ = ["DEFAULT_TIMEOUT", "ProcessGroupGang", "new_named_group"]
from gang.env import get_master_address, get_rank, get_world_size
from gang.errors import GangError, InvalidOperationError, NotSupportedError
from gang.extend import check_device, check_timeout, operation_error
from gang.gang import Gang, ReduceOperation

DEFAULT_TIMEOUT = timedelta(minutes=15)
"""The collective timeout of :meth:`ProcessGroupGang.create_default_process_group` when none is given."""

# What torch raises when a collective fails (DistError and its kin derive from RuntimeError).
_BACKEND_ERRORS = (RuntimeError, ValueError, OSError)

_REDUCE_OPS = {
    ReduceOperation.SUM: dist.ReduceOp.SUM,
    ReduceOperation.MEAN: dist.ReduceOp.AVG,
    ReduceOperation.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOperation.MIN: dist.ReduceOp.MIN,
    ReduceOperation.MAX: dist.ReduceOp.MAX,
}

# The dtypes that torch.distributed's functions rewrite before they call the group (complex
# tensors as pairs of reals, float8 as bytes in `broadcast`).
_REWRITTEN_DTYPES = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and (d.is_complex or "float8" in str(d))
)


def _direct(tensor: Tensor) -> bool:
    """Whether a collective on ``tensor`` may call the process group's own method with prepared options.

    ``dist.all_reduce`` and its kin add, around that very call, checks the gang has already made
    and a few microseconds of Python that cost a small message about ten times as much right after
    the process wakes up (see "Small messages" in ``docs/performance.rst``). They stay in use for
    what only they handle: the dtypes they rewrite, tensor subclasses and torch function modes, and
    tracing by ``torch.compile`` (which turns them into functional collectives).
    """
    return (
        tensor.dtype not in _REWRITTEN_DTYPES
        and not has_torch_function_unary(tensor)
        and not torch.compiler.is_compiling()
    )


def _flat(tensor: Tensor) -> Tensor:
    """``tensor`` as one dimension (gloo wants the rows of a gather or scatter along the first).

    A new view costs about a microsecond per call, so a tensor that is flat already is kept.
    """
    return tensor if tensor.dim() == 1 else tensor.flatten()


class _Options(Protocol):
    asyncOp: bool  # noqa: N815 (torch's name)


_O = TypeVar("_O", bound=_Options)


def _sync_options(cls: type[_O]) -> _O:
    """Return new options of ``cls`` for a blocking call, as ``torch.distributed``'s functions build them."""
    opts = cls()
    opts.asyncOp = False
    return opts


# One store per rendezvous address, kept for the life of the process, and a generation counter.
# Each initialisation of the default group writes its keys under a fresh prefix, so a second
# round after `close()` never reads the first round's stale keys (raw torch does, under torchrun).
_stores: dict[tuple[str, int], Store] = {}
_generation = 0
_wrap_counts: dict[str, int] = {}


@final
class ProcessGroupGang(Gang):
    """A gang that wraps a ``torch.distributed`` process group.

    Create the root with :meth:`create_default_process_group` or wrap a group you already have
    with :meth:`from_process_group`. Every backend failure is raised as :class:`~gang.GangError`
    naming the operation, this process's rank and the gang size, with the cause chained.
    """

    def __init__(
        self,
        pg: ProcessGroup,
        device: torch.device,
        *,
        timeout: timedelta | None,
        owns_group: bool,
        is_default: bool,
        name: str | None = None,
        debug: bool | None = None,
    ) -> None:
        super().__init__(rank=dist.get_rank(pg), size=dist.get_world_size(pg), device=device, debug=debug)
        self._pg = pg
        self._timeout = timeout
        self._owns_group = owns_group
        self._is_default = is_default
        self._global_ranks = tuple(dist.get_process_group_ranks(pg))
        self._name = name
        self._splits = 0
        # Built once and handed straight to the group (see `_direct`).
        self._allreduce_options = {op: _sync_options(AllreduceOptions) for op in ReduceOperation}
        self._reduce_scatter_options = {op: _sync_options(ReduceScatterOptions) for op in ReduceOperation}
        for op, torch_op in _REDUCE_OPS.items():
            self._allreduce_options[op].reduceOp = dist.ReduceOp(torch_op)
            self._reduce_scatter_options[op].reduceOp = dist.ReduceOp(torch_op)
        self._allgather_options = _sync_options(AllgatherOptions)
        self._all_to_all_options = _sync_options(AllToAllOptions)
        self._broadcast_options: dict[int, BroadcastOptions] = {}
        self._barrier_options = _sync_options(BarrierOptions)
        self._barrier_options.device = pg.bound_device_id or torch.device("cpu")

    @classmethod
    def create_default_process_group(
        cls,
        device: torch.device,
        *,
        timeout: timedelta | None = None,
        high_priority: bool = False,
        debug: bool | None = None,
    ) -> ProcessGroupGang:
        """Initialise torch's default process group from the environment and wrap it as a gang.

        Works under torchrun, SLURM and Open MPI (see :mod:`gang.env`). gloo is used for a CPU
        device and NCCL for a CUDA device. Closing the gang destroys every group; initialising
        again afterwards in the same process works.

        :param device: ``cpu`` or ``cuda[:N]``.
        :param timeout: The timeout of every collective of this gang and its sub-gangs (default
            15 minutes); also bounds the rendezvous.
        :param high_priority: Use high-priority CUDA streams (NCCL only; ignored by gloo).
        :param debug: Check before every collective that all ranks make the same call (see
            :attr:`Gang.debug`); ``None`` reads the ``GANG_DEBUG`` environment variable.
        :raises ValueError: If ``device`` is neither CPU nor CUDA, or the environment is malformed.
        :raises TypeError: If ``device`` is not a ``torch.device`` or ``timeout`` not a ``timedelta``.
        :raises InvalidOperationError: If the default process group already exists.
        :raises NotSupportedError: If ``torch.distributed`` is not available.
        :raises GangError: If the rendezvous fails or times out.
        """
        global _generation
        device = check_device("device", device)
        if device.type == "cpu":
            backend = "gloo"
        elif device.type == "cuda":
            backend = "nccl"
        else:
            raise ValueError(f"`device` must be of type `cpu` or `cuda`, but is of type `{device.type}` instead.")
        timeout = check_timeout(timeout, default=DEFAULT_TIMEOUT)
        if not dist.is_available():
            raise NotSupportedError("`torch.distributed` is not available in this build of PyTorch.")
        if dist.is_initialized():
            raise InvalidOperationError("The default process group is already initialised.")

        rank, world_size = get_rank(), get_world_size()
        host, port = get_master_address()
        index: int | None = device.index  # None for a bare `cuda` (torch's stubs say int)
        if device.type == "cuda" and index is None:
            device = torch.device("cuda", torch.cuda.current_device())

        pg_options = None
        if backend == "nccl" and high_priority:
            pg_options = dist.ProcessGroupNCCL.Options()
            pg_options.is_high_priority_stream = True

        what = f"rendezvous at {host}:{port} as rank {rank} of {world_size}"
        try:
            store = _stores.get((host, port))
            if store is None:
                agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                store = TCPStore(
                    host,
                    port,
                    world_size,
                    is_master=rank == 0 and not agent_store,
                    timeout=timeout,
                    wait_for_workers=False,
                )
                _stores[(host, port)] = store
            _generation += 1
            prefixed = PrefixStore(f"gang/{_generation}", store)
            dist.init_process_group(
                backend,
                store=prefixed,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                pg_options=pg_options,
                device_id=device if device.type == "cuda" else None,
            )
        except Exception as ex:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise GangError(f"`create_default_process_group` failed during the {what}: {ex}") from ex
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pg = dist.group.WORLD
        assert pg is not None
        return cls(
            pg, device, timeout=timeout, owns_group=True, is_default=True, name=f"gang{_generation}", debug=debug
        )

    @classmethod
    def from_process_group(
        cls, pg: ProcessGroup, device: torch.device, *, timeout: timedelta | None = None, debug: bool | None = None
    ) -> ProcessGroupGang:
        """Wrap a process group the caller already has.

        Closing the returned gang does not destroy ``pg`` (the caller owns it), but does destroy
        the sub-gangs created from it.

        :param pg: A process group this process is a member of.
        :param device: The device its collectives run on.
        :param timeout: The timeout given to sub-gangs (``None``: the backend's default).
        :param debug: Debug mode (see :attr:`Gang.debug`); ``None`` reads ``GANG_DEBUG``.
        :raises TypeError: If ``pg`` is not a ``ProcessGroup`` or ``device`` not a ``torch.device``.
        :raises ValueError: If this process is not a member of ``pg``.
        """
        if not isinstance(pg, ProcessGroup):
            raise TypeError(f"`pg` must be a `ProcessGroup`, but is {pg!r} instead.")
        device = check_device("device", device)
        if dist.get_rank(pg) < 0:
            raise ValueError("`pg` must be a process group this process is a member of, but it is not.")
        # Members wrap the same group in the same order, so this name is the same on all of them.
        base = dist.get_process_group_ranks(pg)
        key = pg.group_name
        _wrap_counts[key] = _wrap_counts.get(key, 0) + 1
        name = f"wrap{_generation}:{key}:{_wrap_counts[key]}:{len(base)}"
        return cls(
            pg, device, timeout=timeout, owns_group=False, is_default=pg is dist.group.WORLD, name=name, debug=debug
        )

    @property
    @override
    def supports_process_group(self) -> bool:
        return True

    @property
    def timeout(self) -> timedelta | None:
        """The collective timeout of this gang (inherited by its sub-gangs)."""
        return self._timeout

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The global rank of each member, in gang rank order."""
        return self._global_ranks

    def _can_split(self) -> bool:
        default = dist.group.WORLD
        if default is None or default.bound_device_id is None:
            return False
        try:
            return bool(self._pg._get_backend(self._device).supports_splitting)
        except RuntimeError:
            return False

    @override
    def _split(self, groups: list[list[int]]) -> Gang | None:
        global_groups = [[self._global_ranks[r] for r in group] for group in groups]
        split_index = self._splits
        self._splits += 1
        mine = [i for i, g in enumerate(global_groups) if self._global_ranks[self._rank] in g]
        try:
            if self._can_split():
                pg = dist.split_group(self._pg, global_groups, timeout=self._timeout)
            elif not mine:
                return None
            elif self._name is None:
                pg = dist.new_group(global_groups[mine[0]], timeout=self._timeout, use_local_synchronization=True)
            else:
                pg = new_named_group(global_groups[mine[0]], f"{self._name}.{split_index}.{mine[0]}", self._timeout)
        except _BACKEND_ERRORS as ex:
            raise operation_error("create_gang", self, ex) from ex
        if pg is None or dist.get_rank(pg) < 0:
            return None
        name = None if self._name is None or not mine else f"{self._name}.{split_index}.{mine[0]}"
        return ProcessGroupGang(pg, self._device, timeout=self._timeout, owns_group=True, is_default=False, name=name)

    @override
    def _as_process_group(self) -> ProcessGroup:
        return self._pg

    @override
    def _barrier(self) -> None:
        try:
            if self._device.type == "cuda":
                dist.barrier(group=self._pg, device_ids=[self._device.index])
            elif not torch.compiler.is_compiling():
                self._pg.barrier(self._barrier_options).wait()
            else:
                dist.barrier(group=self._pg)
        except _BACKEND_ERRORS as ex:
            raise operation_error("barrier", self, ex) from ex

    @override
    def _all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        try:
            if _direct(tensor):
                self._pg.allreduce([tensor], self._allreduce_options[op]).wait()
            else:
                dist.all_reduce(tensor, _REDUCE_OPS[op], group=self._pg)
        except _BACKEND_ERRORS as ex:
            raise operation_error("all_reduce", self, ex) from ex

    @override
    def _all_gather(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        try:
            out, inp = _flat(output_tensor), _flat(input_tensor)
            if _direct(inp):
                self._pg.all_gather_single(out, inp, self._allgather_options).wait()
            else:
                dist.all_gather_single(out, inp, group=self._pg)
        except _BACKEND_ERRORS as ex:
            raise operation_error("all_gather", self, ex) from ex

    @override
    def _all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        try:
            if _direct(input_tensor):
                self._pg.allgather([output_tensors], [input_tensor], self._allgather_options).wait()
            else:
                dist.all_gather(output_tensors, input_tensor, group=self._pg)
        except _BACKEND_ERRORS as ex:
            raise operation_error("all_gather_to_list", self, ex) from ex

    @override
    def _reduce_scatter(self, output_tensor: Tensor, input_tensor: Tensor, op: ReduceOperation) -> None:
        try:
            out, inp = _flat(output_tensor), _flat(input_tensor)
            if _direct(inp):
                self._pg.reduce_scatter_single(out, inp, self._reduce_scatter_options[op]).wait()
            else:
                dist.reduce_scatter_single(out, inp, _REDUCE_OPS[op], group=self._pg)
        except _BACKEND_ERRORS as ex:
            raise operation_error("reduce_scatter", self, ex) from ex

    @override
    def _all_to_all(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        try:
            # Rows are split along the first dimension, whatever the shape (as torch's users pass them).
            if _direct(input_tensor):
                self._pg.all_to_all_single(output_tensor, input_tensor, [], [], self._all_to_all_options).wait()
            else:
                dist.all_to_all_single(output_tensor, input_tensor, group=self._pg)
        except _BACKEND_ERRORS as ex:
            raise operation_error("all_to_all", self, ex) from ex

    @override
    def _broadcast(self, tensor: Tensor, source_rank: int) -> None:
        try:
            if _direct(tensor):
                opts = self._broadcast_options.get(source_rank) or self._new_broadcast_options(source_rank)
                self._pg.broadcast([tensor], opts).wait()
            else:
                dist.broadcast(tensor, group=self._pg, group_src=source_rank)
        except _BACKEND_ERRORS as ex:
            raise operation_error("broadcast", self, ex) from ex

    def _new_broadcast_options(self, source_rank: int) -> BroadcastOptions:
        opts = self._broadcast_options[source_rank] = _sync_options(BroadcastOptions)
        opts.rootRank = source_rank
        opts.rootTensor = 0
        return opts

    @override
    def _close(self) -> None:
        if not self._owns_group or not dist.is_initialized():
            return
        if self._is_default:
            dist.destroy_process_group()
        else:
            # The group may already be gone together with the default group.
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(self._pg)
