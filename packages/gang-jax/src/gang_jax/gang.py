"""The :class:`JaxGang`: a :class:`gang.Gang` whose collectives run on JAX."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar, final

import jax
import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from typing_extensions import override

from gang import Gang, GangError, InvalidOperationError, NotSupportedError, ReduceOperation, Work
from gang.errors import BACKEND_ERRORS
from gang.extend import check_int, check_open, check_rank, check_timeout, claim_rank, guard
from gang_jax._collectives import Communicator
from gang_jax._engine import (
    DEFAULT_COORDINATION_TIMEOUT,
    Engine,
    LocalEngine,
    Op,
    runtime_timeout,
    start_runtime,
    stop_runtime,
)
from gang_jax._isolated import ISOLATED_GRACE_S, IsolatedEngine
from gang_jax._lane import Lane, local_lane
from gang_jax._rendezvous import Rendezvous, resolve

T = TypeVar("T")


def _rank_and_size(where: Rendezvous) -> tuple[int | None, int | None]:
    """The ``(rank, size)`` that a failed ``create_default`` reports."""
    return where.process_id, where.num_processes


@final
class JaxGang(Gang):
    """A gang whose collectives run on JAX's multi-process CPU collectives.

    Gang rank ``i`` is the process owning the ``i``-th device of the gang's mesh (one device per
    process: the first CPU device the process owns). Collectives take torch CPU tensors (updated
    in place) or NumPy arrays and give the same results as :class:`gang.ProcessGroupGang`. 64-bit
    types are handled whatever ``jax_enable_x64`` says. Create the root with
    :meth:`create_default`; sub-gangs come from :meth:`create_gang` and :meth:`split`.

    :param engine: What runs the collectives: JAX in this process, or in an isolated child
        process (see :meth:`create_default`).
    :param owns_runtime: Whether closing this gang shuts ``jax.distributed`` down (and ends the lane).
    :param debug: Whether every collective first checks that all ranks make the same call
        (``None``: on when the environment variable ``GANG_DEBUG`` says so). Sub-gangs inherit it.
    :param lane: The queue the gang's operations run in, shared with the gang it was split from
        (``None``: the lane of this process's JAX runtime, or for an isolated engine a new one).
    :param timeout: How long an operation may wait for its peers before the gang breaks (see
        :meth:`create_default`; ``None``: the timeout the JAX runtime was started with, or 5 minutes).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        owns_runtime: bool = False,
        debug: bool | None = None,
        lane: Lane | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(rank=engine.rank, size=engine.size, device=torch.device("cpu"), debug=debug)
        self._engine = engine
        self._owns_runtime = owns_runtime
        self._timeout_s = (runtime_timeout() if timeout is None else timeout).total_seconds()
        if lane is None:
            if isinstance(engine, LocalEngine):
                lane = local_lane()
            else:
                # The child's own wait ends a call first, with its own message; the lane is the backstop.
                lane = Lane(grace_s=ISOLATED_GRACE_S, on_break=engine.abort)
        self._lane = lane
        claim_rank(engine.members[engine.rank])

    @classmethod
    def _in_process(cls, *, owns_runtime: bool, debug: bool | None) -> JaxGang:
        """A gang of every JAX process on this process's JAX runtime."""
        engine = LocalEngine.of_processes(list(range(jax.process_count())))
        return cls(engine, owns_runtime=owns_runtime, debug=debug)

    @classmethod
    def create_default(
        cls,
        *,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        timeout: timedelta | None = None,
        debug: bool | None = None,
        isolated: bool = False,
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
            :class:`~gang.GangError` first. See "JAX gangs" in the failures guide. It is also the
            longest any call of the gang (and ``wait()`` on its handles) waits for its peers, the
            first call included (compiling does not count): then every rank that waits gets a
            :class:`~gang.GangError` and the gang is broken (see "Timeouts, in-process too" in the
            JAX guide). With ``isolated=True`` the children's own runtime gets 2 minutes more to
            join, for their start-up. JAX's shutdown waits at least 5 minutes for the other
            processes, whatever ``timeout`` says.
        :param debug: Turn debug mode on or off for this gang and its sub-gangs (``None``: from
            ``GANG_DEBUG``); see :attr:`gang.Gang.debug`.
        :param isolated: Run JAX in a child process that this process starts and talks to
            through a pipe and shared memory. When a peer dies, JAX ends the children, and every
            survivor's pending and next collective raises :class:`~gang.GangError` (within
            ``timeout``) while the survivor's own process lives on; it may close the gang and
            go on. Each collective then costs a round trip to the child and two copies; see
            "Gangs on JAX: when to isolate, what it costs" in the JAX guide.
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
        timeout = check_timeout(timeout, default=DEFAULT_COORDINATION_TIMEOUT)
        if not isinstance(isolated, bool):
            raise TypeError(f"`isolated` must be a `bool`, but is {isolated!r} instead.")

        if isolated:
            where = resolve(coordinator_address, num_processes, process_id, timeout)
            with guard("create_default", _rank_and_size(where), f"coordinator {where.coordinator_address}, isolated"):
                engine = IsolatedEngine.start(where, timeout)
            return cls(engine, owns_runtime=True, debug=debug, timeout=timeout)
        if jax.distributed.is_initialized():
            if (coordinator_address, num_processes, process_id) != (None, None, None):
                raise InvalidOperationError(
                    "`jax.distributed` is already initialised; call `create_default()` without arguments to wrap it."
                )
            return cls._in_process(owns_runtime=False, debug=debug)

        where = resolve(coordinator_address, num_processes, process_id, timeout)
        with guard("create_default", _rank_and_size(where), f"coordinator {where.coordinator_address}"):
            start_runtime(where, timeout)
        return cls._in_process(owns_runtime=True, debug=debug)

    # -- properties -----------------------------------------------------------------------------

    @property
    @override
    def supports_process_group(self) -> bool:
        return False

    @property
    def isolated(self) -> bool:
        """Whether JAX runs in a child process (``create_default(isolated=True)``)."""
        return not isinstance(self._engine, LocalEngine)

    @property
    def members(self) -> tuple[int, ...]:
        """The JAX process index of each member, in gang rank order."""
        return self._engine.members

    @property
    def communicator(self) -> Communicator:
        """The compiled collectives of this gang on ``jax.Array`` blocks (what :mod:`gang_jax.functional` runs).

        :mod:`gang_jax.functional` runs them in the gang's queue, under its timeout and debug mode;
        calling them directly does neither (a call may then overtake an operation in flight).

        :raises NotSupportedError: If the gang is isolated (JAX does not run in this process).
        """
        if not isinstance(self._engine, LocalEngine):
            raise NotSupportedError("An isolated `JaxGang` runs JAX in a child process; it has no JAX objects here.")
        return self._engine.comm

    @property
    def jax_device(self) -> jax.Device:
        """The JAX device this process contributes to the gang's mesh (in-process gangs only)."""
        return self.communicator.device

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The one-dimensional mesh (axis ``"gang"``) of the members' devices, in rank order (in-process gangs only)."""
        return self.communicator.mesh

    @property
    def num_compiled(self) -> int:
        """How many compiled collectives this gang holds (one per collective, reduction, shape and dtype).

        JAX's own count of compiled programs: it stays flat in a loop that repeats the same calls.
        """
        return self._lane.call("num_compiled", self, lambda: self._engine.num_compiled, self._timeout_s)

    # -- implementation ---------------------------------------------------------------------------

    @override
    def _split(self, groups: list[list[int]]) -> Gang | None:
        # No communication is needed: every member computes the same meshes from the same groups.
        for group in groups:
            if self.rank in group:
                with guard("split", self):
                    engine = self._lane.call("split", self, partial(self._engine.split, group), self._timeout_s)
                return JaxGang(engine, lane=self._lane, timeout=timedelta(seconds=self._timeout_s))
        return None

    @override
    def _trace_members(self) -> Sequence[int]:
        return self._engine.members

    @override
    def _as_process_group(self) -> ProcessGroup:
        raise NotSupportedError("`JaxGang` has no torch process group; use its collectives instead.")

    def _run(
        self,
        op: Op,
        outputs: Sequence[Tensor],
        inputs: Sequence[Tensor],
        args: tuple[Any, ...] = (),
        *,
        async_op: bool = False,
        operation: str | None = None,
    ) -> Work | None:
        """Run the engine's ``op`` (every operation goes through here) in the lane's order.

        A failure is reported as a ``GangError`` naming ``operation`` (default: the op's name), from
        this call or, with ``async_op``, from the handle's ``wait()``; so is an operation whose
        peers do not meet it within the gang's timeout (see :mod:`gang_jax._lane`).
        """
        name = operation or op.name.lower()

        def call() -> None:
            with guard(name, self):
                self._engine.run(op, outputs, inputs, args)

        if async_op:
            return self._lane.start(name, self, call, self._timeout_s)
        self._lane.call(name, self, call, self._timeout_s)
        return None

    def _run_jax(self, operation: str, call: Callable[[], str], fn: Callable[[], T]) -> T:
        """Run ``fn`` (a JAX program of :mod:`gang_jax.functional`) in the lane's order, checked by debug mode.

        :param operation: The name of the operation, for error messages.
        :param call: Returns the call as debug mode compares it across ranks (called in debug mode only).
        """
        check_open(self, operation)
        self._lane.check(operation, self)
        if self.debug:
            self._verify_same_call(call())

        def run() -> T:
            with guard(operation, self):
                return fn()

        return self._lane.call(operation, self, run, self._timeout_s)

    def _run_group(self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], operation: str) -> None:
        """Run one group of point-to-point transfers (see :meth:`_send_recv`) on the lane's worker thread."""
        # One two-process `ppermute` program per peer, run in the same global order on every rank.
        sent, dests = [t for t, _ in sends], tuple([p for _, p in sends])
        received, sources = [t for t, _ in recvs], tuple([p for _, p in recvs])
        with guard(operation, self):
            self._engine.run(Op.SEND_RECV, received, sent, (dests, sources))

    @override
    def _barrier(self) -> None:
        self._run(Op.BARRIER, (), ())

    @override
    def _all_reduce(self, tensor: Tensor, op: ReduceOperation, async_op: bool) -> Work | None:
        return self._run(Op.ALL_REDUCE, (tensor,), (tensor,), (op,), async_op=async_op)

    @override
    def _all_gather(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None:
        return self._run(Op.ALL_GATHER, (output_tensor,), (input_tensor,), async_op=async_op)

    @override
    def _all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        rows = torch.empty((self.size, *input_tensor.shape), dtype=input_tensor.dtype)
        self._run(Op.ALL_GATHER, (rows,), (input_tensor,), operation="all_gather_to_list")
        for row, out in zip(rows, output_tensors, strict=True):
            out.copy_(row)

    @override
    def _reduce_scatter(
        self, output_tensor: Tensor, input_tensor: Tensor, op: ReduceOperation, async_op: bool
    ) -> Work | None:
        return self._run(Op.REDUCE_SCATTER, (output_tensor,), (input_tensor,), (op,), async_op=async_op)

    @override
    def _all_to_all(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None:
        return self._run(Op.ALL_TO_ALL, (output_tensor,), (input_tensor,), async_op=async_op)

    @override
    def _broadcast(self, tensor: Tensor, source_rank: int, async_op: bool) -> Work | None:
        return self._run(Op.BROADCAST, (tensor,), (tensor,), (source_rank,), async_op=async_op)

    @override
    def _send_recv(
        self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], async_op: bool, operation: str
    ) -> Work | None:
        # Transfers wait in the gang's group until one of them is waited for, a blocking one is made or
        # another operation is posted; the group then runs as one `send_recv` (see `gang_jax._lane`).
        if operation == "debug mode":  # debug mode's own exchange: on its own, after what is pending
            return self._run(
                Op.SEND_RECV,
                [t for t, _ in recvs],
                [t for t, _ in sends],
                (tuple([p for _, p in sends]), tuple([p for _, p in recvs])),
                operation=operation,
            )
        key = id(self._engine)
        return self._lane.post_p2p(
            key, self, self._run_group, sends, recvs, operation, self._timeout_s, async_op=async_op
        )

    @override
    def _all_to_all_uneven(
        self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int], async_op: bool
    ) -> Work | None:
        # Padded blocks through the all-to-all kernel: XLA:CPU has no `ragged_all_to_all`.
        args = (tuple(output_splits), tuple(input_splits))
        return self._run(Op.ALL_TO_ALL_UNEVEN, (output,), (input,), args, async_op=async_op)

    @override
    def _close(self) -> None:
        lane = self._lane
        if lane.closed:  # the root was closed first: nothing runs on the lane any more
            with contextlib.suppress(*BACKEND_ERRORS):
                self._engine.close()
            return
        if lane.broken is None:
            # After every operation in flight (an overrun breaks the lane: then as below).
            with contextlib.suppress(GangError):
                lane.call("close", self, self._engine.close, self._timeout_s)
        if lane.broken is not None:
            # A program that overran its timeout may still be on the lane's thread: nothing more runs
            # there. The engine drops what it holds (an isolated one ends its child).
            with contextlib.suppress(*BACKEND_ERRORS):
                self._engine.abort(lane.broken)
                self._engine.close()
        if not self._owns_runtime:
            return
        stop = stop_runtime if not self.isolated and jax.distributed.is_initialized() else None
        if lane.running:
            # A program that overran its timeout is still in the runtime: shutting it down under the
            # program could crash the process. The lane's thread shuts it down once the program ends
            # (its peers met it late); if it never does, the runtime is left to the process's exit.
            lane.close(then=stop)
            return
        lane.close()
        if stop is not None:
            with guard("close", self):
                stop()  # so that `create_default` works after this
