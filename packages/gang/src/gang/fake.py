"""A gang that simulates collectives in a single process."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from typing_extensions import override

from gang._checks import unpicklable_objects
from gang.errors import NotSupportedError
from gang.extend import pickle_or_error
from gang.gang import Gang, ReduceOperation
from gang.work import Work


@final
class FakeGang(Gang):
    """Runs single-process code as if it were rank ``rank`` of a gang of ``size`` processes.

    It assumes every simulated rank holds the same data as this one, so a ``SUM`` all-reduce
    multiplies by ``size``, ``PRODUCT`` raises to the power ``size``, and ``MEAN``, ``MIN`` and
    ``MAX`` leave the tensor unchanged (and every reduction of ``bool``, a logical or / and on
    real gangs); gathers replicate the input; broadcasts are no-ops. A send is a no-op and a
    receive leaves its tensor unchanged; ``all_to_all_uneven`` gives this rank its own block for
    ``rank`` from every rank, so ``output_splits`` must all equal ``input_splits[rank]``. Every
    operation completes before it returns (with ``async_op=True``, a completed
    :class:`~gang.Work`). Arguments, dtypes included, are checked exactly as on a real gang.

    :param device: The device of the simulated gang (not ``meta``).
    :param rank: The simulated rank, in ``[0, size)``.
    :param size: The simulated gang size, at least 1.
    :param debug: Debug mode (see :attr:`Gang.debug`); ``None`` reads ``GANG_DEBUG``.
    :raises ValueError: If ``size <= 0``, ``rank`` is out of range or ``device`` is ``meta``.
    :raises TypeError: If an argument has the wrong type.
    """

    _assumes_same_data = True

    def __init__(self, device: torch.device, *, rank: int = 0, size: int = 1, debug: bool | None = None) -> None:
        if isinstance(device, torch.device) and device.type == "meta":
            raise ValueError("`device` must be a real device, but is `meta` instead.")
        super().__init__(rank=rank, size=size, device=device, debug=debug)

    @property
    @override
    def supports_process_group(self) -> bool:
        return False

    @override
    def _split(self, groups: list[list[int]]) -> Gang | None:
        for group in groups:
            if self._rank in group:
                return FakeGang(self._device, rank=group.index(self._rank), size=len(group))
        return None

    @override
    def _as_process_group(self) -> ProcessGroup:
        raise NotSupportedError("`FakeGang` has no process group.")

    @override
    def _barrier(self) -> None:
        pass

    def _reduce_copies(self, tensor: Tensor, op: ReduceOperation) -> None:
        """Reduce ``size`` identical copies of ``tensor`` into ``tensor``."""
        if tensor.dtype == torch.bool:
            return  # A logical or (SUM, MAX) or and (PRODUCT, MIN) of identical copies.
        if op is ReduceOperation.SUM:
            tensor.mul_(self._size)
        elif op is ReduceOperation.PRODUCT:
            tensor.copy_(torch.pow(tensor, self._size))
        # MEAN, MIN and MAX of identical values are the value itself.

    @override
    def _all_reduce(self, tensor: Tensor, op: ReduceOperation, async_op: bool) -> Work | None:
        self._reduce_copies(tensor, op)
        return None

    @override
    def _all_gather(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None:
        output_tensor.copy_(input_tensor)  # broadcasts along the leading `size` axis
        return None

    @override
    def _all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        for output in output_tensors:
            output.copy_(input_tensor)

    @override
    def _reduce_scatter(
        self, output_tensor: Tensor, input_tensor: Tensor, op: ReduceOperation, async_op: bool
    ) -> Work | None:
        if op is ReduceOperation.SUM and output_tensor.dtype != torch.bool:
            torch.mul(input_tensor[self._rank], self._size, out=output_tensor)
        else:
            output_tensor.copy_(input_tensor[self._rank])
            self._reduce_copies(output_tensor, op)
        return None

    @override
    def _all_to_all(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None:
        # Row i comes from rank i, which (holding the same data) sends its row `rank`.
        output_tensor.copy_(input_tensor[self._rank])  # broadcasts along the leading `size` axis
        return None

    @override
    def _all_to_all_uneven(
        self,
        output: Tensor,
        input: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        async_op: bool,
    ) -> Work | None:
        # Rank i (holding the same data) sends this rank its block `rank`: `input_splits[rank]` rows.
        rows = input_splits[self._rank]
        if any(n != rows for n in output_splits):
            raise ValueError(
                f"`output_splits` must all equal `input_splits[{self._rank}]` ({rows}) on a `FakeGang`, which "
                f"assumes every rank holds the same data, but is {output_splits} instead."
            )
        start = sum(input_splits[: self._rank])
        output.view(self._size, rows, *output.shape[1:]).copy_(input[start : start + rows])
        return None

    @override
    def _send_recv(
        self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], async_op: bool, operation: str
    ) -> Work | None:
        return None  # sends go nowhere; a receive leaves its tensor as it is

    @override
    def _broadcast(self, tensor: Tensor, source_rank: int, async_op: bool) -> Work | None:
        return None

    @override
    def _broadcast_objects(self, objects: list[object], source_rank: int) -> None:
        payload, error = pickle_or_error(objects)  # this rank's list stands for the source's (same data)
        if payload is None:  # as on a real gang, only the source names the pickling error
            raise ValueError(unpicklable_objects(source_rank, error if self._rank == source_rank else ""))

    @override
    def _close(self) -> None:
        pass
