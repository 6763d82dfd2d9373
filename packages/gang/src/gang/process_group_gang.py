"""A gang over a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple, final

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from typing_extensions import override

from gang import rendezvous
from gang._torch_groups import (
    BarrierOptions,
    can_split,
    group_timeout,
    init_fake_process_group,
    is_fake_backend,
    is_non_member,
    settle,
)
from gang._torch_ops import GROUP_CALLS, TorchHandle, options, real_view
from gang.address import use_gloo_interface
from gang.env import get_launcher, get_master_address, get_rank, get_world_size
from gang.errors import BACKEND_ERRORS, GangError, InvalidOperationError, NotSupportedError
from gang.extend import check_device, check_timeout, claim_rank, guard, operation_error
from gang.gang import Gang, ReduceOperation
from gang.work import Work

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT", "ProcessGroupGang", "TorchWork"]

DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=15)
"""How long a :class:`ProcessGroupGang`'s rendezvous and each of its collectives wait for the other
ranks, when :meth:`~ProcessGroupGang.create_default_process_group` is given ``None`` (a gang from
:meth:`~ProcessGroupGang.from_process_group` keeps its group's own timeout)."""


class SplitPlan(NamedTuple):
    """What a split of a gang asks torch for (see :func:`plan_split`)."""

    parent_groups: list[list[int]]
    """The groups as ranks of the parent gang's group: what ``dist.split_group`` takes."""
    group_index: int | None
    """The index of the group that holds this process, or ``None``."""
    members: list[int]
    """The global ranks of that group (empty if none): what a named sub-group is created from."""


def plan_split(global_ranks: Sequence[int], rank: int, groups: list[list[int]]) -> SplitPlan:
    """Plan the split of a gang whose members have ``global_ranks`` into ``groups`` (ranks of the gang).

    :param global_ranks: The global rank of each member of the gang, in gang rank order.
    :param rank: This process's rank in the gang.
    :param groups: Disjoint, sorted lists of ranks of the gang.
    """
    index = next((i for i, group in enumerate(groups) if rank in group), None)
    members = [] if index is None else [global_ranks[r] for r in groups[index]]
    return SplitPlan([list(group) for group in groups], index, members)


@final
class TorchWork(Work):
    """The :class:`~gang.Work` of operations started on a torch process group.

    It keeps its own state: with torch 2.13, gloo's ``is_completed()`` stays ``False`` for a
    reduce-scatter even after ``wait()``, and for a receive whose data has arrived until
    ``wait()`` is called (measured on two processes); gloo's ``wait(timeout)`` on a
    point-to-point transfer closes the connection when the time is up; gloo's works have no
    future.
    So on the CPU a wait without a timeout calls torch's ``wait()`` (bounded by the group's own
    timeout), and a bounded wait or a poll hands torch's ``wait()`` to a thread that it then
    waits for. On CUDA, where torch's ``is_completed()`` reads the device's events, a bounded wait
    polls it, and ``wait()`` then makes the current stream wait for the operation, as torch does.

    :param operation: The gang method's name, for error messages.
    :param works: The torch works of the operation (a batch of transfers has several).
    :param where: The rank of the calling process in the gang and the gang's size, for error messages.
    :param cuda: Whether the gang's device is a CUDA device.
    """

    __slots__ = ("_cuda", "_failure", "_finished", "_where", "_works")

    def __init__(self, operation: str, works: list[TorchHandle], where: tuple[int, int], cuda: bool) -> None:
        super().__init__(operation)
        self._works = works
        self._where = where
        self._cuda = cuda
        self._finished: threading.Event | None = None
        self._failure: BaseException | None = None

    def _wait(self, timeout: float | None) -> bool:
        if self._cuda and timeout is not None and not self._poll_until(time.monotonic() + timeout):
            return False
        if self._cuda or (timeout is None and self._finished is None):
            try:
                for work in self._works:
                    work.wait()
            except BACKEND_ERRORS as ex:
                raise operation_error(self._operation, self._where, ex) from ex
            return True
        finished = self._waiter()
        if not finished.wait(timeout):
            return False
        if self._failure is not None:
            raise operation_error(self._operation, self._where, self._failure) from self._failure
        return True

    def _poll(self) -> bool:
        if self._cuda:
            try:
                return all(work.is_completed() for work in self._works)
            except BACKEND_ERRORS:  # failed: finished, and `_wait` raises it as a GangError
                return True
        return self._waiter().is_set()

    def _poll_until(self, deadline: float) -> bool:
        pause = 0.0001
        while not self._poll():
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return True

    def _waiter(self) -> threading.Event:
        """The event set once a thread that waits for the works saw them end (started on first use)."""
        if self._finished is None:
            self._finished = threading.Event()
            thread = threading.Thread(target=self._wait_in_thread, name=f"gang {self._operation}", daemon=True)
            _WAITERS.add(thread)
            thread.start()
        return self._finished

    def _wait_in_thread(self) -> None:
        assert self._finished is not None
        try:
            for work in self._works:
                work.wait()
        except BaseException as ex:  # handed to the waiting thread
            self._failure = ex
        finally:
            self._finished.set()
            _WAITERS.discard(threading.current_thread())


EXIT_GRACE = 10.0
"""Seconds the interpreter's exit waits for handles still waiting on torch (see :func:`_exit_cleanly`)."""

_WAITERS: set[threading.Thread] = set()
"""The threads of :class:`TorchWork` handles that are still inside torch's ``wait()``."""

_ROOTS: weakref.WeakSet[ProcessGroupGang] = weakref.WeakSet()
"""The root gangs that created torch's default group (:meth:`ProcessGroupGang.create_default_process_group`)."""


@atexit.register
def _exit_cleanly() -> None:
    """End what gangs left running before the interpreter tears itself down.

    A thread still inside a C++ call when the interpreter finalizes is ended by the C library
    (``pthread_exit``) as soon as the call returns and asks for the GIL, and that unwinds through
    a frame that must not throw: the process aborts with "terminate called without an active
    exception" (exit status 134) after it has done all its work. Such a thread is a
    :class:`TorchWork` handle's, inside torch's ``wait()`` for an operation the program never waited
    for (polled with ``is_completed()`` or waited for with a timeout, then left). So at exit, while
    the interpreter still runs (torch registers no exit handler of its own for its groups):

    1. wait up to :data:`EXIT_GRACE` seconds for those threads (their operations end once the other
       ranks take part, or fail once they are gone);
    2. then, when none is left inside torch, close every root gang that created torch's default
       group, so that torch's groups are destroyed here, on the main thread, joining their worker
       threads, and drop the rendezvous stores (:func:`gang.rendezvous.release_stores`), whose
       server and client threads are joined likewise. With an operation still pending the groups
       are left as they are: destroying one waits for its operations, up to the collective timeout.
    """
    deadline = time.monotonic() + EXIT_GRACE
    for thread in list(_WAITERS):
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in list(_WAITERS)):
        return
    for root in list(_ROOTS):
        with contextlib.suppress(Exception):  # at exit: a group torch already dropped, a failed peer
            root.close()
    if not dist.is_initialized():
        rendezvous.release_stores()


def _canonical(
    rank: int, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]
) -> list[tuple[bool, Tensor, int]]:
    """The transfers ``(is_send, tensor, peer)`` in the order both sides of each pair post them.

    By peer; with each peer, the lower rank posts its sends first and the higher one its
    receives first; the caller's order is kept among the sends (and among the receives) of one peer.
    """
    if len(sends) == 1 and len(recvs) == 1:  # a pipeline stage's or a ring's pair, without a sort
        (sent, to), (received, of) = sends[0], recvs[0]
        send, recv = (True, sent, to), (False, received, of)
        return [send, recv] if to < of or (to == of and rank < to) else [recv, send]
    ops = [(True, t, p) for t, p in sends] + [(False, t, p) for t, p in recvs]
    return sorted(ops, key=lambda op: (op[2], op[0] != (rank < op[2])))


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
        self._dry_run = is_fake_backend(pg)
        if not self._dry_run:  # a dry run's rank is not this process's
            claim_rank(self._global_ranks[self._rank])
        # Members create (or wrap) a group in the same order, so the name is the same on all of them.
        self._name = rendezvous.wrapped_name(pg.group_name, self._size) if name is None else name
        self._splits = 0
        self._barrier_options = options(BarrierOptions)
        self._barrier_options.device = pg.bound_device_id or torch.device("cpu")
        self._where = (self._rank, self._size)  # what a TorchWork names in its errors
        self._cuda = self._device.type == "cuda"
        # The latest blocking operation's torch work objects, kept until the next one: so that the
        # backend's thread that ran them never drops the last reference to them, and with them to
        # the caller's tensors. Dropping a tensor whose Python object only C++ still holds takes
        # the interpreter's lock; in a thread, while the interpreter finalizes, that aborts the
        # process ("terminate called without an active exception") after a job's last collective.
        self._held: object = None

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
        :raises InvalidOperationError: If the default process group already exists (its message names
            :func:`~gang.create_default_gang` and :meth:`from_process_group`, which adopt it).
        :raises NotSupportedError: If ``torch.distributed`` is not available.
        :raises GangError: If the rendezvous fails or times out.
        """
        device = check_device("device", device)
        if device.type == "cpu":
            backend = "gloo"
        elif device.type == "cuda":
            backend = "nccl"
        else:
            raise ValueError(f"`device` must be of type `cpu` or `cuda`, but is of type `{device.type}` instead.")
        timeout = check_timeout(timeout, default=DEFAULT_COLLECTIVE_TIMEOUT)
        if not dist.is_available():
            raise NotSupportedError("`torch.distributed` is not available in this build of PyTorch.")
        if dist.is_initialized():
            raise InvalidOperationError(
                "The default process group is already initialised (by this process or by a framework such as "
                "Ray Train, Lightning or Accelerate); `create_default_gang()` adopts it, and "
                "`ProcessGroupGang.from_process_group(torch.distributed.group.WORLD, device)` wraps it."
            )

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
        if backend == "gloo":  # gloo binds the interface that reaches the rendezvous host (unless the user names one)
            use_gloo_interface(host, several_hosts=world_size > get_launcher().local_world_size)
        try:
            serves = rank == 0 and not get_launcher().agent_store
            store = rendezvous.store(host, port, world_size, is_master=serves, timeout=timeout)
            round_number = rendezvous.next_generation()
            dist.init_process_group(
                backend,
                store=rendezvous.prefixed_store(store, round_number),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                pg_options=pg_options,
                # Binds the group to this process's GPU: torch 2.15's default NCCL backend (`nccl2`)
                # runs every group on its bound device, guessing LOCAL_RANK % GPUs without one.
                device_id=device if device.type == "cuda" else None,
            )
            made = dist.group.WORLD
            if backend == "gloo" and made is not None:
                settle(made)  # no member may destroy it while another is still creating it
        except Exception as ex:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise GangError(f"`create_default_process_group` failed during the {what}: {ex}") from ex
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pg = dist.group.WORLD
        assert pg is not None
        name = rendezvous.root_name(round_number)
        root = cls(pg, device, timeout=timeout, owns_group=True, is_default=True, name=name, debug=debug)
        _ROOTS.add(root)
        return root

    @classmethod
    def from_process_group(
        cls, pg: ProcessGroup, device: torch.device, *, timeout: timedelta | None = None, debug: bool | None = None
    ) -> ProcessGroupGang:
        """Wrap a process group the caller already has.

        Closing the returned gang does not destroy ``pg`` (the caller owns it), but does destroy
        the sub-gangs created from it.

        :param pg: A process group this process is a member of.
        :param device: The device its collectives run on.
        :param timeout: The timeout given to sub-gangs (``None``: the group's own timeout, or the
            backend's default where torch does not tell it).
        :param debug: Debug mode (see :attr:`Gang.debug`); ``None`` reads ``GANG_DEBUG``.
        :raises TypeError: If ``pg`` is not a ``ProcessGroup`` or ``device`` not a ``torch.device``.
        :raises ValueError: If this process is not a member of ``pg``.
        """
        if is_non_member(pg) or (isinstance(pg, ProcessGroup) and dist.get_rank(pg) < 0):
            raise ValueError(f"`pg` must be a process group this process is a member of, but is {pg!r} instead.")
        if not isinstance(pg, ProcessGroup):
            raise TypeError(f"`pg` must be a `ProcessGroup`, but is {pg!r} instead.")
        device = check_device("device", device)
        if timeout is None:
            timeout = group_timeout(pg, device)
        else:
            timeout = check_timeout(timeout, default=DEFAULT_COLLECTIVE_TIMEOUT)
        return cls(pg, device, timeout=timeout, owns_group=False, is_default=pg is dist.group.WORLD, debug=debug)

    @classmethod
    def create_dry_run(cls, world_size: int, rank: int, device: torch.device) -> ProcessGroupGang:
        """Initialise torch's default process group on its ``fake`` backend as rank ``rank`` of ``world_size``
        and wrap it as the root gang of a dry run (use :func:`gang.testing.dry_run`, which checks the
        arguments and closes the gang).

        :raises NotSupportedError: If this torch has no ``fake`` backend.
        """
        pg = init_fake_process_group(rank, world_size)
        name = rendezvous.root_name(rendezvous.next_generation())
        try:
            return cls(pg, device, timeout=None, owns_group=True, is_default=True, name=name)
        except BaseException:
            dist.destroy_process_group()
            raise

    @property
    @override
    def supports_process_group(self) -> bool:
        return True

    @property
    def dry_run(self) -> bool:
        """Whether this gang is part of a dry run (torch's ``fake`` backend, see :func:`gang.testing.dry_run`):
        its collectives complete without computing anything."""
        return self._dry_run

    @property
    def timeout(self) -> timedelta | None:
        """The collective timeout of this gang (inherited by its sub-gangs)."""
        return self._timeout

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The global rank of each member, in gang rank order."""
        return self._global_ranks

    @override
    def _split(self, groups: list[list[int]]) -> Gang | None:
        plan = plan_split(self._global_ranks, self._rank, groups)
        split_index = self._splits
        self._splits += 1
        splits = can_split(self._pg, self._device)
        if plan.group_index is None and not splits:
            return None
        name = rendezvous.sub_name(self._name, split_index, -1 if plan.group_index is None else plan.group_index)
        with guard("create_gang", self):
            if splits:
                pg = dist.split_group(self._pg, plan.parent_groups, timeout=self._timeout)
            else:
                pg = rendezvous.new_named_group(plan.members, name, self._timeout)
        if pg is None or plan.group_index is None:
            return None
        return ProcessGroupGang(pg, self._device, timeout=self._timeout, owns_group=True, is_default=False, name=name)

    @override
    def _split_own_group(self, members: list[int], every_group: Callable[[], list[list[int]]]) -> Gang | None:
        if can_split(self._pg, self._device):  # torch's split_group takes every group
            return self._split(every_group())
        split_index = self._splits
        self._splits += 1
        # The smallest member names the group: every member computes the same, no list of groups needed.
        name = rendezvous.sub_name(self._name, split_index, members[0])
        with guard("create_gang", self):
            pg = rendezvous.new_named_group([self._global_ranks[r] for r in members], name, self._timeout)
        if pg is None:
            return None
        return ProcessGroupGang(pg, self._device, timeout=self._timeout, owns_group=True, is_default=False, name=name)

    @override
    def _as_process_group(self) -> ProcessGroup:
        return self._pg

    @override
    def _trace_members(self) -> Sequence[int]:
        return self._global_ranks

    @override
    def _barrier(self) -> None:
        with guard("barrier", self):
            if self._device.type == "cuda":
                dist.barrier(group=self._pg, device_ids=[self._device.index])
            elif not torch.compiler.is_compiling():
                self._pg.barrier(self._barrier_options).wait()
            else:
                dist.barrier(group=self._pg)

    # The collectives start through the translation shared with `gang.ft` (`gang._torch_ops`).

    @override
    def _all_reduce(self, tensor: Tensor, op: ReduceOperation, async_op: bool) -> Work | None:
        try:  # not `guard`: a `with` costs more than a `try` right after a wake-up
            return self._complete("all_reduce", GROUP_CALLS.all_reduce(self._pg, tensor, op, async_op), async_op)
        except BACKEND_ERRORS as ex:
            raise operation_error("all_reduce", self, ex) from ex

    @override
    def _all_gather(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None:
        with guard("all_gather", self):
            work = GROUP_CALLS.all_gather(self._pg, output_tensor, input_tensor, async_op)
            return self._complete("all_gather", work, async_op)

    @override
    def _all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        with guard("all_gather_to_list", self):
            work = GROUP_CALLS.all_gather_to_list(self._pg, output_tensors, input_tensor, False)
            self._complete("all_gather_to_list", work, False)

    @override
    def _reduce_scatter(
        self, output_tensor: Tensor, input_tensor: Tensor, op: ReduceOperation, async_op: bool
    ) -> Work | None:
        with guard("reduce_scatter", self):
            work = GROUP_CALLS.reduce_scatter(self._pg, output_tensor, input_tensor, op, async_op)
            return self._complete("reduce_scatter", work, async_op)

    @override
    def _all_to_all(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None:
        return self._all_to_all_single("all_to_all", output_tensor, input_tensor, [], [], async_op)

    @override
    def _all_to_all_uneven(
        self,
        output: Tensor,
        input: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        async_op: bool,
    ) -> Work | None:
        return self._all_to_all_single("all_to_all_uneven", output, input, output_splits, input_splits, async_op)

    def _all_to_all_single(
        self,
        operation: str,
        output: Tensor,
        input: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        async_op: bool,
    ) -> Work | None:
        try:  # not `guard`: a `with` costs more than a `try` right after a wake-up
            work = GROUP_CALLS.all_to_all(self._pg, output, input, out_splits, in_splits, async_op)
            return self._complete(operation, work, async_op)
        except BACKEND_ERRORS as ex:
            raise operation_error(operation, self, ex) from ex

    @override
    def _broadcast(self, tensor: Tensor, source_rank: int, async_op: bool) -> Work | None:
        with guard("broadcast", self):
            work = GROUP_CALLS.broadcast(self._pg, tensor, source_rank, async_op)
            return self._complete("broadcast", work, async_op)

    @override
    def _send_recv(
        self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], async_op: bool, operation: str
    ) -> Work | None:
        # Posted in one order that both sides of every pair agree on, whatever order the caller
        # listed them in: by peer, and with each peer the lower rank sends first, the higher one
        # receives first. The k-th send to a peer still meets the k-th receive it posts for us.
        if not self._cuda and len(sends) + len(recvs) == 1:
            # One transfer on gloo (a `send` or a `recv`): posted and waited for directly, in as few
            # steps as possible, since they run between the process waking up and the transfer.
            t, peer = sends[0] if sends else recvs[0]
            try:
                work = (self._pg.send if sends else self._pg.recv)([real_view(t)], peer, 0)
                if not async_op:
                    work.wait()
                    self._held = work
                    return None
            except BACKEND_ERRORS as ex:
                raise operation_error(operation, self, ex) from ex
            return TorchWork(operation, [work], self._where, False)
        ops = _canonical(self._rank, sends, recvs)
        try:  # not `guard`: a `with` costs more than a `try` right after a wake-up
            if self._cuda:  # NCCL: one group call, so that no pair waits on another
                p2p = [
                    dist.P2POp(dist.isend if is_send else dist.irecv, real_view(t), group=self._pg, group_peer=peer)
                    for is_send, t, peer in ops
                ]
                works = [w for w in dist.batch_isend_irecv(p2p) if w is not None]
            else:  # gloo posts each transfer at once and never blocks on posting
                pg = self._pg
                works = [(pg.send if is_send else pg.recv)([real_view(t)], peer, 0) for is_send, t, peer in ops]
            if not async_op:
                for work in works:
                    work.wait()
                self._held = works
                return None
        except BACKEND_ERRORS as ex:
            raise operation_error(operation, self, ex) from ex
        return TorchWork(operation, works, self._where, self._cuda)

    def _complete(self, operation: str, work: TorchHandle | None, async_op: bool) -> Work | None:
        """Wait for ``work`` (inside the caller's ``guard`` or ``try``; ``None``: a ``torch.distributed``
        function waited already), or hand it back as a :class:`TorchWork`."""
        if not async_op:
            if work is not None:
                work.wait()
                self._held = work
            return None
        assert work is not None
        return TorchWork(operation, [work], self._where, self._cuda)

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
