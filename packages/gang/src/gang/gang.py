"""The :class:`Gang` interface and :class:`ReduceOperation`.

Every public method of :class:`Gang` checks its arguments (the same checks for every kind of
gang) **before** any communication, then calls a protected method that a concrete gang
implements. So a bug that :class:`~gang.FakeGang` catches in a unit test is the bug a real gang
would catch on the cluster, with the same message.
"""

from __future__ import annotations

import json
import os
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

from gang.errors import GangError, NotSupportedError
from gang.extend import (
    SUPPORTED_DTYPES,
    all_gather_bytes,
    check_device,
    check_dtype,
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
from gang.work import CompletedWork, Work

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
        group = self._check_ranks("ranks", ranks)
        if self._debug:
            self._verify_same_call(f"create_gang(ranks={group})")
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
        checked = [self._check_ranks(f"groups[{i}]", group) for i, group in enumerate(groups)]
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
            self._verify_same_call(f"split(groups={checked})")
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
        group = self._check_ranks("members", members)
        if self.rank not in group:
            raise ValueError(f"`members` must hold this process's rank {self.rank}, but is {group} instead.")
        if self._debug:
            self._verify_same_call(f"split(groups={sorted(every_group())})")
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
            self._verify_same_call("barrier()")
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
            _check_async(async_op)
        t = self._check_tensor("tensor", tensor, contiguous=True)
        check_op("op", op, t.dtype)
        if self._debug:
            self._verify_same_call(f"all_reduce({_describe(t)}, op={op.name})")
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
            _check_async(async_op)
        out = self._check_tensor("output_tensor", output_tensor, contiguous=True)
        inp = self._check_tensor("input_tensor", input_tensor)
        self._check_same_dtype("output_tensor", out, inp)
        self._check_shape("output_tensor", out, (self.size, *inp.shape))
        if self._debug:
            self._verify_same_call(f"all_gather(input {_describe(inp)})")
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
        inp = self._check_tensor("input_tensor", input_tensor)
        if len(output_tensors) != self.size:
            raise ValueError(
                f"`output_tensors` must have {self.size} entries (the gang size), "
                f"but has {len(output_tensors)} instead."
            )
        outs = []
        for i, out in enumerate(output_tensors):
            name = f"output_tensors[{i}]"
            o = self._check_tensor(name, out, contiguous=True)
            self._check_same_dtype(name, o, inp)
            self._check_shape(name, o, tuple(inp.shape))
            outs.append(o)
        if self._debug:
            self._verify_same_call(f"all_gather_to_list(input {_describe(inp)})")
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
            _check_async(async_op)
        out = self._check_tensor("output_tensor", output_tensor, contiguous=True)
        inp = self._check_tensor("input_tensor", input_tensor)
        self._check_same_dtype("input_tensor", inp, out)
        self._check_shape("input_tensor", inp, (self.size, *out.shape))
        check_op("op", op, out.dtype)
        if self._debug:
            self._verify_same_call(f"reduce_scatter(input {_describe(inp)}, op={op.name})")
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
            _check_async(async_op)
        out = self._check_tensor("output_tensor", output_tensor, contiguous=True)
        inp = self._check_tensor("input_tensor", input_tensor)
        if out.dtype != inp.dtype:
            self._check_same_dtype("output_tensor", out, inp)
        if inp.dim() == 0 or inp.shape[0] != self._size:
            raise ValueError(
                f"`input_tensor` must have shape [{self.size}, ...] (the gang size first), "
                f"but has shape {list(inp.shape)} instead."
            )
        if out.shape != inp.shape:
            self._check_shape("output_tensor", out, tuple(inp.shape))
        if self._debug:
            self._verify_same_call(f"all_to_all(input {_describe(inp)})")
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
            _check_async(async_op)
        t = self._check_tensor("tensor", tensor, contiguous=True)
        source_rank = check_rank("source_rank", source_rank, self._size)
        if self._debug:
            self._verify_same_call(f"broadcast({_describe(t)}, source_rank={source_rank})")
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
            _check_async(async_op)
        t = self._check_tensor("tensor", tensor)
        dest_rank = self._check_peer("dest_rank", dest_rank)
        sends = [(t.contiguous(), dest_rank)]
        if not self._sends_and_receives:
            self._refuse_traffic("send")
        if self._debug:
            self._verify_pairs(sends, [])
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
            _check_async(async_op)
        t = self._check_tensor("tensor", tensor, contiguous=True)
        recvs = [(t, self._check_peer("source_rank", source_rank))]
        if not self._sends_and_receives:
            self._refuse_traffic("recv")
        if self._debug:
            self._verify_pairs([], recvs)
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
            _check_async(async_op)
        checked_sends = self._check_pairs("sends", sends, "dest_rank", contiguous=False)
        checked_recvs = self._check_pairs("recvs", recvs, "source_rank", contiguous=True)
        if not self._sends_and_receives:
            self._refuse_traffic("send_recv")
        if self._debug:
            self._verify_pairs(checked_sends, checked_recvs)
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
            _check_async(async_op)
        out = self._check_tensor("output", output, contiguous=True)
        inp = self._check_tensor("input", input)
        if out.dtype != inp.dtype:
            self._check_same_dtype("output", out, inp)
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
            self._verify_splits(out, out_splits, in_splits)
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
            self._verify_same_call(f"broadcast_objects(source_rank={source_rank})")
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
            raise ValueError(_unpicklable_objects(source_rank, error))
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(length, dtype=torch.uint8, device=self.device)
        if length > 0:
            _block(self._broadcast(data, source_rank, False))
        if self.rank != source_rank:
            objects[:] = pickle.loads(data.cpu().numpy().tobytes())

    # -- shared checks -------------------------------------------------------------------------

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

    def _gather_blocking(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        _block(self._all_gather(output_tensor, input_tensor, False))

    def _verify_same_call(self, call: str, detail: str = "") -> list[str]:
        """Debug mode: exchange a description of the call; raise on every rank if they differ.

        The exchange is the same two all-gathers on every rank whatever each rank called, so
        mismatched ranks meet here instead of deadlocking in different collectives. ``detail``
        travels with the call but may differ between ranks; every rank's is returned.
        """
        check_values_exchangeable(self, "debug mode")
        rows = all_gather_bytes(self, f"{call}\0{detail}".encode(), gather=self._gather_blocking)
        texts = [(row or b"").decode(errors="replace").split("\0", 1) for row in rows]
        calls = [text[0] for text in texts]
        if len(set(calls)) > 1:
            listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
            raise GangError(
                f"Debug mode: the ranks of a gang of size {self.size} made different calls "
                f"(this is rank {self.rank}): {listing}."
            )
        return [text[-1] if len(text) > 1 else "" for text in texts]

    def _verify_splits(self, output: Tensor, output_splits: list[int], input_splits: list[int]) -> None:
        """Debug mode: check on every rank that rank i's ``input_splits[j]`` is rank j's ``output_splits[i]``."""
        call = f"all_to_all_uneven({_spec(output, rows='*')})"
        details = self._verify_same_call(call, json.dumps([input_splits, output_splits]))
        if self._assumes_same_data:
            return  # every simulated rank made this rank's call: its own checks are in its `_all_to_all_uneven`
        table = [json.loads(d) for d in details]
        wrong = [
            f"rank {i} sends {table[i][0][j]} rows to rank {j}, "
            f"but rank {j} receives {table[j][1][i]} rows from rank {i}"
            for i in range(self.size)
            for j in range(self.size)
            if table[i][0][j] != table[j][1][i]
        ]
        if wrong:
            raise GangError(
                f"Debug mode: the splits of `all_to_all_uneven` do not match across the ranks of a gang of size "
                f"{self.size} (this is rank {self.rank}): {'; '.join(wrong)}."
            )

    def _verify_pairs(self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> None:
        """Debug mode: exchange with each peer what this rank sends it and receives from it; raise on both sides
        if they differ.

        Each side posts one send and one receive of its description per peer (lengths first,
        then the text), so the two meet whatever each called. A peer that makes no matching call
        at all is not seen here: the exchange then fails at the gang's timeout.
        """
        if self._assumes_same_data:
            return  # the simulated peers make the matching calls
        check_values_exchangeable(self, "debug mode")
        peers = sorted({p for _, p in sends} | {p for _, p in recvs})
        if not peers:
            return
        mine = {p: [[_spec(t) for t, q in sends if q == p], [_spec(t) for t, q in recvs if q == p]] for p in peers}
        payloads = {p: json.dumps(mine[p]).encode() for p in peers}
        lengths = {p: torch.tensor([len(payloads[p])], dtype=torch.int64, device=self.device) for p in peers}
        theirs = {p: torch.zeros(1, dtype=torch.int64, device=self.device) for p in peers}
        _block(self._send_recv([(lengths[p], p) for p in peers], [(theirs[p], p) for p in peers], False, "debug mode"))
        texts = {p: torch.frombuffer(bytearray(payloads[p]), dtype=torch.uint8).to(self.device) for p in peers}
        received = {p: torch.zeros(int(theirs[p].item()), dtype=torch.uint8, device=self.device) for p in peers}
        _block(
            self._send_recv(
                [(texts[p], p) for p in peers if texts[p].numel()],
                [(received[p], p) for p in peers if received[p].numel()],
                False,
                "debug mode",
            )
        )
        wrong = []
        for p in peers:
            other = json.loads(bytes(received[p].cpu().numpy().tobytes()).decode(errors="replace") or "[[], []]")
            if mine[p][0] != other[1]:
                wrong.append(_pair_mismatch(self.rank, p, mine[p][0], other[1]))
            if other[0] != mine[p][1]:
                wrong.append(_pair_mismatch(p, self.rank, other[0], mine[p][1]))
        if wrong:
            raise GangError(f"Debug mode: point-to-point calls do not match: {'; '.join(wrong)}.")

    def _check_ranks(self, name: str, ranks: Sequence[int]) -> list[int]:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"`{name}` must be a sequence of `int`, but is {ranks!r} instead.")
        checked = []
        for r in ranks:
            try:
                checked.append(check_int(name, r))
            except TypeError:
                raise TypeError(f"`{name}` must contain only `int` ranks, but contains {r!r} instead.") from None
        ranks = checked
        if len(ranks) == 0:
            raise ValueError(f"`{name}` must not be empty.")
        if len(set(ranks)) != len(ranks):
            duplicates = sorted({r for r in ranks if list(ranks).count(r) > 1})
            raise ValueError(f"`{name}` must be unique, but has duplicates {duplicates} in {list(ranks)} instead.")
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise ValueError(
                f"`{name}` must be ranks of this gang in the range [0, {self.size}), "
                f"but has {bad} in {list(ranks)} instead."
            )
        return sorted(ranks)

    def _check_peer(self, name: str, value: object) -> int:
        """A rank of this gang other than this process's own: the peer of a send or receive."""
        if type(value) is int and 0 <= value < self._size and value != self._rank:
            return value  # the common case, in a few bytecodes (it runs between a wake-up and the transfer)
        peer = check_rank(name, value, self._size)
        if peer == self._rank:
            raise ValueError(
                f"`{name}` must be a rank other than this process's own ({self._rank}) "
                f"in the range [0, {self._size}), but is {peer} instead."
            )
        return peer

    def _check_pairs(self, name: str, pairs: object, peer_name: str, *, contiguous: bool) -> list[tuple[Tensor, int]]:
        """The ``(tensor, rank)`` pairs of :meth:`send_recv`, checked, with contiguous tensors (those of
        ``sends`` made so; ``recvs`` must be); ``name[i]`` names an entry."""
        if type(pairs) is list or type(pairs) is tuple:  # the common case: no error message is built
            fast = []
            for pair in pairs:
                if type(pair) is not tuple or len(pair) != 2:
                    break
                t, peer = pair
                if not (
                    type(t) is Tensor
                    and (t.is_cpu if self._on_cpu else t.device == self._device)
                    and t.dtype in SUPPORTED_DTYPES
                    and t.is_contiguous()
                    and type(peer) is int
                    and 0 <= peer < self._size
                    and peer != self._rank
                ):
                    break
                fast.append(pair)
            else:
                return fast
        if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
            raise TypeError(f"`{name}` must be a sequence of `(tensor, {peer_name})` pairs, but is {pairs!r} instead.")
        checked = []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise TypeError(f"`{name}[{i}]` must be a `(tensor, {peer_name})` pair, but is {pair!r} instead.")
            t = self._check_tensor(f"{name}[{i}][0]", pair[0], contiguous=contiguous)
            checked.append((t.contiguous(), self._check_peer(f"{name}[{i}][1]", pair[1])))
        return checked

    def _check_tensor(self, name: str, value: object, *, contiguous: bool = False) -> Tensor:
        if (
            type(value) is Tensor
            and (value.is_cpu if self._on_cpu else value.device == self._device)
            and value.dtype in SUPPORTED_DTYPES
            and (not contiguous or value.is_contiguous())
        ):
            return value  # the common case, in a few bytecodes (it runs between a wake-up and the collective)
        if not isinstance(value, Tensor):
            value = self._from_array(name, value)
        if value.device != self.device:
            raise ValueError(f"`{name}` must be on the gang's device {self.device}, but is on {value.device} instead.")
        check_dtype(name, value.dtype)
        if contiguous and not value.is_contiguous():
            raise ValueError(f"`{name}` must be contiguous, but is not (strides {list(value.stride())}).")
        return value

    def _from_array(self, name: str, value: object) -> Tensor:
        """A writeable NumPy array as a tensor sharing its memory (CPU gangs only)."""
        if not isinstance(value, np.ndarray):
            raise TypeError(f"`{name}` must be a `torch.Tensor`, but is of type `{type(value).__name__}` instead.")
        if self.device.type != "cpu":
            raise TypeError(f"`{name}` must be a `torch.Tensor` on {self.device}, but is a NumPy array instead.")
        if not value.flags.writeable:
            raise ValueError(f"`{name}` must be a writeable NumPy array, but is read-only.")
        return torch.from_numpy(value)

    @staticmethod
    def _check_same_dtype(name: str, value: Tensor, reference: Tensor) -> None:
        if value.dtype != reference.dtype:
            raise ValueError(f"`{name}` must have dtype {reference.dtype}, but has {value.dtype} instead.")

    @staticmethod
    def _check_shape(name: str, value: Tensor, shape: tuple[int, ...]) -> None:
        if value.shape != shape:
            raise ValueError(f"`{name}` must have shape {list(shape)}, but has shape {list(value.shape)} instead.")


def debug_from_env() -> bool:
    """Return whether the environment variable ``GANG_DEBUG`` turns debug mode on (``1``, ``true``, ``yes``, ``on``;
    any case, surrounding spaces ignored)."""
    return os.environ.get("GANG_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def _peers(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> tuple[list[int], list[int]]:
    """The peers of the sends and of the receives of a point-to-point call, for the flight recorder."""
    return [p for _, p in sends], [p for _, p in recvs]


def _check_async(async_op: object) -> None:
    if async_op is not True and async_op is not False:
        raise TypeError(f"`async_op` must be a `bool`, but is {async_op!r} instead.")


def _block(work: Work | None) -> None:
    """Wait for what a protected method returned with ``async_op=False`` (a kind may return a work anyway)."""
    if work is not None:
        work.wait()


def _spec(t: Tensor, rows: str | None = None) -> str:
    """``float32[4, 8]``: a tensor's dtype and shape as debug mode's messages name them (``rows`` replaces dim 0)."""
    dims = [str(n) for n in t.shape]
    if rows is not None and dims:
        dims[0] = rows
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(dims)}]"


def _pair_mismatch(sender: int, receiver: int, sent: list[str], received: list[str]) -> str:
    """How debug mode names the transfers from ``sender`` to ``receiver`` that do not match."""
    return (
        f"rank {sender} sends {', '.join(sent) or 'nothing'} to rank {receiver}, "
        f"but rank {receiver} receives {', '.join(received) or 'nothing'} from rank {sender}"
    )


def _describe(t: Tensor) -> str:
    return f"shape={list(t.shape)}, dtype={str(t.dtype).removeprefix('torch.')}"


def _unpicklable_objects(source_rank: int, error: str) -> str:
    """The error every rank raises when the source of :meth:`Gang.broadcast_objects` cannot pickle its list."""
    detail = f" with {error}" if error else f" on source rank {source_rank}"
    return f"`objects` must be picklable, but pickling failed{detail}."
