"""Torch's view of a :class:`~gang.ft.ReplicaGang`: one process group for the whole run, DDP and FSDP2.

:class:`ReplicaProcessGroup` is a Python subclass of ``torch.distributed.ProcessGroup`` (torch's
public extension point for process groups written in Python). It owns no communicator: each of
its collectives is the same call on the :class:`~gang.ft.ReplicaGang`, so it follows the gang's
quorum (``rank()``/``size()`` are read at each call), uses whatever group the gang rebuilt for the
current quorum, records a failure inside a step instead of raising it, and raises outside a step.
Every collective returns a completed ``Work``: the gang's collectives block.

:func:`replicate_ddp` and :func:`replicate_fsdp` install the hooks through which DDP and FSDP2
average gradients over the replicas of the current quorum. The average is :func:`average`: an
all-gather followed by a sum in rank order and a division by the quorum size, so every replica,
and a single-process replay of the same steps, gets the same bits whatever algorithm the backend
picks for a reduction. DDP averages each gradient bucket; FSDP2's hooks collect the gradient
shards of a backward pass and average them in one exchange when it ends (see
:func:`replicate_fsdp`).
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations as objects.
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol, final, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, Work
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from gang._torch_groups import (
    GradBucket,
    at_end_of_backward,
    backward_pass_id,
    fix_ddp_buckets,
    fsdp_grads_view_reduce_output,
)
from gang._torch_ops import gang_reduce_op
from gang.errors import GangError, NotSupportedError
from gang.gang import Gang
from gang.ops import ReduceOperation


@runtime_checkable
class _Recorder(Protocol):
    """A gang that records a failure inside a step instead of raising it (a ``ReplicaGang``)."""

    def errored(self) -> GangError | None: ...


BACKEND_NAME = "gang.ft"
"""What :meth:`ReplicaProcessGroup.getBackendName` and :meth:`ReplicaProcessGroup.name` return."""


@final
class ReplicaProcessGroup(ProcessGroup):
    """A torch process group whose collectives run on a :class:`~gang.ft.ReplicaGang`.

    Get it with :meth:`ReplicaGang.as_process_group` (one object per gang for the whole run).
    ``rank()`` and ``size()`` are the current quorum's, so they change when the quorum does.
    Supported: ``allreduce`` (sum, average, product, min, max), ``allgather``,
    ``all_gather_single``, ``broadcast``, ``reduce_scatter``, ``reduce_scatter_single``,
    ``all_to_all_single`` with equal splits and ``barrier``, that is ``torch.distributed``'s
    ``all_reduce``, ``all_gather``, ``all_gather_into_tensor``, ``broadcast``,
    ``reduce_scatter``, ``reduce_scatter_tensor``, ``all_to_all_single`` and ``barrier`` with
    ``group=``. Other calls raise as torch's base class does.
    """

    def __init__(self, gang: Gang) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # torch's stubs omit this constructor
        self._gang = gang
        self._alone = False

    @contextmanager
    def _as_group_of_one(self) -> Iterator[None]:
        """Make collectives do nothing, as in a group of this process alone (DDP's set-up broadcasts)."""
        self._alone = True
        try:
            yield
        finally:
            self._alone = False

    @property
    def gang(self) -> Gang:
        """The gang the collectives run on."""
        return self._gang

    @override
    def rank(self) -> int:
        """This replica's rank in the current quorum."""
        return self._gang.rank

    @override
    def size(self) -> int:
        """The number of replicas in the current quorum."""
        return self._gang.size

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        """``"gang.ft"``."""
        return BACKEND_NAME

    @override
    def name(self) -> str:
        """``"gang.ft"``."""
        return BACKEND_NAME

    # Torch declares these methods with overloads; each override takes the form that
    # `torch.distributed`'s functions call.

    @override
    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        """Reduce each of ``tensors`` over the quorum, in place (``dist.all_reduce``)."""
        op = _gang_op(dist.ReduceOp.SUM if opts is None else opts.reduceOp)
        for tensor in tensors:
            self._gang.all_reduce(tensor, op)
        return _done(tensors)

    @override
    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[Tensor]], input_tensors: list[Tensor], opts: Any = None
    ) -> Work:
        """Gather each of ``input_tensors`` into the matching list of ``output_tensors`` (``dist.all_gather``)."""
        for outputs, tensor in zip(output_tensors, input_tensors, strict=True):
            self._gang.all_gather_to_list(outputs, tensor)
        return _done([t for outputs in output_tensors for t in outputs])

    @override
    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> Work:
        """Gather ``input`` into ``output``, rank after rank (``dist.all_gather_into_tensor``)."""
        self._gang.all_gather(output.view(self.size(), *input.shape), input)
        return _done([output])

    @override
    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        """Broadcast each of ``tensors`` from ``opts.rootRank`` (``dist.broadcast``)."""
        root = 0 if opts is None else int(opts.rootRank)
        if self._alone:
            return _done(tensors)
        for tensor in tensors:
            self._gang.broadcast(tensor, root)
        return _done(tensors)

    @override
    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: list[Tensor], input_tensors: list[list[Tensor]], opts: Any = None
    ) -> Work:
        """Reduce-scatter each list of ``input_tensors`` into the matching output (``dist.reduce_scatter``)."""
        op = _gang_op(dist.ReduceOp.SUM if opts is None else opts.reduceOp)
        for output, inputs in zip(output_tensors, input_tensors, strict=True):
            self._gang.reduce_scatter(output, torch.stack(inputs), op)
        return _done(output_tensors)

    @override
    def reduce_scatter_single(self, outputTensor: Tensor, inputTensor: Tensor, opts: Any = None) -> Work:
        """Reduce row ``rank()`` of every ``inputTensor`` into ``outputTensor`` (``dist.reduce_scatter_tensor``)."""
        op = _gang_op(dist.ReduceOp.SUM if opts is None else opts.reduceOp)
        self._gang.reduce_scatter(outputTensor, inputTensor.view(self.size(), *outputTensor.shape), op)
        return _done([outputTensor])

    @override
    def all_to_all_single(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Work:
        """Exchange equal rows of ``input_tensor`` (``dist.all_to_all_single`` without split sizes)."""
        if output_split_sizes or input_split_sizes:
            raise NotSupportedError("A `ReplicaProcessGroup` runs `all_to_all_single` only without split sizes.")
        size = self.size()
        self._gang.all_to_all(output_tensor.view(size, -1), input_tensor.view(size, -1))
        return _done([output_tensor])

    @override
    def barrier(self, opts: Any = None) -> Work:
        """Wait for every member of the quorum (``dist.barrier``)."""
        self._gang.barrier()
        return _done([])

    # The names torch releases before 2.13 call for the same three operations (torch 2.11's
    # `all_gather_into_tensor`, `reduce_scatter_tensor` and `all_to_all_single`); without them
    # those calls reach the base class, which has no backend for the tensor's device.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single  # type: ignore[assignment]  # torch's stubs overload it


class _Done(Work):
    """A finished ``Work`` (the gang's collectives block); its future holds ``tensors``."""

    def __init__(self, tensors: list[Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    @override
    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    @override
    def is_completed(self) -> bool:
        return True

    @override
    def is_success(self) -> bool:
        return True

    @override
    def result(self) -> list[Tensor]:
        return self._tensors

    @override
    def get_future(self) -> Future[list[Tensor]]:
        return _completed(self._tensors)


def _done(tensors: list[Tensor]) -> Work:
    return _Done(tensors)


def _completed(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _gang_op(op: object) -> ReduceOperation:
    gang_op = gang_reduce_op(op)
    if gang_op is not None:
        return gang_op
    raise NotSupportedError(f"A `ReplicaProcessGroup` cannot reduce with {op!r}.")


def average(gang: Gang, tensor: Tensor) -> None:
    """Replace ``tensor`` with its mean over the current quorum of ``gang``, summed in rank order.

    All-gathers ``tensor`` and sums the rows in rank order before dividing by the quorum size, so
    the result does not depend on how the backend orders a reduction: every member, and a replay
    of the same sum in one process, gets the same bits. A failed all-gather (recorded by the gang,
    or skipped after an earlier failure of the step) leaves ``tensor`` as it is.

    :raises InvalidOperationError: Outside ``with gang.step():``.
    """
    table = tensor.new_empty((gang.size, *tensor.shape))
    gang.all_gather(table, tensor)
    if isinstance(gang, _Recorder) and gang.errored() is not None:
        return
    tensor.copy_(table[0])
    for row in table[1:]:
        tensor.add_(row)
    tensor.div_(gang.size)


def replicate_ddp(gang: Gang, ddp_model: object) -> None:
    """Average each gradient bucket of ``ddp_model`` over the quorum (:meth:`ReplicaGang.replicate_ddp`)."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"`ddp_model` must be a `DistributedDataParallel`, but is of type `{type(ddp_model).__name__}` instead."
        )
    pg = gang.as_process_group()
    assert isinstance(pg, ReplicaProcessGroup)
    if ddp_model.process_group is not pg:
        raise ValueError(
            "`ddp_model` must be built with `process_group=gang.as_process_group()`, "
            f"but has {ddp_model.process_group!r} instead."
        )

    def hook(_: object, bucket: GradBucket) -> Future[Tensor]:
        buffer = bucket.buffer()
        average(gang, buffer)
        future: Future[Tensor] = _completed(buffer)
        return future

    try:
        with pg._as_group_of_one():  # the reducer broadcasts the layout it fixes from rank 0 to itself
            fixed = fix_ddp_buckets(ddp_model)
    except RuntimeError as error:  # the reducer's own refusal, such as a forward pass without its backward
        raise ValueError(
            f"`ddp_model` must be between steps (its gradient buckets assignable now), but its reducer "
            f"refused instead: {error}"
        ) from error
    if not fixed and ddp_model.find_unused_parameters and not ddp_model.static_graph:
        raise ValueError(
            "`ddp_model` must be built without `find_unused_parameters=True` (or with `static_graph=True`), "
            "but is built with it instead: its reducer then never reassigns its gradient buckets, so they "
            "cannot be fixed in parameter order."
        )
    if not fixed:
        raise ValueError(
            "`ddp_model` must not have assigned its gradient buckets for good yet, but has instead: its reducer "
            "does so at the second forward pass (in the order of the first backward pass, which can differ "
            "between replicas), or `replicate_ddp` already ran on it."
        )
    ddp_model.register_comm_hook(None, hook)


def replicate_fsdp(gang: Gang, module: object) -> None:
    """Average every gradient shard of ``module`` over the quorum (:meth:`ReplicaGang.replicate_fsdp`).

    Installs one all-reduce hook per FSDP module. Where FSDP2 turns what the hook receives into
    the gradients as they are (float32 or bfloat16 gradients of the reduce dtype, nothing to
    accumulate into, no offload: the usual case), the hooks of one backward pass only collect
    the shards and a single :func:`average` of all of them runs when the backward pass ends;
    otherwise each hook averages its shards at once. The bits are the same either way.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"`module` must be a `torch.nn.Module`, but is of type `{type(module).__name__}` instead.")
    fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise ValueError(
            f"`module` must be sharded with `fully_shard`, but is {type(module).__name__} without FSDP modules instead."
        )
    for name, param in module.named_parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(
                "`module` must be sharded with `fully_shard` on a 1-D mesh of the replica's own processes, "
                f"but parameter {name!r} is on a {mesh.ndim}-D mesh instead (its replicate dimension would "
                "average a second time)."
            )

    averager = _BackwardAverage(gang)
    for m in fsdp_modules:
        m.set_all_reduce_hook(averager.hook(m))


class _BackwardAverage:
    """FSDP2 all-reduce hooks that average every gradient shard of one backward pass in one exchange.

    FSDP2 calls the hook of each FSDP module once per backward pass with the module's reduced
    gradient shards (``reduce_output``). When FSDP2 then only views the gradients out of it
    (:func:`~gang._torch_groups.fsdp_grads_view_reduce_output`: no cast, no division after the
    hook, no accumulation into existing gradients, no offload), the hook only collects it, and
    at the end of the backward pass the collected shards are averaged together, concatenated
    (per dtype): one :func:`average` per backward pass instead of one per module, with the same
    sum, element by element, in rank order. Otherwise the hook averages at once.
    """

    def __init__(self, gang: Gang) -> None:
        self._gang = gang
        self._pass = -1
        self._pending: list[Tensor] = []

    def hook(self, module: object) -> Callable[[Tensor], None]:
        """The all-reduce hook of FSDP module ``module``."""

        def run(reduce_output: Tensor) -> None:
            if not fsdp_grads_view_reduce_output(module, reduce_output):
                average(self._gang, reduce_output)
                return
            current = backward_pass_id()
            if current != self._pass:  # the first shard of this pass (a pass that raised left nothing to do)
                self._pending = []
                if current < 0 or not at_end_of_backward(self._flush):
                    average(self._gang, reduce_output)
                    return
                self._pass = current
            self._pending.append(reduce_output)

        return run

    def _flush(self) -> None:
        pending, self._pending, self._pass = self._pending, [], -1
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for tensor in pending:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for tensors in by_dtype.values():
            if len(tensors) == 1:
                average(self._gang, tensors[0])
                continue
            flat = torch.cat([t.reshape(-1) for t in tensors])
            average(self._gang, flat)
            for tensor, part in zip(tensors, torch.split(flat, [t.numel() for t in tensors]), strict=True):
                tensor.view(-1).copy_(part)


__all__ = ["BACKEND_NAME", "ReplicaProcessGroup", "average", "replicate_ddp", "replicate_fsdp"]
