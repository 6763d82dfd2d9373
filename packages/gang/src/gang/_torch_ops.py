"""The translation of gang operations into torch calls, shared by every gang over torch's groups.

:class:`~gang.ProcessGroupGang` and :class:`gang.ft.ReplicaGang` start their collectives here: each
method of :class:`TorchCalls` starts one gang operation on a torch group and hands back torch's
``Work``, which the gang then waits for in its own way (a ``ProcessGroupGang`` at once or through
a :class:`~gang.process_group_gang.TorchWork`; a ``ReplicaGang`` while watching its peers, recording
a failure instead of raising it). Beside them: the reduce-operation table (:func:`reduce_op`,
:func:`gang_reduce_op`), the real view of complex tensors (:func:`real_view`), the one builder of
torch's collective options (:func:`options`) and the options built once from it.

Two kinds of group take the calls. A registered ``ProcessGroup`` (:data:`GROUP_CALLS`) is called
through its own methods with options built once for plain tensors (:func:`direct`), and through
``torch.distributed``'s functions for what only they handle. A standalone backend of
:mod:`gang.ft` (``TorchCalls(standalone=True)``, one per :class:`gang.ft.ReplicaGang`; see
:func:`gang._torch_groups.new_standalone_group`) is in no registry, so ``torch.distributed``'s
functions cannot take it: every call goes to its own methods, complex tensors as their real views,
with options that may carry a timeout of the call's own (:attr:`TorchCalls.timeout`).

Public torch API only: the option classes and the version-dependent names are taken from
:mod:`gang._torch_groups`, the one module that touches torch's private API. Internal (its names may
change); not part of the public API.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.overrides import has_torch_function_unary

from gang._torch_groups import (
    SINGLE_COLLECTIVES,
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
    all_gather_tensor,
    reduce_scatter_tensor,
)
from gang.ops import ReduceOperation

TORCH_REDUCE_OPS = {
    ReduceOperation.SUM: dist.ReduceOp.SUM,
    ReduceOperation.MEAN: dist.ReduceOp.AVG,
    ReduceOperation.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOperation.MIN: dist.ReduceOp.MIN,
    ReduceOperation.MAX: dist.ReduceOp.MAX,
}
"""The torch reduction (a ``RedOpType``) of each gang reduction."""

TorchHandle = Any
"""A ``torch.distributed`` ``Work`` (typed loosely: torch's stubs give it no ``wait(timeout)``)."""


def reduce_op(op: ReduceOperation) -> dist.ReduceOp:
    """The torch reduction of ``op`` (``MEAN`` is ``AVG``, which gloo and NCCL both support)."""
    return dist.ReduceOp(TORCH_REDUCE_OPS[op])


def gang_reduce_op(op: object) -> ReduceOperation | None:
    """The gang reduction that torch's ``op`` (a ``ReduceOp`` or its ``RedOpType``) is, or ``None``."""
    for gang_op, torch_op in TORCH_REDUCE_OPS.items():
        if op == torch_op:
            return gang_op
    return None


def real_view(tensor: Tensor) -> Tensor:
    """``tensor`` as gloo moves it: a complex tensor as its pairs of reals (the same memory; gloo has no
    complex type), any other tensor as it is."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


# The dtypes that torch.distributed's functions rewrite before they call the group (complex
# tensors as pairs of reals, float8 as bytes in `broadcast`).
_REWRITTEN_DTYPES = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and (d.is_complex or "float8" in str(d))
)


def direct(tensor: Tensor) -> bool:
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


def flat(tensor: Tensor) -> Tensor:
    """``tensor`` as one dimension (gloo wants the rows of a gather or scatter along the first).

    A new view costs about a microsecond per call, so a tensor that is flat already is kept.
    """
    return tensor if tensor.dim() == 1 else tensor.flatten()


class _Options(Protocol):
    asyncOp: bool  # noqa: N815 (torch's name)
    timeout: timedelta


class _ReduceOptions(_Options, Protocol):
    reduceOp: dist.ReduceOp  # noqa: N815 (torch's name)


_O = TypeVar("_O", bound=_Options)
_R = TypeVar("_R", bound=_ReduceOptions)


def options(cls: type[_O], async_op: bool = False) -> _O:
    """Return new options of ``cls`` for a blocking call (or one with ``async_op``), as ``torch.distributed``'s
    functions build them."""
    opts = cls()
    opts.asyncOp = async_op
    return opts


def _reduce_options(cls: type[_R], async_op: bool, op: ReduceOperation) -> _R:
    opts = options(cls, async_op)
    opts.reduceOp = reduce_op(op)
    return opts


# Built once and handed straight to the groups, which only read them; indexed by `async_op`
# (False: 0, True: 1), then by the reduction.
_ALLREDUCE = [{op: _reduce_options(AllreduceOptions, a, op) for op in ReduceOperation} for a in (False, True)]
_REDUCE_SCATTER = [{op: _reduce_options(ReduceScatterOptions, a, op) for op in ReduceOperation} for a in (False, True)]
_ALLGATHER = [options(AllgatherOptions, a) for a in (False, True)]
_ALL_TO_ALL = [options(AllToAllOptions, a) for a in (False, True)]
_BROADCAST: list[dict[int, BroadcastOptions]] = [{}, {}]  # by source rank, built on first use


def _new_broadcast_options(source_rank: int, async_op: bool) -> BroadcastOptions:
    opts = options(BroadcastOptions, async_op)
    opts.rootRank = source_rank
    opts.rootTensor = 0
    return opts


def _broadcast_options(source_rank: int, async_op: bool) -> BroadcastOptions:
    opts = _BROADCAST[async_op].get(source_rank)
    if opts is None:
        opts = _BROADCAST[async_op][source_rank] = _new_broadcast_options(source_rank, async_op)
    return opts


class TorchCalls:
    """Starts gang operations on torch groups of one kind (see the module's docstring).

    Each method starts the operation on ``pg`` and returns torch's work: the caller waits for it
    (with ``async_op=False``, a ``torch.distributed`` function has waited already and returns
    ``None``). Rows of a gather or scatter are split along the first dimension, whatever the shape.

    :param standalone: Whether the groups are standalone backends (in no registry).
    """

    __slots__ = ("_standalone", "timeout")

    def __init__(self, *, standalone: bool) -> None:
        self._standalone = standalone
        self.timeout: timedelta | None = None
        """The time the backend gives the operations started next on a standalone backend, in
        place of the group's own timeout (gloo's options carry one per operation); ``None``: the
        group's. The calls on a registered group keep the group's."""

    def _timed(self, opts: _O, make: Callable[[], _O]) -> _O:
        """``opts`` (built once, shared), or new options from ``make`` with :attr:`timeout` (standalone only)."""
        if self.timeout is None or not self._standalone:
            return opts
        fresh = make()
        fresh.timeout = self.timeout
        return fresh

    def all_reduce(self, pg: Any, tensor: Tensor, op: ReduceOperation, async_op: bool) -> TorchHandle | None:
        """Start an all-reduce of ``tensor`` in place."""
        if self._standalone:
            tensor = real_view(tensor)
        elif not direct(tensor):
            return dist.all_reduce(tensor, TORCH_REDUCE_OPS[op], group=pg, async_op=async_op)
        opts = self._timed(_ALLREDUCE[async_op][op], lambda: _reduce_options(AllreduceOptions, async_op, op))
        return pg.allreduce([tensor], opts)

    def all_gather_to_list(self, pg: Any, outputs: list[Tensor], tensor: Tensor, async_op: bool) -> TorchHandle | None:
        """Start an all-gather of ``tensor`` into ``outputs``, one tensor per rank."""
        if self._standalone:
            outputs, tensor = [real_view(t) for t in outputs], real_view(tensor)
        elif not direct(tensor):
            return dist.all_gather(outputs, tensor, group=pg, async_op=async_op)
        return pg.allgather(
            [outputs], [tensor], self._timed(_ALLGATHER[async_op], lambda: options(AllgatherOptions, async_op))
        )

    def all_gather(self, pg: Any, output: Tensor, tensor: Tensor, async_op: bool) -> TorchHandle | None:
        """Start an all-gather of ``tensor`` into the rows of ``output``."""
        if self._standalone:  # a backend has no gather into one tensor: gather into its rows
            return self.all_gather_to_list(pg, list(output.unbind(0)), tensor, async_op)
        out, inp = flat(output), flat(tensor)
        if SINGLE_COLLECTIVES and direct(inp):
            return pg.all_gather_single(out, inp, _ALLGATHER[async_op])
        return all_gather_tensor(out, inp, group=pg, async_op=async_op)

    def reduce_scatter(
        self, pg: Any, output: Tensor, tensor: Tensor, op: ReduceOperation, async_op: bool
    ) -> TorchHandle | None:
        """Start a reduce-scatter of the rows of ``tensor`` into ``output`` (on a registered group
        only: a standalone gloo backend has none of one tensor, so its gang all-reduces the rows)."""
        out, inp = flat(output), flat(tensor)
        if SINGLE_COLLECTIVES and direct(inp):
            return pg.reduce_scatter_single(out, inp, _REDUCE_SCATTER[async_op][op])
        return reduce_scatter_tensor(out, inp, TORCH_REDUCE_OPS[op], group=pg, async_op=async_op)

    def all_to_all(
        self,
        pg: Any,
        output: Tensor,
        tensor: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        async_op: bool,
    ) -> TorchHandle | None:
        """Start an all-to-all of the rows of ``tensor`` into ``output``; empty split lists mean equal rows."""
        if self._standalone:
            out, inp = real_view(output).view(-1), real_view(tensor).view(-1)
            opts = self._timed(_ALL_TO_ALL[async_op], lambda: options(AllToAllOptions, async_op))
            return pg.alltoall_base(out, inp, output_splits, input_splits, opts)
        if SINGLE_COLLECTIVES and direct(tensor):
            return pg.all_to_all_single(output, tensor, output_splits, input_splits, _ALL_TO_ALL[async_op])
        return dist.all_to_all_single(
            output, tensor, output_splits or None, input_splits or None, group=pg, async_op=async_op
        )

    def broadcast(self, pg: Any, tensor: Tensor, source_rank: int, async_op: bool) -> TorchHandle | None:
        """Start a broadcast of ``tensor`` in place from ``source_rank``."""
        if self._standalone:
            tensor = real_view(tensor)
        elif not direct(tensor):
            return dist.broadcast(tensor, group=pg, group_src=source_rank, async_op=async_op)
        opts = self._timed(
            _broadcast_options(source_rank, async_op), lambda: _new_broadcast_options(source_rank, async_op)
        )
        return pg.broadcast([tensor], opts)

    def barrier(self, pg: Any) -> TorchHandle:
        """Start a barrier on a standalone backend (a registered group's barrier is the gang's own)."""
        return pg.barrier(self._timed(_BARRIER, lambda: BarrierOptions()))


_BARRIER = BarrierOptions()
"""The standalone barrier's options when no timeout of its own is given (read only)."""

GROUP_CALLS = TorchCalls(standalone=False)
"""The calls on a registered ``ProcessGroup`` (:class:`~gang.ProcessGroupGang`'s)."""

__all__ = [
    "GROUP_CALLS",
    "TORCH_REDUCE_OPS",
    "TorchCalls",
    "TorchHandle",
    "direct",
    "flat",
    "gang_reduce_op",
    "options",
    "real_view",
    "reduce_op",
]
