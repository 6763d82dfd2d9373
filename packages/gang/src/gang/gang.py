"""The :class:`Gang` interface and :class:`ReduceOperation`.

Every public method of :class:`Gang` checks its arguments (the same checks for every kind of
gang) **before** any communication, then calls a protected method that a concrete gang
implements. So a bug that :class:`~gang.FakeGang` catches in a unit test is the bug a real gang
would catch on the cluster, with the same message. The checks are the functions of
``gang._checks``; debug mode's checks across ranks are those of ``gang._debug``.
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Literal, final, overload

import numpy as np
import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from typing_extensions import Self

from gang._checks import (
    check_async,
    check_pairs,
    check_peer,
    check_ranks,
    check_same_dtype,
    check_shape,
    check_tensor,
    unpicklable_objects,
)
from gang._debug import debug_from_env, describe, verify_pairs, verify_same_call, verify_splits
from gang.errors import NotSupportedError
from gang.extend import (
    check_device,
    check_int,
    check_op,
    check_open,
    check_rank,
    check_splits,
    check_values_exchangeable,
    pickle_or_error,
)
from gang.ops import ReduceOperation
from gang.trace._recorder import STATE as _TRACING
from gang.trace._recorder import GangTrace
from gang.work import CompletedWork, Work, _block

__all__ = ["Gang", "ReduceOperation", "TensorLike", "Work", "debug_from_env"]

TensorLike = Tensor | np.ndarray[Any, Any]
"""A ``torch.Tensor``, or a NumPy array that is used in place through :func:`torch.from_numpy`."""


class Gang(ABC):
    """A set of processes that run collective operations together.

    Ranks are always ranks of *this* gang, in ``[0, size)``. Collectives update tensors in place.
    A gang is a context manager that closes it on exit.

    A concrete gang passes its rank, size and device here and implements the protected methods
    (see :mod:`gang.extend`).

    :param rank: This process's rank in the gang, in ``[0, size)``.
    :param size: The number of processes, at least 1.
    :param device: The device the collectives run on; any CPU device is normalised to ``cpu``.
    :param debug: Debug mode (see :attr:`debug`); ``None`` reads ``GANG_DEBUG``.
    :raises TypeError: If ``rank`` or ``size`` is not an integer or ``device`` not a ``torch.device``.
    :raises ValueError: If ``size < 1`` or ``rank`` is outside ``[0, size)``.
    """

    _assumes_same_data: ClassVar[bool] = False
    """Whether this kind of gang assumes that every rank holds the same data (:class:`~gang.FakeGang`):
    debug mode then has no peers' calls to compare with."""

    _sends_and_receives: ClassVar[bool] = False
    """Whether this kind of gang implements point-to-point transfers and refuses none (set per class by
    ``__init_subclass__``): the hot path then skips :meth:`_refuse_traffic`."""

    _moves_uneven_rows: ClassVar[bool] = False
    """Whether this kind of gang implements uneven rows and refuses none (set per class, as above)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        default_refusal = cls._refuse_traffic is Gang._refuse_traffic
        cls._sends_and_receives = default_refusal and cls._send_recv is not Gang._send_recv
        cls._moves_uneven_rows = default_refusal and cls._all_to_all_uneven is not Gang._all_to_all_uneven

    def __init__(self, *, rank: int, size: int, device: torch.device, debug: bool | None = None) -> None:
        self._size = check_int("size", size, minimum=1)
        self._rank = check_rank("rank", rank, self._size)
        self._device = check_device("device", device)
        self._on_cpu = self._device.type == "cpu"
        self._closed = False
        self._children: list[Gang] = []
        self._debug = debug_from_env() if debug is None else bool(debug)
        self._trace = GangTrace(self)

    # -- properties -------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """The rank of this process in the gang."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of processes in the gang."""
        return self._size

    @property
    def device(self) -> torch.device:
        """The device the gang's collectives run on."""
        return self._device

    @property
    @abstractmethod
    def supports_process_group(self) -> bool:
        """Whether :meth:`as_process_group` returns a torch process group."""

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def debug(self) -> bool:
        """Whether debug mode is on: every collective first checks that all ranks make the same call.

        Point-to-point calls first check with each peer that what one side sends is what the
        other receives (dtype and shape, in order), raising on both sides with both calls named;
        ``all_to_all_uneven`` checks that rank ``i``'s ``input_splits[j]`` is rank ``j``'s
        ``output_splits[i]``. A peer that makes no matching call at all is not seen: the check
        then fails at the gang's timeout. In debug mode each point-to-point call must be met by
        one call of the peer listing the same transfers between the two: a ``send_recv`` that sends
        to and receives from a peer which calls ``recv`` then ``send`` (valid without debug mode)
        is refused on both sides.

        On when the gang was created with ``debug=True``, or with ``debug=None`` while the
        environment variable ``GANG_DEBUG`` turns it on (``1``, ``true``, ``yes`` or ``on``).
        Sub-gangs inherit it. Off, it costs one attribute test per call.
        """
        return self._debug

    # -- public API (checks first, then the implementation) ---------------------------------

    @final
    def create_gang(self, ranks: Sequence[int]) -> Gang | None:
        """Create a sub-gang of the listed ranks of this gang.

        Every member of this gang calls it with the same ``ranks``. Members of the new gang are
        ordered by their rank in this gang. The sub-gang inherits this gang's :attr:`debug` mode and
        what its kind of gang carries over (a :class:`~gang.ProcessGroupGang`'s collective timeout,
        for one); a :class:`Gang` as such has no timeout.

        :param ranks: Ranks of *this* gang (not global ranks), unique and in ``[0, size)``.
        :returns: The new gang, or ``None`` if this process is not in ``ranks``.
        :raises ValueError: If ``ranks`` is empty, has duplicates or a rank outside ``[0, size)``.
        :raises TypeError: If ``ranks`` is not a sequence of ``int``.
        :raises GangError: If the backend fails to create the gang.
        """
        check_open(self, "create_gang")
        group = check_ranks(self, "ranks", ranks)
        if self._debug:
            verify_same_call(self, f"create_gang(ranks={group})")
        return self._register(self._traced_split(self._split, [group]), group)

    @final
    def split(self, groups: Sequence[Sequence[int]]) -> Gang | None:
        """Split this gang into disjoint sub-gangs at once and return the one holding this process.

        Every member of this gang calls it with the same ``groups``: one call builds every
        tensor-parallel (or data-parallel, …) gang of a layout. The factories use its scalable
        form, :meth:`split_own_group`.

        :param groups: Disjoint lists of ranks of this gang.
        :returns: The sub-gang that holds this process, or ``None`` if no group holds it.
        :raises ValueError: If a group is empty, or ranks repeat or are out of range.
        :raises TypeError: If ``groups`` is not a sequence of sequences of ``int``.
        :raises GangError: If the backend fails to create the gangs.
        """
        check_open(self, "split")
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):  # type: ignore[unreachable]
            raise TypeError(f"`groups` must be a sequence of rank lists, but is {groups!r} instead.")
        checked = [check_ranks(self, f"groups[{i}]", group) for i, group in enumerate(groups)]
        if not checked:
            raise ValueError("`groups` must not be empty.")
        seen: set[int] = set()
        for group in checked:
            if seen.intersection(group):
                raise ValueError(
                    f"`groups` must be disjoint, but rank(s) {sorted(seen.intersection(group))} "
                    f"appear in more than one group of {[list(g) for g in groups]}."
                )
            seen.update(group)
        if self._debug:
            verify_same_call(self, f"split(groups={checked})")
        child = self._traced_split(self._split, checked)
        return self._register(child, next((g for g in checked if self.rank in g), None))

    @final
    def split_own_group(self, members: Sequence[int], every_group: Callable[[], list[list[int]]]) -> Gang | None:
        """Split this gang into disjoint sub-gangs known in closed form, naming only this process's group.

        The scalable form of :meth:`split` that the factories use: each member passes its own
        group, ``members`` (ranks of this gang, holding this process), and ``every_group``, which
        returns the whole split, the same on every member. A gang calls ``every_group`` only where
        its backend needs every group (torch's ``split_group``, or debug mode's check that all
        ranks make the same call), so on a big world a process does work in the size of its own
        group. Every member calls it in the same order as its other splits.

        :returns: The sub-gang of ``members``.
        :raises ValueError: If ``members`` is empty, has duplicates, a rank outside ``[0, size)``,
            or does not hold this process.
        :raises TypeError: If ``members`` is not a sequence of ``int``.
        :raises GangError: If the backend fails to create the gang.
        """
        check_open(self, "split_own_group")
        group = check_ranks(self, "members", members)
        if self.rank not in group:
            raise ValueError(f"`members` must hold this process's rank {self.rank}, but is {group} instead.")
        if self._debug:
            verify_same_call(self, f"split(groups={sorted(every_group())})")
        return self._register(self._traced_split(self._split_own_group, group, every_group), group)

    @final
    def as_process_group(self) -> ProcessGroup:
        """Return the underlying torch process group.

        :raises NotSupportedError: If this kind of gang has none.
        """
        check_open(self, "as_process_group")
        return self._as_process_group()

    @final
    def barrier(self) -> None:
        """Block until every process of the gang reaches this call.

        :raises GangError: If the collective fails or times out.
        """
        check_open(self, "barrier")
        if self._debug:
            verify_same_call(self, "barrier()")
        if _TRACING.on:
            self._trace.run("barrier", False, (), (), self._barrier, ())
            return
        self._barrier()

    @overload
    def all_reduce(self, tensor: TensorLike, op: ReduceOperation, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def all_reduce(self, tensor: TensorLike, op: ReduceOperation, *, async_op: Literal[True]) -> Work: ...

    @overload
    def all_reduce(self, tensor: TensorLike, op: ReduceOperation, *, async_op: bool) -> Work | None: ...

    @final
    def all_reduce(self, tensor: TensorLike, op: ReduceOperation, *, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over every process, in place.

        :param tensor: The tensor to reduce; it holds the result afterwards.
        :param op: The reduction. ``MEAN`` needs a floating-point tensor.
        :param async_op: Start the operation and return a :class:`~gang.Work` at once (see
            :class:`~gang.Work`); its tensors must be left alone until ``wait()`` returns.
        :returns: ``None``, or with ``async_op=True`` the operation's :class:`~gang.Work`.
        :raises ValueError: If ``tensor`` is not contiguous, not on the gang's device, or ``op`` is
            ``MEAN`` and ``tensor`` is not floating point.
        :raises TypeError: If ``tensor`` is not a tensor or ``op`` not a :class:`ReduceOperation`.
        :raises GangError: If the collective fails or times out.
        """
        if self._closed:
            check_open(self, "all_reduce")
        if async_op is not False:
            check_async(async_op)
        t = check_tensor(self, "tensor", tensor, contiguous=True)
        check_op("op", op, t.dtype)
        if self._debug:
            verify_same_call(self, f"all_reduce({describe(t)}, op={op.name})")
        if _TRACING.on:
            return self._trace.run("all_reduce", async_op, (t,), None, self._all_reduce, (t, op, async_op))
        work = self._all_reduce(t, op, async_op)
        return None if work is None and not async_op else self._result("all_reduce", work, async_op)

    @overload
    def all_gather(
        self, output_tensor: TensorLike, input_tensor: TensorLike, *, async_op: Literal[False] = False
    ) -> None: ...

    @overload
    def all_gather(self, output_tensor: TensorLike, input_tensor: TensorLike, *, async_op: Literal[True]) -> Work: ...

    @overload
    def all_gather(self, output_tensor: TensorLike, input_tensor: TensorLike, *, async_op: bool) -> Work | None: ...

    @final
    def all_gather(self, output_tensor: TensorLike, input_tensor: TensorLike, *, async_op: bool = False) -> Work | None:
        """Gather ``input_tensor`` of every process into ``output_tensor``.

        :param output_tensor: Contiguous, of shape ``[size, *input_tensor.shape]``; row ``i``
            receives rank ``i``'s input.
        :param input_tensor: This process's contribution.
        :param async_op: Start the operation and return a :class:`~gang.Work` at once (see
            :class:`~gang.Work`); its tensors must be left alone until ``wait()`` returns.
        :returns: ``None``, or with ``async_op=True`` the operation's :class:`~gang.Work`.
        :raises ValueError: On a shape, dtype, device or contiguity mismatch.
        :raises TypeError: If an argument is not a tensor.
        :raises GangError: If the collective fails or times out.
        """
        if self._closed:
            check_open(self, "all_gather")
        if async_op is not False:
            check_async(async_op)
        out = check_tensor(self, "output_tensor", output_tensor, contiguous=True)
        inp = check_tensor(self, "input_tensor", input_tensor)
        check_same_dtype("output_tensor", out, inp)
        check_shape("output_tensor", out, (self.size, *inp.shape))
        if self._debug:
            verify_same_call(self, f"all_gather(input {describe(inp)})")
        if _TRACING.on:
            return self._trace.run(
                "all_gather", async_op, (inp,), (out,), self._all_gather, (out, inp.contiguous(), async_op)
            )
        work = self._all_gather(out, inp.contiguous(), async_op)
        return None if work is None and not async_op else self._result("all_gather", work, async_op)

    @final
    def all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: TensorLike) -> None:
        """Gather ``input_tensor`` of every process into the list ``output_tensors``.

        :param output_tensors: ``size`` tensors shaped like ``input_tensor``; entry ``i``
            receives rank ``i``'s input.
        :param input_tensor: This process's contribution.
        :raises ValueError: On a length, shape, dtype or device mismatch.
        :raises TypeError: If ``output_tensors`` is not a list of tensors.
        :raises GangError: If the collective fails or times out.
        """
        check_open(self, "all_gather_to_list")
        if not isinstance(output_tensors, list):
            raise TypeError(
                "`output_tensors` must be a `list` of tensors, "
                f"but is of type `{type(output_tensors).__name__}` instead."
            )
        inp = check_tensor(self, "input_tensor", input_tensor)
        if len(output_tensors) != self.size:
            raise ValueError(
                f"`output_tensors` must have {self.size} entries (the gang size), "
                f"but has {len(output_tensors)} instead."
            )
        outs = []
        for i, out in enumerate(output_tensors):
            name = f"output_tensors[{i}]"
            o = check_tensor(self, name, out, contiguous=True)
            check_same_dtype(name, o, inp)
            check_shape(name, o, tuple(inp.shape))
            outs.append(o)
        if self._debug:
            verify_same_call(self, f"all_gather_to_list(input {describe(inp)})")
        if _TRACING.on:
            self._trace.run(
                "all_gather_to_list", False, (inp,), outs, self._all_gather_to_list, (outs, inp.contiguous())
            )
            return
        self._all_gather_to_list(outs, inp.contiguous())

    @overload
    def reduce_scatter(
        self,
        output_tensor: TensorLike,
        input_tensor: TensorLike,
        op: ReduceOperation,
        *,
        async_op: Literal[False] = False,
    ) -> None: ...

    @overload
    def reduce_scatter(
        self, output_tensor: TensorLike, input_tensor: TensorLike, op: ReduceOperation, *, async_op: Literal[True]
    ) -> Work: ...

    @overload
    def reduce_scatter(
        self, output_tensor: TensorLike, input_tensor: TensorLike, op: ReduceOperation, *, async_op: bool
    ) -> Work | None: ...

    @final
    def reduce_scatter(
        self, output_tensor: TensorLike, input_tensor: TensorLike, op: ReduceOperation, *, async_op: bool = False
    ) -> Work | None:
        """Reduce row ``i`` of every process's ``input_tensor`` into rank ``i``'s ``output_tensor``.

        :param output_tensor: Contiguous; receives the reduction of row ``rank`` of every input.
        :param input_tensor: Of shape ``[size, *output_tensor.shape]``.
        :param op: The reduction. ``MEAN`` needs floating-point tensors.
        :param async_op: Start the operation and return a :class:`~gang.Work` at once (see
            :class:`~gang.Work`); its tensors must be left alone until ``wait()`` returns.
        :returns: ``None``, or with ``async_op=True`` the operation's :class:`~gang.Work`.
        :raises ValueError: On a shape, dtype, device or contiguity mismatch, or ``MEAN`` on integers.
        :raises TypeError: If an argument has the wrong type.
        :raises GangError: If the collective fails or times out.
        """
        if self._closed:
            check_open(self, "reduce_scatter")
        if async_op is not False:
            check_async(async_op)
        out = check_tensor(self, "output_tensor", output_tensor, contiguous=True)
        inp = check_tensor(self, "input_tensor", input_tensor)
        check_same_dtype("input_tensor", inp, out)
        check_shape("input_tensor", inp, (self.size, *out.shape))
        check_op("op", op, out.dtype)
        if self._debug:
            verify_same_call(self, f"reduce_scatter(input {describe(inp)}, op={op.name})")
        if _TRACING.on:
            return self._trace.run(
                "reduce_scatter", async_op, (inp,), (out,), self._reduce_scatter, (out, inp.contiguous(), op, async_op)
            )
        work = self._reduce_scatter(out, inp.contiguous(), op, async_op)
        return None if work is None and not async_op else self._result("reduce_scatter", work, async_op)

    @overload
    def all_to_all(
        self, output_tensor: TensorLike, input_tensor: TensorLike, *, async_op: Literal[False] = False
    ) -> None: ...

    @overload
    def all_to_all(self, output_tensor: TensorLike, input_tensor: TensorLike, *, async_op: Literal[True]) -> Work: ...

    @overload
    def all_to_all(self, output_tensor: TensorLike, input_tensor: TensorLike, *, async_op: bool) -> Work | None: ...

    @final
    def all_to_all(self, output_tensor: TensorLike, input_tensor: TensorLike, *, async_op: bool = False) -> Work | None:
        """Send row ``j`` of ``input_tensor`` to rank ``j``; row ``i`` of ``output_tensor`` comes from rank ``i``.

        :param output_tensor: Contiguous, same shape and dtype as ``input_tensor``.
        :param input_tensor: Of shape ``[size, ...]``.
        :param async_op: Start the operation and return a :class:`~gang.Work` at once (see
            :class:`~gang.Work`); its tensors must be left alone until ``wait()`` returns.
        :returns: ``None``, or with ``async_op=True`` the operation's :class:`~gang.Work`.
        :raises ValueError: On a shape, dtype, device or contiguity mismatch.
        :raises TypeError: If an argument is not a tensor.
        :raises GangError: If the collective fails or times out.
        """
        if self._closed:
            check_open(self, "all_to_all")
        if async_op is not False:
            check_async(async_op)
        out = check_tensor(self, "output_tensor", output_tensor, contiguous=True)
        inp = check_tensor(self, "input_tensor", input_tensor)
        if out.dtype != inp.dtype:
            check_same_dtype("output_tensor", out, inp)
        if inp.dim() == 0 or inp.shape[0] != self._size:
            raise ValueError(
                f"`input_tensor` must have shape [{self.size}, ...] (the gang size first), "
                f"but has shape {list(inp.shape)} instead."
            )
        if out.shape != inp.shape:
            check_shape("output_tensor", out, tuple(inp.shape))
        if self._debug:
            verify_same_call(self, f"all_to_all(input {describe(inp)})")
        if _TRACING.on:
            return self._trace.run(
                "all_to_all", async_op, (inp,), (out,), self._all_to_all, (out, inp.contiguous(), async_op)
            )
        work = self._all_to_all(out, inp.contiguous(), async_op)
        return None if work is None and not async_op else self._result("all_to_all", work, async_op)

    @overload
    def broadcast(self, tensor: TensorLike, source_rank: int = 0, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def broadcast(self, tensor: TensorLike, source_rank: int = 0, *, async_op: Literal[True]) -> Work: ...

    @overload
    def broadcast(self, tensor: TensorLike, source_rank: int = 0, *, async_op: bool) -> Work | None: ...

    @final
    def broadcast(self, tensor: TensorLike, source_rank: int = 0, *, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` of ``source_rank`` into ``tensor`` of every other process.

        :param tensor: Contiguous; sent on the source, overwritten elsewhere.
        :param source_rank: A rank of *this* gang (never a global rank).
        :param async_op: Start the operation and return a :class:`~gang.Work` at once (see
            :class:`~gang.Work`); its tensors must be left alone until ``wait()`` returns.
        :returns: ``None``, or with ``async_op=True`` the operation's :class:`~gang.Work`.
        :raises ValueError: If ``source_rank`` is outside ``[0, size)`` or ``tensor`` is invalid.
        :raises TypeError: If ``source_rank`` is not an ``int`` or ``tensor`` not a tensor.
        :raises GangError: If the collective fails or times out.
        """
        if self._closed:
            check_open(self, "broadcast")
        if async_op is not False:
            check_async(async_op)
        t = check_tensor(self, "tensor", tensor, contiguous=True)
        source_rank = check_rank("source_rank", source_rank, self._size)
        if self._debug:
            verify_same_call(self, f"broadcast({describe(t)}, source_rank={source_rank})")
        if _TRACING.on:
            return self._trace.run("broadcast", async_op, (t,), None, self._broadcast, (t, source_rank, async_op))
        work = self._broadcast(t, source_rank, async_op)
        return None if work is None and not async_op else self._result("broadcast", work, async_op)

    @overload
    def send(self, tensor: TensorLike, dest_rank: int, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def send(self, tensor: TensorLike, dest_rank: int, *, async_op: Literal[True]) -> Work: ...

    @overload
    def send(self, tensor: TensorLike, dest_rank: int, *, async_op: bool) -> Work | None: ...

    @final
    def send(self, tensor: TensorLike, dest_rank: int, *, async_op: bool = False) -> Work | None:
        """Send ``tensor`` to ``dest_rank``, which receives it with :meth:`recv` (or :meth:`send_recv`).

        Sends and receives between two ranks match in the order they are made: the k-th tensor
        this rank sends to ``dest_rank`` lands in the k-th receive ``dest_rank`` posts for this
        rank, which must have the same shape and dtype (a backend may not notice a difference:
        debug mode does, see :attr:`debug`).

        :param tensor: The tensor to send.
        :param dest_rank: A rank of *this* gang other than :attr:`rank`.
        :param async_op: Start the operation and return a :class:`~gang.Work` at once (see
            :class:`~gang.Work`); its tensors must be left alone until ``wait()`` returns.
        :returns: ``None``, or with ``async_op=True`` the operation's :class:`~gang.Work`.
        :raises ValueError: If ``dest_rank`` is this process's rank or outside ``[0, size)``, or
            ``tensor`` is invalid.
        :raises TypeError: If ``dest_rank`` is not an ``int`` or ``tensor`` not a tensor.
        :raises GangError: If the transfer fails or times out.
        """
        if self._closed:
            check_open(self, "send")
        if async_op is not False:
            check_async(async_op)
        t = check_tensor(self, "tensor", tensor)
        dest_rank = check_peer(self, "dest_rank", dest_rank)
        sends = [(t.contiguous(), dest_rank)]
        if not self._sends_and_receives:
            self._refuse_traffic("send")
        if self._debug:
            verify_pairs(self, sends, [])
        if _TRACING.on:
            return self._trace.run(
                "send", async_op, (t,), (), self._send_recv, (sends, [], async_op, "send"), _peers(sends, [])
            )
        work = self._send_recv(sends, [], async_op, "send")
        return None if work is None and not async_op else self._result("send", work, async_op)

    @overload
    def recv(self, tensor: TensorLike, source_rank: int, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def recv(self, tensor: TensorLike, source_rank: int, *, async_op: Literal[True]) -> Work: ...

    @overload
    def recv(self, tensor: TensorLike, source_rank: int, *, async_op: bool) -> Work | None: ...

    @final
    def recv(self, tensor: TensorLike, source_rank: int, *, async_op: bool = False) -> Work | None:
        """Receive into ``tensor`` what ``source_rank`` sends with :meth:`send` (or :meth:`send_recv`).

        :param tensor: Contiguous, with the shape and dtype of the tensor the source sends.
        :param source_rank: A rank of *this* gang other than :attr:`rank`.
        :param async_op: Start the operation and return a :class:`~gang.Work` at once (see
            :class:`~gang.Work`); its tensors must be left alone until ``wait()`` returns.
        :returns: ``None``, or with ``async_op=True`` the operation's :class:`~gang.Work`.
        :raises ValueError: If ``source_rank`` is this process's rank or outside ``[0, size)``, or
            ``tensor`` is not contiguous or not on the gang's device.
        :raises TypeError: If ``source_rank`` is not an ``int`` or ``tensor`` not a tensor.
        :raises GangError: If the transfer fails or times out.
        """
        if self._closed:
            check_open(self, "recv")
        if async_op is not False:
            check_async(async_op)
        t = check_tensor(self, "tensor", tensor, contiguous=True)
        recvs = [(t, check_peer(self, "source_rank", source_rank))]
        if not self._sends_and_receives:
            self._refuse_traffic("recv")
        if self._debug:
            verify_pairs(self, [], recvs)
        if _TRACING.on:
            return self._trace.run(
                "recv", async_op, (), (t,), self._send_recv, ([], recvs, async_op, "recv"), _peers([], recvs)
            )
        work = self._send_recv([], recvs, async_op, "recv")
        return None if work is None and not async_op else self._result("recv", work, async_op)

    @overload
    def send_recv(
        self,
        sends: Sequence[tuple[TensorLike, int]] = (),
        recvs: Sequence[tuple[TensorLike, int]] = (),
        *,
        async_op: Literal[False] = False,
    ) -> None: ...

    @overload
    def send_recv(
        self,
        sends: Sequence[tuple[TensorLike, int]] = (),
        recvs: Sequence[tuple[TensorLike, int]] = (),
        *,
        async_op: Literal[True],
    ) -> Work: ...

    @overload
    def send_recv(
        self,
        sends: Sequence[tuple[TensorLike, int]] = (),
        recvs: Sequence[tuple[TensorLike, int]] = (),
        *,
        async_op: bool,
    ) -> Work | None: ...

    @final
    def send_recv(
        self,
        sends: Sequence[tuple[TensorLike, int]] = (),
        recvs: Sequence[tuple[TensorLike, int]] = (),
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Post every send and receive at once and complete them all (torch's ``batch_isend_irecv``).

        A pipeline stage sends its activations forward and receives gradients backward in one
        call, and a ring shift (every rank sends to the next and receives from the previous)
        never deadlocks, whatever order each rank lists its pairs in. Between two ranks, the k-th
        tensor one sends to the other (in the order of ``sends``, counting :meth:`send` calls
        too) lands in the k-th receive the other posts for it (in the order of its ``recvs``).

        :param sends: ``(tensor, dest_rank)`` pairs; ranks of *this* gang other than :attr:`rank`.
        :param recvs: ``(tensor, source_rank)`` pairs; each ``tensor`` contiguous, with the shape
            and dtype of what its source sends.
        :param async_op: Start the operation and return a :class:`~gang.Work` at once (see
            :class:`~gang.Work`); its tensors must be left alone until ``wait()`` returns.
        :returns: ``None``, or with ``async_op=True`` the operation's :class:`~gang.Work`.
        :raises ValueError: If a rank is this process's rank or outside ``[0, size)``, or a tensor is
            invalid.
        :raises TypeError: If ``sends`` or ``recvs`` is not a sequence of ``(tensor, rank)`` pairs.
        :raises GangError: If a transfer fails or times out.
        """
        if self._closed:
            check_open(self, "send_recv")
        if async_op is not False:
            check_async(async_op)
        checked_sends = check_pairs(self, "sends", sends, "dest_rank", contiguous=False)
        checked_recvs = check_pairs(self, "recvs", recvs, "source_rank", contiguous=True)
        if not self._sends_and_receives:
            self._refuse_traffic("send_recv")
        if self._debug:
            verify_pairs(self, checked_sends, checked_recvs)
        if not checked_sends and not checked_recvs:
            return CompletedWork("send_recv") if async_op else None
        if _TRACING.on:
            pairs = (checked_sends, checked_recvs, async_op, "send_recv")
            sent, received = [t for t, _ in checked_sends], [t for t, _ in checked_recvs]
            peers = _peers(checked_sends, checked_recvs)
            return self._trace.run("send_recv", async_op, sent, received, self._send_recv, pairs, peers)
        work = self._send_recv(checked_sends, checked_recvs, async_op, "send_recv")
        return None if work is None and not async_op else self._result("send_recv", work, async_op)

    @overload
    def all_to_all_uneven(
        self,
        output: TensorLike,
        input: TensorLike,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: Literal[False] = False,
    ) -> None: ...

    @overload
    def all_to_all_uneven(
        self,
        output: TensorLike,
        input: TensorLike,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: Literal[True],
    ) -> Work: ...

    @overload
    def all_to_all_uneven(
        self,
        output: TensorLike,
        input: TensorLike,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: bool,
    ) -> Work | None: ...

    @final
    def all_to_all_uneven(
        self,
        output: TensorLike,
        input: TensorLike,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Send each rank a different number of rows (torch's ``all_to_all_single`` with split sizes).

        Rows are along dim 0: ``input[sum(input_splits[:j]) : sum(input_splits[:j + 1])]`` goes to
        rank ``j``, and what rank ``i`` sent lands at
        ``output[sum(output_splits[:i]) : sum(output_splits[:i + 1])]``. So rank ``i``'s
        ``input_splits[j]`` must equal rank ``j``'s ``output_splits[i]`` (debug mode checks it;
        :func:`gang.exchange_rows` exchanges the counts for you).

        :param output: Contiguous, with ``sum(output_splits)`` rows; the trailing shape and the
            dtype of ``input``.
        :param input: With ``sum(input_splits)`` rows.
        :param output_splits: ``size`` non-negative ``int`` s: the rows received from each rank.
        :param input_splits: ``size`` non-negative ``int`` s: the rows sent to each rank.
        :param async_op: Start the operation and return a :class:`~gang.Work` at once (see
            :class:`~gang.Work`); its tensors must be left alone until ``wait()`` returns.
        :returns: ``None``, or with ``async_op=True`` the operation's :class:`~gang.Work`.
        :raises ValueError: If a splits list has the wrong length, a negative entry or does not sum
            to its tensor's rows, the tensors' trailing shapes or dtypes differ, ``output`` is not
            contiguous, or a tensor has no dimension.
        :raises TypeError: If a tensor is not a tensor, or a splits list not a sequence of ``int``.
        :raises GangError: If the collective fails or times out.
        """
        if self._closed:
            check_open(self, "all_to_all_uneven")
        if async_op is not False:
            check_async(async_op)
        out = check_tensor(self, "output", output, contiguous=True)
        inp = check_tensor(self, "input", input)
        if out.dtype != inp.dtype:
            check_same_dtype("output", out, inp)
        dims = inp.dim()
        if dims == 0:
            raise ValueError("`input` must have at least one dimension (the rows), but is a scalar instead.")
        if out.dim() != dims or (dims > 1 and out.shape[1:] != inp.shape[1:]):
            trailing = "".join(f", {n}" for n in inp.shape[1:])
            raise ValueError(
                f"`output` must have shape [rows{trailing}] (the trailing shape of `input`), "
                f"but has shape {list(out.shape)} instead."
            )
        out_splits = check_splits("output_splits", output_splits, self._size, out.shape[0], "output")
        in_splits = check_splits("input_splits", input_splits, self._size, inp.shape[0], "input")
        if not self._moves_uneven_rows:
            self._refuse_traffic("all_to_all_uneven")
        if self._debug:
            verify_splits(self, out, out_splits, in_splits)
        if _TRACING.on:
            args = (out, inp.contiguous(), out_splits, in_splits, async_op)
            return self._trace.run("all_to_all_uneven", async_op, (inp,), (out,), self._all_to_all_uneven, args)
        work = self._all_to_all_uneven(out, inp.contiguous(), out_splits, in_splits, async_op)
        return None if work is None and not async_op else self._result("all_to_all_uneven", work, async_op)

    @final
    def broadcast_objects(self, objects: list[object], source_rank: int = 0) -> None:
        """Replace the contents of ``objects`` with those of ``source_rank``'s list.

        The source pickles its list before anything is sent. If it cannot, every rank raises a
        :class:`ValueError` (after a short status exchange), so no rank is left waiting: the
        source's names the pickling error, the others' name the source rank.
        Receivers unpickle what the source sends: only use it between processes you trust.

        :param objects: A list of picklable objects; replaced in place on non-source ranks.
        :param source_rank: A rank of *this* gang.
        :raises ValueError: If ``source_rank`` is out of range, or the source's objects cannot be pickled.
        :raises TypeError: If ``objects`` is not a list or ``source_rank`` not an ``int``.
        :raises GangError: If the collective fails or times out.
        """
        check_open(self, "broadcast_objects")
        if not isinstance(objects, list):
            raise TypeError(f"`objects` must be a `list`, but is of type `{type(objects).__name__}` instead.")
        source_rank = check_rank("source_rank", source_rank, self._size)
        check_values_exchangeable(self, "broadcast_objects")
        if self._debug:
            verify_same_call(self, f"broadcast_objects(source_rank={source_rank})")
        if _TRACING.on:
            self._trace.run("broadcast_objects", False, (), (), self._broadcast_objects, (objects, source_rank))
            return
        self._broadcast_objects(objects, source_rank)

    @final
    def close(self) -> None:
        """Close the gang and every sub-gang created from it (sub-gangs first). Idempotent.

        Any collective on a closed gang raises :class:`~gang.InvalidOperationError`.
        """
        if self._closed:
            return
        for child in reversed(self._children):
            child.close()
        self._children.clear()
        self._closed = True
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, device={self.device})"

    # -- what a concrete gang implements -----------------------------------------------------

    @abstractmethod
    def _split(self, groups: list[list[int]]) -> Gang | None:
        """Create the sub-gangs ``groups`` (validated, sorted, disjoint); return this process's."""

    def _split_own_group(self, members: list[int], every_group: Callable[[], list[list[int]]]) -> Gang | None:
        """Create the sub-gang ``members`` (validated, sorted) of a split; by default through :meth:`_split`."""
        return self._split(every_group())

    @abstractmethod
    def _as_process_group(self) -> ProcessGroup: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def _all_reduce(self, tensor: Tensor, op: ReduceOperation, async_op: bool) -> Work | None: ...

    @abstractmethod
    def _all_gather(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None: ...

    @abstractmethod
    def _all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None: ...

    @abstractmethod
    def _reduce_scatter(
        self, output_tensor: Tensor, input_tensor: Tensor, op: ReduceOperation, async_op: bool
    ) -> Work | None: ...

    @abstractmethod
    def _all_to_all(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None: ...

    @abstractmethod
    def _broadcast(self, tensor: Tensor, source_rank: int, async_op: bool) -> Work | None: ...

    def _send_recv(
        self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], async_op: bool, operation: str
    ) -> Work | None:
        """Post every send and receive at once and complete them all; :meth:`send` and :meth:`recv` come here too.

        ``sends`` and ``recvs`` are checked ``(tensor, peer)`` pairs (contiguous tensors, peers
        other ranks of this gang; at least one pair in all), in the caller's order, which fixes
        the order of the transfers between two ranks. ``operation`` is the public method's name,
        for error messages. Must never deadlock whatever order the ranks list their pairs in.
        """
        raise NotSupportedError(f"`{operation}` is not supported by `{type(self).__name__}` yet.")

    def _all_to_all_uneven(
        self,
        output: Tensor,
        input: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        async_op: bool,
    ) -> Work | None:
        """Exchange rows of contiguous ``input`` into ``output`` by the checked split sizes."""
        raise NotSupportedError(f"`all_to_all_uneven` is not supported by `{type(self).__name__}` yet.")

    def _refuse_traffic(self, operation: str) -> None:
        """Raise :class:`~gang.NotSupportedError` naming ``operation`` where this kind of gang has no
        point-to-point transfers (``send``, ``recv``, ``send_recv``) or no uneven rows
        (``all_to_all_uneven``, :func:`gang.exchange_rows`).

        Called once the arguments are checked, before debug mode's checks and any communication, so
        a refusal is the same on every rank and sends nothing. By default a kind refuses what it
        does not implement (:meth:`_send_recv` or :meth:`_all_to_all_uneven`); a kind that keeps
        this default and implements the operation is known per class (``__init_subclass__``), and
        its calls skip this method.
        """
        cls = type(self)
        uneven = operation in ("all_to_all_uneven", "exchange_rows")
        if (cls._all_to_all_uneven if uneven else cls._send_recv) is (
            Gang._all_to_all_uneven if uneven else Gang._send_recv
        ):
            raise NotSupportedError(f"`{operation}` is not supported by `{cls.__name__}` yet.")

    @abstractmethod
    def _close(self) -> None: ...

    def _broadcast_objects(self, objects: list[object], source_rank: int) -> None:
        """Send the pickled list as a length header and a byte tensor over :meth:`_broadcast`."""
        payload: bytes | None = b""
        error = ""
        if self.rank == source_rank:
            payload, error = pickle_or_error(objects)
        header = torch.tensor([-1 if payload is None else len(payload)], dtype=torch.int64, device=self.device)
        _block(self._broadcast(header, source_rank, False))
        length = int(header.item())
        if length < 0:
            raise ValueError(unpicklable_objects(source_rank, error))
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(length, dtype=torch.uint8, device=self.device)
        if length > 0:
            _block(self._broadcast(data, source_rank, False))
        if self.rank != source_rank:
            objects[:] = pickle.loads(data.cpu().numpy().tobytes())

    # -- shared plumbing ------------------------------------------------------------------------

    def _register(self, child: Gang | None, members: list[int] | None = None) -> Gang | None:
        index = self._trace.splits  # every member of this gang counts every split, so the index names the child
        self._trace.splits += 1
        if child is not None and child is not self:
            child._debug = self._debug
            child._trace.adopt(self._trace, index, members)
            self._children.append(child)
        return child

    def _traced_split(self, impl: Callable[..., Gang | None], *args: Any) -> Gang | None:
        """Run a split (recorded as the operation ``split`` while tracing is on)."""
        if not _TRACING.on:
            return impl(*args)
        made: list[Gang | None] = []
        self._trace.run("split", False, (), (), lambda: made.append(impl(*args)), ())
        return made[0]

    def _verify_same_call(self, call: str, detail: str = "") -> list[str]:
        """Debug mode's check that every rank of this gang makes ``call`` (:func:`gang._debug.verify_same_call`),
        for the operations a kind of gang adds beside :class:`Gang`'s (``gang_jax.functional``'s)."""
        return verify_same_call(self, call, detail)

    def _trace_members(self) -> Sequence[int] | None:
        """The global rank of each member, for the flight recorder's table of gangs (``None``: not known to
        this kind of gang; the recorder then derives them from the gang it was split from)."""
        return None

    @staticmethod
    def _result(operation: str, work: Work | None, async_op: bool) -> Work | None:
        """What a public method returns for what its protected method returned (``None``: done already)."""
        if async_op:
            return CompletedWork(operation) if work is None else work
        if work is not None:
            work.wait()
        return None


def _peers(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> tuple[list[int], list[int]]:
    """The peers of the sends and of the receives of a point-to-point call, for the flight recorder."""
    return [p for _, p in sends], [p for _, p in recvs]
