""":class:`ReplicaGang`: a gang across replicas whose membership changes at runtime."""

from __future__ import annotations

import logging
import pickle
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, final

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from gang._torch_groups import (
    PrefixStore,
    StandaloneGroup,
    new_standalone_group,
    register_python_group,
    unregister_python_group,
)
from gang._torch_ops import TorchCalls
from gang.address import user_gloo_interface
from gang.errors import BACKEND_ERRORS, GangError, InvalidOperationError, NotSupportedError
from gang.extend import check_int, check_open, claim_rank, operation_error
from gang.ft.group import build_within, forget_frames, reaper, settle, wait_briefly
from gang.ft.heal import HealedState, heal, log_heal, rank_plan, unhealable
from gang.ft.heartbeat import Heartbeat
from gang.ft.identity import (
    check_liveness_address,
    check_replica_device,
    check_replica_id,
    check_replica_rank,
    check_store,
)
from gang.ft.liveness import Liveness
from gang.ft.log import abort_reason, log_event, log_quorum
from gang.ft.policy import Policy, Quorum, watched
from gang.ft.quorum import (
    ROOT,
    IdentityError,
    PolicyMismatchError,
    QuorumClient,
    QuorumTimeoutError,
    StepDeadlineError,
    StoreClient,
    StoreUnreachableError,
)
from gang.ft.reach import probe
from gang.ft.replica_process_group import BACKEND_NAME, ReplicaProcessGroup, replicate_ddp, replicate_fsdp
from gang.ft.terms import DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_REPLICA_TIMEOUT, reconcile
from gang.gang import Gang, ReduceOperation
from gang.trace import process_rank
from gang.work import Work

_fault_hook: Callable[[ReplicaGang, str], RuntimeError | None] | None = None
"""A test-only seam (``tests/ft`` sets it): called before each collective of a step with the gang
and the operation's name; a ``RuntimeError`` it returns is raised where the backend's error would
be, so a test can fail one member's collective while every member lives to vote."""


_NOT_ACROSS_REPLICAS = (
    "`{}` is not supported by `ReplicaGang`: across replicas, whose membership changes at every quorum, "
    "a gang runs collectives only (no point-to-point transfers and no uneven rows)."
)


@final
class _StepWork(Work):
    """The :class:`~gang.Work` of a collective started with ``async_op=True`` inside a step.

    Its failure is recorded as a blocking collective's is (:meth:`ReplicaGang.errored`, the step
    not committed) rather than raised: :meth:`wait` returns, and the step's later collectives are
    skipped. :meth:`ReplicaGang.should_commit` first waits for every work of the step not waited for.
    """

    def __init__(self, gang: ReplicaGang, operation: str, work: Any, then: Callable[[], object] | None) -> None:
        super().__init__(operation)
        self._gang: ReplicaGang | None = gang
        self._work = work
        self._then = then

    def forget(self) -> None:
        """The step failed or ended: drop the torch work (and the gang), so waiting returns at once."""
        self._gang = self._work = self._then = None

    def _wait(self, timeout: float | None) -> bool:
        gang, work = self._gang, self._work
        if gang is None or work is None:
            return True
        try:
            if timeout is None:
                gang._finish(work)
            elif not gang._finish_within(work, timeout):
                return False
        except BACKEND_ERRORS as ex:
            gang._record(self._operation, ex)  # forgets this work, with the step's others
            return True
        if self._then is not None:
            self._then()
        with suppress(ValueError):
            gang._pending.remove(self)
        self.forget()
        return True

    def _poll(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


@dataclass(frozen=True)
class ReplicaStatus:
    """What :meth:`ReplicaGang.status` reports: where this process of a replica stands.

    :ivar replica_id: The replica's id.
    :ivar quorum: The replica ids of the current quorum in rank order (empty before the first step).
    :ivar round: The current quorum's round number (``None`` before the first step).
    :ivar step: The number of committed steps (:attr:`ReplicaGang.step_number`).
    :ivar last_error: The last error this process recorded in a step (a failed collective or
        heal, or an exception raised by the caller's own code), ``None`` if there was none; it
        stays after later steps commit.
    :ivar aborted_in_a_row: The number of consecutive steps that were not committed.
    """

    replica_id: str
    quorum: tuple[str, ...]
    round: int | None
    step: int
    last_error: GangError | None
    aborted_in_a_row: int


@final
class ReplicaGang(Gang):
    """A gang across replicas that keeps training when a replica dies.

    Create it with :meth:`join` (the constructor takes what ``join`` checked). Each training step
    runs inside ``with gang.step():``, which forms the quorum of live replicas, rebuilds the
    process group when membership changed and heals a replica that is behind. Inside a step, a
    failed or hung collective does not raise: it is recorded (:meth:`errored`), the step's later
    collectives are skipped (tensors left as they are; the failed one may have written part of its
    output), and :meth:`should_commit` returns ``False`` on every member. :attr:`rank` and
    :attr:`size` are those of the current quorum (rank 0 of 1 before the first step).
    """

    def __init__(
        self,
        *,
        replica_id: str,
        replica_rank: int,
        replica_size: int,
        address: tuple[str, int],
        device: torch.device,
        state_dict: Callable[[], Mapping[str, Any]],
        load_state_dict: Callable[[Mapping[str, Any]], None],
        timeout: timedelta,
        policy: Policy,
        max_retries: int | None = None,
        liveness_address: str | None = None,
    ) -> None:
        super().__init__(rank=0, size=1, device=device, debug=False)
        self._max_retries = max_retries
        self._aborts: list[str] = []  # the reasons of the consecutive steps not committed
        self._last_error: GangError | None = None
        self._state = HealedState(state_dict, load_state_dict)  # what a heal moves
        self._heal_bytes = self._state.moved  # bytes this process sent and received healing (for tests)
        self._replica_id = replica_id
        self._address = address
        self._timeout = timeout
        self._policy = policy
        self._quorum_timeout = timedelta(seconds=policy.quorum_timeout)
        self._heartbeat_timeout = timedelta(seconds=policy.heartbeat_timeout)
        self._replica_rank = replica_rank
        self._replica_size = replica_size
        self._token = uuid.uuid4().hex[:16]  # this incarnation
        self._step_number = 0
        self._round = 0
        self._quorum: Quorum | None = None
        self._pg: StandaloneGroup | None = None
        self._pg_round = -1
        self._process_group: ReplicaProcessGroup | None = None
        self._in_step = False
        self._pending: list[_StepWork] = []  # this step's works started with `async_op=True`, not yet waited for
        self._error: GangError | None = None
        self._store_lost: GangError | None = None  # the store did not answer for `timeout` + `quorum_timeout`
        self._addresses: dict[str, str] = {}  # the death signal's address of each incarnation probed
        self._commit: bool | None = None
        self._restored = False  # `load_state_dict` was called since the last step
        self._budget = 0.0  # seconds of this step attempt's `timeout + quorum_timeout` not spent yet
        self._calls = TorchCalls(standalone=True)  # the torch translation, with each blocking call's timeout
        self._wait_end = 0.0  # when the gang's wait in progress runs out of the budget (monotonic)
        self._waits = 0  # how deep in `_waiting` this thread is
        self._store = self._connect()
        if replica_id.isdigit():  # torchft's numbering: a replica's processes follow the previous replica's
            claim_rank(int(replica_id) * replica_size + replica_rank)
        self._trace_step: list[Any] | None = None  # the flight recorder's entry of the running step
        with suppress(*BACKEND_ERRORS):  # the flight recorder names the members of each group by these
            self._store.raw.set(_trace_key(replica_id, replica_rank), str(process_rank()))
        self._liveness = Liveness(address[0], self._token, liveness_address)
        args = (replica_id, replica_rank, replica_size, self._token, policy, self._liveness.address)
        self._protocol = QuorumClient(self._store, *args)
        try:  # a failed join closes the death signal's sockets
            try:
                self._protocol.register(0, compare_policy=True)
            except IdentityError as ex:
                raise GangError(f"`join` failed: {ex}.") from ex
            except PolicyMismatchError as ex:
                raise ValueError(f"`policy` must equal the live members' policy: {ex}.") from ex
            except BACKEND_ERRORS as ex:
                raise self._store_error("join", ex) from ex
            beats = QuorumClient(self._connect(), *args)
        except BaseException:
            self._liveness.close()
            raise
        self._heartbeat = Heartbeat(
            beats,
            lambda: self._step_number,
            self._protocol.take_closed,
            policy.heartbeat_timeout,
            f"gang.ft heartbeat {replica_id}",
            self._liveness,
        )

    @classmethod
    def join(
        cls,
        *,
        replica_id: str | int | None = None,
        replica_rank: int | None = None,
        replica_size: int | None = None,
        store: str | None = None,
        device: torch.device | None = None,
        state_dict: Callable[[], Mapping[str, Any]],
        load_state_dict: Callable[[Mapping[str, Any]], None],
        min_replicas: int = 1,
        timeout: timedelta | None = None,
        quorum_timeout: timedelta | None = None,
        heartbeat_timeout: timedelta | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        liveness_address: str | None = None,
        policy: Policy | None = None,
    ) -> ReplicaGang:
        """Join the replicas that train together through the coordination store.

        Every process of a replica (each rank of the replica's own torchrun, which may span
        several nodes) joins with the same ``replica_id``; a process is (replica id, replica
        rank), and the gang links the processes of equal replica rank across replicas. Every
        join is a new incarnation: nothing a dead process left in the store counts for this one.
        Joining only registers this process; the first ``with gang.step():`` forms a quorum.

        :param replica_id: This replica's id (``GANG_FT_REPLICA_ID`` when ``None``); letters,
            digits, ``-``, ``_`` and ``.``. A restarted replica keeps its id.
        :param replica_rank: This process's rank in its replica (``GANG_FT_REPLICA_RANK`` when
            ``None``, else the launcher's ``RANK``; never the node-local rank).
        :param replica_size: The number of processes of the replica (``GANG_FT_REPLICA_SIZE``
            when ``None``, else the launcher's ``WORLD_SIZE``).
        :param store: ``"host:port"`` of ``python -m gang.ft.store`` (``GANG_FT_STORE`` when ``None``).
        :param device: ``cpu`` (gloo) or ``cuda[:N]`` (NCCL); ``None`` is ``cpu``.
        :param state_dict: Returns what a replica that is behind needs (model and optimizer
            state); called on a healthy replica when another one heals.
        :param load_state_dict: Loads what ``state_dict`` returned, on the replica that heals
            (tensors travel in chunks, written into the tensors at the same keys of this replica's
            own ``state_dict()`` when they match; the structure and other leaves are pickled:
            replicas trust each other).
        :param min_replicas: The fewest replicas a step runs with.
        :param timeout: Bounds a stuck collective, healing and the commit vote (default 60 seconds).
        :param quorum_timeout: Bounds forming a quorum (default ``timeout``): a live replica that
            does not join is waited for that long once (then left out until it joins again);
            fewer than ``min_replicas`` replicas joined for that long raises. A store that stops
            answering is retried for that long.
        :param heartbeat_timeout: The silence after which a process, and so its replica, counts
            as dead (default :data:`DEFAULT_HEARTBEAT_TIMEOUT`).
        :param init_sync: At the first step of the job (every member at step 0), every replica
            adopts the state of the member with the smallest replica id, so replicas that start
            from different random weights agree. Every replica must pass the same value.
        :param max_retries: Raise :class:`~gang.GangError` (with the reasons) at the end of the
            ``max_retries``-th consecutive step that was not committed; ``None`` (the default)
            never gives up.
        :param liveness_address: Where this process's death signal listens, and the address it
            publishes for its watchers (``GANG_FT_LIVENESS_ADDRESS`` when ``None``; see
            :ref:`liveness`). Unset: the address of the interface this host reaches the store from,
            so a store on loopback keeps every process on loopback. ``"route"``: every interface,
            publishing the address of the default route's interface (a multi-host job whose store
            is named by a host name that maps to a loopback address on the store's own host).
            Otherwise an IP address of this host, listened on and published as it is.
        :param policy: Every liveness and quorum decision (:class:`gang.ft.policy.Policy`: every
            live replica takes part, torchft's ``DYNAMIC`` mode; :class:`gang.ft.policy.SparesPolicy`:
            a fixed number of replicas take part and the other live ones wait as spares, torchft's
            ``FIXED_WITH_SPARES``). ``None``: a :class:`~gang.ft.policy.Policy` of
            ``min_replicas``, ``quorum_timeout``, ``heartbeat_timeout`` and ``init_sync``. A policy
            given carries those four itself: leave them out. Every process of every replica must
            pass an equal policy (the same class and parameters, :meth:`~gang.ft.policy.Policy.signature`):
            a process whose policy differs from a live member's is refused when it joins.
        :raises ValueError: If an argument has a bad value or an environment variable is missing,
            or ``policy`` is given with ``min_replicas``, ``quorum_timeout``, ``heartbeat_timeout``
            or ``init_sync``, or this process's policy differs from a live member's (the message
            names both; the members go on).
        :raises TypeError: If an argument has the wrong type.
        :raises GangError: If the store cannot be reached, or another live process is this
            (replica id, replica rank) (the message names both; the other one goes on).
        """
        rid = check_replica_id(replica_id)
        address = check_store(store)
        device = check_replica_device(device)
        for name, fn in (("state_dict", state_dict), ("load_state_dict", load_state_dict)):
            if not callable(fn):
                raise TypeError(f"`{name}` must be callable, but is {fn!r} instead.")
        rank, size = check_replica_rank(replica_rank, replica_size)
        terms = reconcile(
            min_replicas=min_replicas,
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            heartbeat_timeout=heartbeat_timeout,
            init_sync=init_sync,
            policy=policy,
            max_retries=max_retries,
        )
        return cls(
            replica_id=rid,
            replica_rank=rank,
            replica_size=size,
            address=address,
            device=device,
            state_dict=state_dict,
            load_state_dict=load_state_dict,
            timeout=terms.timeout,
            policy=terms.policy,
            max_retries=terms.max_retries,
            liveness_address=check_liveness_address(liveness_address),
        )

    # -- properties -----------------------------------------------------------------------------

    @property
    @override
    def supports_process_group(self) -> bool:
        return True

    @property
    def replica_id(self) -> str:
        """This replica's id."""
        return self._replica_id

    @property
    def step_number(self) -> int:
        """The number of committed steps (a healed replica takes its healer's)."""
        return self._step_number

    @property
    def quorum(self) -> tuple[str, ...]:
        """The replica ids of the current quorum, in rank order (empty before the first step)."""
        return () if self._quorum is None else self._quorum.members

    @property
    def timeout(self) -> timedelta:
        """The bound on a stuck collective, on healing and on the commit vote (see :meth:`join`)."""
        return self._timeout

    @property
    def quorum_timeout(self) -> timedelta:
        """The bound on forming a quorum and on retrying the store (see :meth:`join`)."""
        return self._quorum_timeout

    @property
    def heartbeat_timeout(self) -> timedelta:
        """The silence after which a process counts as dead (see :meth:`join`)."""
        return self._heartbeat_timeout

    @property
    def policy(self) -> Policy:
        """Every liveness and quorum decision of this gang (see :meth:`join`)."""
        return self._policy

    @property
    def replica_rank(self) -> int:
        """This process's rank in its replica."""
        return self._replica_rank

    @property
    def replica_size(self) -> int:
        """The number of processes of this replica."""
        return self._replica_size

    @property
    def current_quorum(self) -> Quorum | None:
        """The quorum of the current (or last) step, with its heal plan; ``None`` before the first step."""
        return self._quorum

    def status(self) -> ReplicaStatus:
        """The current quorum, the step number and the last error of this process."""
        q = self._quorum
        return ReplicaStatus(
            self._replica_id,
            () if q is None else q.members,
            None if q is None else q.round,
            self._step_number,
            self._last_error,
            len(self._aborts),
        )

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint saves of the gang: ``{"step_number": n}``.

        Save it next to the model's state; :meth:`load_state_dict` restores it, so a job restarted
        from disk continues its step numbering.
        """
        return {"step_number": self._step_number}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (outside a step, before or between steps).

        A replica restored to a lower step than the others is healed by them at its next step.

        :raises TypeError: If ``state_dict`` is not a mapping or its step number not an ``int``.
        :raises ValueError: If it has no ``"step_number"`` or a negative one.
        :raises InvalidOperationError: Inside ``with gang.step():`` or on a closed gang.
        """
        check_open(self, "load_state_dict")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"`state_dict` must be a mapping, but is {state_dict!r} instead.")
        if "step_number" not in state_dict:
            raise ValueError(f"`state_dict` must have a 'step_number', but is {dict(state_dict)!r} instead.")
        step = check_int("state_dict['step_number']", state_dict["step_number"], minimum=0)
        if self._in_step:
            raise InvalidOperationError("`load_state_dict` cannot be called inside `with gang.step():`.")
        self._step_number = step
        self._state.dirty = False  # the caller restored the model's state with it
        self._restored = True

    # -- the step ---------------------------------------------------------------------------------

    @contextmanager
    def step(self) -> Iterator[ReplicaGang]:
        """Run one training step on the quorum of live replicas.

        On entry: form the quorum (waiting for live replicas; at least ``min_replicas``), rebuild
        the process group under a fresh store prefix when membership changed, and heal this
        replica if it is behind. A spare of a :class:`~gang.ft.policy.SparesPolicy` waits here
        until a quorum takes it in. Call :meth:`should_commit` after the step's collectives; a step
        that never called it (or raised) is not committed on any member.

        An exception raised inside the block before the vote aborts the step on every member at
        once: this process votes against committing and drops its process group, which releases
        the peers waiting for it in a collective (their collectives fail, so they vote against
        too). The exception then propagates; the next step forms a new quorum and a new group.

        A step attempt lasts at most ``timeout + quorum_timeout`` of the gang's own time, from
        entering this block (or from when a spare, or a replica kept apart, stops waiting outside
        the quorum) to its end: forming the quorum spends from that budget, and every wait after
        it (the reachability probes, building the group, the heal, each collective, the vote and
        the store requests among them) ends when the budget is spent, recorded as the step's
        error (the step is not committed; :meth:`should_commit` returns ``False``). The caller's
        own code between the gang's calls spends nothing. See :ref:`step-attempt-bound` for the
        slack and for what forming a quorum may take.

        :raises InvalidOperationError: If the gang is closed or a step is already running.
        :raises GangError: If fewer than ``min_replicas`` replicas joined for ``quorum_timeout``, the
            coordination store is unreachable, this replica's state was partly overwritten by a
            heal that failed and no member is left to heal it, or (on leaving the block) this was
            the ``max_retries``-th consecutive step not committed.
        """
        check_open(self, "step")
        if self._in_step:
            raise InvalidOperationError("`step` cannot be entered while a step of this gang is running.")
        self._in_step = True
        try:
            self._begin()
        except BaseException:
            self._in_step = False
            raise
        self._trace.context = f"step {self._step_number + 1}"
        self._trace_step = self._trace.start("step")
        ok = False
        try:
            yield self
            ok = True
        except Exception as ex:
            if self._commit is None:
                self._record(f"step (the caller's code raised {type(ex).__name__})", ex, ours=False)
            raise
        finally:
            self._in_step = False
            self._forget_pending()
            if self._trace_step is not None:
                self._trace.end(self._trace_step, None if self._commit else self._error)
                self._trace_step = None
            try:
                if self._commit is None:
                    try:
                        with self._waiting():
                            self._vote(False)
                    except GangError:
                        if ok:
                            raise
            finally:
                self._count_abort()

    def _count_abort(self) -> None:
        """Track consecutive uncommitted steps; raise once there are ``max_retries`` of them."""
        if self._commit:
            self._aborts.clear()
            return
        reason = abort_reason(self._error)
        self._aborts.append(f"step {self._step_number + 1}: {reason}")
        if self._quorum is not None:
            log_event(
                "abort",
                f"step {self._step_number + 1} of replica {self._replica_id!r} in {self._quorum.describe()} "
                f"was not committed: {reason}",
                level=logging.WARNING,
                replica=self._replica_id,
                round=self._quorum.round,
                step=self._step_number + 1,
                reason=reason,
            )
        if self._max_retries is not None and len(self._aborts) >= self._max_retries:
            reasons = "; ".join(self._aborts)
            raise GangError(
                f"Replica {self._replica_id!r} gave up after {len(self._aborts)} consecutive steps "
                f"that were not committed (`max_retries`={self._max_retries}): {reasons}."
            )

    def errored(self) -> GangError | None:
        """The error that made this step's collectives stop, or ``None``."""
        return self._error

    def should_commit(self) -> bool:
        """Agree with every member whether this step is committed; call it once per step, last.

        ``True`` only when every member of the quorum finished the step without error. On
        ``True``, :attr:`step_number` grows by one on every member. Calling it again in the same
        step returns the same answer. The exceptions: a process paused from its vote until the
        others had closed two more rounds (its round's keys were then deleted), or whose store was
        restarted during the vote, cannot learn the decision; it gets ``False`` whatever the
        others decided, :meth:`errored` says so, and the replica heals from a peer at its next
        step if the others committed it.

        :raises InvalidOperationError: Outside ``with gang.step():``.
        :raises GangError: If the coordination store is unreachable.
        """
        check_open(self, "should_commit")
        if not self._in_step:
            raise InvalidOperationError("`should_commit` must be called inside `with gang.step():`.")
        if self._commit is None:
            self._settle_pending()
            with self._waiting():
                self._vote(self._error is None)
        if self._store_lost is not None:
            raise self._store_lost
        assert self._commit is not None
        return self._commit

    def _begin(self) -> None:
        if self._store_lost is not None:
            raise self._store_lost
        self._raise_beat_error("step")
        previous = None if self._quorum is None or self._commit is None else (self._quorum, self._commit)
        restored, self._restored = self._restored, False
        if restored:
            previous = None  # its step is not the one the last quorum's members continue from
        self._error = None
        self._commit = None
        try:
            quorum = self._protocol.form(self._round, self._step_number, previous)
        except QuorumTimeoutError as ex:
            raise GangError(
                f"`step` failed on replica {self._replica_id!r} before step {self._step_number + 1}: {ex}."
            ) from ex
        except BACKEND_ERRORS as ex:
            raise self._store_error("step", ex) from ex
        # The step attempt began when this process began forming the quorum, or stopped waiting
        # outside one (a spare, or apart): what forming took is spent.
        self._budget = (self._timeout + self._quorum_timeout).total_seconds()
        self._budget -= time.monotonic() - self._protocol.began
        if self._protocol.outside > 0:
            log_event(
                "outside",
                f"replica {self._replica_id!r} rank {self._replica_rank} waited {self._protocol.outside:.3f} s outside "
                f"the quorum (a spare, or apart) before step {self._step_number + 1}",
                replica=self._replica_id,
                replica_rank=self._replica_rank,
                round=quorum.round,
                seconds=round(self._protocol.outside, 6),
            )
        log_quorum(self._replica_id, self._quorum, quorum, self._replica_rank)
        self._trace.rename(f"replica gang at step {self._step_number + 1}")
        self._heartbeat.watch(watched(quorum, self._replica_id, self._replica_rank))
        self._quorum = quorum
        self._round = quorum.round
        self._rank, self._size = quorum.members.index(self._replica_id), len(quorum.members)
        mine = quorum.steps[self._rank]
        with self._waiting():
            if restored and mine != self._step_number:
                # A quorum proposed before `load_state_dict` (see `QuorumClient.form`) takes this
                # replica at its old step: it must not commit (the next quorum heals from the joins).
                self._record("step", GangError(f"the quorum took this replica at step {mine}, before it was restored"))
            elif self._pg_round != quorum.group and quorum.group != quorum.round:
                # The quorum reuses a group this process dropped after the last vote (its mark did not
                # reach the leader): building it again would wait for peers that never come. Vote
                # against at once; the next quorum builds a new group.
                self._record("step", GangError(f"the group of round {quorum.group} was dropped by this process"))
            elif self._pg_round != quorum.group:
                self._rebuild(quorum)
            if self._error is None:
                self._heal(quorum)

    @contextmanager
    def _waiting(self) -> Iterator[float]:
        """A wait of the gang inside a step attempt (probing and building its group, healing, a
        collective, the vote): yields the seconds left of the attempt's budget, ``timeout +
        quorum_timeout`` from its start (see :meth:`step`), and spends what the wait takes. The
        caller's own code between the gang's calls spends nothing. The waits inside end by the
        budget: :meth:`_watch` raises once it is spent, and so does a store request
        (:class:`~gang.ft.quorum.StepDeadlineError`)."""
        if self._waits:  # inside another wait: its end holds
            yield max(0.0, self._wait_end - time.monotonic())
            return
        began = time.monotonic()
        self._wait_end = self._store.deadline = began + self._budget
        self._waits += 1
        try:
            yield max(0.0, self._budget)
        finally:
            self._waits -= 1
            self._store.deadline = None
            self._budget -= time.monotonic() - began

    def _left(self) -> float:
        """Seconds left of the step attempt's budget, inside :meth:`_waiting`."""
        return max(0.0, self._wait_end - time.monotonic())

    def _rebuild(self, quorum: Quorum) -> None:
        """Build the quorum's process group, within ``timeout``, once every other member's process
        of this replica rank was reached over the network (:meth:`_unreachable`)."""
        self._drop_group()
        prefix = f"{ROOT}g/{quorum.group}/rr{self._replica_rank}"  # one group per replica rank
        try:
            if self._unreachable(quorum):
                return
            # A connection of its own: the rendezvous waits on it while `_watch` reads the store.
            store = PrefixStore(prefix, self._store.connection())
            rank, size, device, timeout, address = (
                self.rank,
                self.size,
                self._device,
                self._timeout,
                self._gloo_address(),
            )
            self._pg = build_within(
                lambda: new_standalone_group(store, rank, size, device, timeout, address),
                min(timeout.total_seconds(), self._left()),
                self._protocol.watch_interval,
                self._watch,
            )
            self._pg_round = quorum.group
            self._trace.rename(self._trace.name, f"{prefix}", self._trace_ranks(quorum))
        except BACKEND_ERRORS as ex:
            self._record("step (building the group)", ex)

    def _gloo_address(self) -> str | None:
        """Where gloo binds: the address this process's death signal publishes (the one the other
        replicas reach it at: see ``liveness_address``), unless the user named an interface in
        ``GLOO_SOCKET_IFNAME`` or the death signal has no address."""
        published = self._liveness.address.rpartition(":")[0].strip("[]")
        return None if user_gloo_interface() is not None or not published else published

    def _unreachable(self, quorum: Quorum) -> bool:
        """Probe every other member's process of this replica rank (its death signal, all at once,
        for ``heartbeat_timeout`` or ``timeout`` if shorter); report those not reached with this
        process's heartbeat (the partition rule, :meth:`gang.ft.policy.Policy.connected`, then
        decides the next round) and abort the step. Whether some were not reached."""
        peers: dict[str, str] = {}
        for member, incarnation in zip(quorum.members, quorum.incarnations, strict=True):
            token = incarnation.split(",")[self._replica_rank]
            if member == self._replica_id:
                continue
            address = self._addresses.get(token)
            if address is None:
                address = self._protocol.address_of((member, self._replica_rank), token)
                if address is None:  # not found (a restarted store): not probed
                    continue
                self._addresses[token] = address
            if address != "-":
                peers[member] = address
        seconds = min(min(self._timeout, self._heartbeat_timeout).total_seconds(), self._left())
        lost = sorted(probe(peers, seconds))
        if not lost:
            return False
        self._heartbeat.reports.add({m: peers[m] for m in lost})
        where = ", ".join(f"{m!r} at {peers[m]}" for m in lost)
        log_event(
            "unreachable",
            f"replica {self._replica_id!r} rank {self._replica_rank} in {quorum.describe()} could not reach "
            f"replica(s) {where} (tried for up to {seconds:g} s)",
            level=logging.WARNING,
            replica=self._replica_id,
            replica_rank=self._replica_rank,
            round=quorum.round,
            unreachable=lost,
        )
        self._heartbeat.reports.wait_written(min(seconds, self._left()))  # the next round's leader reads the report
        self._record(
            "step (building the group)",
            GangError(
                f"replica(s) {where} (replica rank {self._replica_rank}) could not be reached (tried for up to "
                f"{seconds:g} s)"
            ),
        )
        return True

    def _heal(self, quorum: Quorum) -> None:
        """Send this replica's state to the members the quorum's heal plan gives it, or receive it
        (:func:`gang.ft.heal.heal`)."""
        plan = rank_plan(quorum)
        if self._state.dirty and self.rank not in plan:
            error = unhealable(self._replica_id, self._step_number, quorum)
            self._record("heal", error)  # drops the group and votes against: the peers go on at once
            raise error
        if self._pg is None or self._error is not None:
            return
        try:  # no local reference to the group: dropping it must destroy it (see `_record`)
            healed = heal(
                self._pg, self.rank, plan, self._state, self._step_number, self._device, self._finish_transfer
            )
        except Exception as ex:  # a failed transfer, or the caller's `state_dict`/`load_state_dict` raised
            self._record("heal", ex)
            return
        if healed is not None:
            if healed.step is not None:
                self._step_number = healed.step
            log_heal(quorum, self._replica_id, self._replica_rank, healed, self._step_number)

    def _attach_state(
        self,
        name: str,
        state_dict: Callable[[], Mapping[str, Any]],
        load_state_dict: Callable[[Mapping[str, Any]], None],
    ) -> None:
        """Heal ``state_dict()`` under ``name`` along with the user's state (:class:`gang.ft.DiLoCo` does).

        A replica that heals loads the user's state first, then each attached one in the order attached.
        """
        if not self._state.attach(name, state_dict, load_state_dict):
            raise InvalidOperationError(f"`{name}` is already attached to replica {self._replica_id!r}'s gang.")

    def _detach_state(self, name: str) -> None:
        """Stop healing what :meth:`_attach_state` attached under ``name``."""
        self._state.detach(name)

    def _finish(self, work: Any) -> None:
        with self._waiting() as left:
            seconds = min(self._timeout.total_seconds(), left)
            settle(work, self._device, seconds, self._protocol.watch_interval, self._watch)

    def _finish_within(self, work: Any, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``work`` as :meth:`_finish` does; return whether it finished."""
        with self._waiting():
            deadline = time.monotonic() + seconds
            interval = self._protocol.watch_interval
            while not wait_briefly(work, max(1e-3, min(interval, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    return False
                self._watch()
            return True

    def _finish_transfer(self, work: Any) -> None:
        # A point-to-point work's `wait(timeout)` is gloo's own wait, which closes the connection
        # when the time is up: a heal's sends and receives are waited for whole (up to `timeout`),
        # or until the step attempt's budget is spent (the step is lost then: the connection may close).
        left = self._left()
        if self._device.type == "cuda" or left >= self._timeout.total_seconds():
            settle(work, self._device, min(self._timeout.total_seconds(), left), float("inf"), None)
        elif not wait_briefly(work, max(1e-3, left)):
            raise RuntimeError(f"the heal's transfer did not end within the step attempt's {self._attempt_seconds()}")

    def _watch(self) -> None:
        """Raise if this step can no longer commit (see :meth:`QuorumClient.check_step`).

        Called between short waits on a collective: a member that went silent (SIGKILLed with
        its sockets still open in a forked child, a lost host, a stopped process) would otherwise
        hold the others in the collective for the whole ``timeout``.
        """
        assert self._quorum is not None
        if time.monotonic() >= self._wait_end:
            raise RuntimeError(f"stopped waiting: the step attempt's {self._attempt_seconds()} is spent")
        reason = self._protocol.check_step(self._quorum)
        if reason is not None:
            raise RuntimeError(f"stopped waiting for the collective: {reason}")

    def _attempt_seconds(self) -> str:
        """The step attempt's budget, for messages."""
        return f"`timeout + quorum_timeout` ({(self._timeout + self._quorum_timeout).total_seconds():g} s)"

    def _vote(self, ok: bool) -> None:
        assert self._quorum is not None
        if self._store_lost is not None:  # the store did not answer for `timeout` + `quorum_timeout`
            self._commit = False
            raise self._store_lost
        try:
            deadline = min(self._timeout.total_seconds(), self._left())
            # While this thread blocks for the decision, the heartbeat thread watches the vote.
            block = ok and self._heartbeat.running
            if block:
                self._heartbeat.watch_vote((self._quorum, time.monotonic() + deadline))
            try:
                decision = self._protocol.vote(self._quorum, ok, deadline, block=block)
            except StepDeadlineError as ex:  # the store did not answer by the attempt's end: not committed here
                decision = None
                if self._error is None:
                    self._record("should_commit", ex, abort=False)
            finally:
                self._heartbeat.watch_vote(None)
        except BACKEND_ERRORS as ex:
            self._commit = False
            error = self._store_error("should_commit", ex)
            if isinstance(ex, StoreUnreachableError):
                self._store_lost = error
            raise error from ex
        if decision is None and self._error is None:
            self._record(
                "should_commit",
                RuntimeError(
                    "the decision is lost (this process was paused until the round's keys were deleted, or "
                    "the store was restarted during the vote); the step is not committed here and the replica "
                    "heals at its next step"
                ),
                abort=False,
            )
        self._commit = bool(decision)
        if self._commit:
            self._step_number += 1

    # -- collectives ----------------------------------------------------------------------------------

    def _run(self, operation: str, call: Callable[[StandaloneGroup], Any]) -> bool:
        """Run ``call`` on the group unless this step already failed; record a failure."""
        if not self._in_step:
            raise InvalidOperationError(f"`{operation}` must be called inside `with gang.step():`.")
        if self._error is not None or self._pg is None:
            return False
        try:
            self._fault(operation)
            # A blocking collective waits at once: gloo's waits inside it end when the attempt's
            # budget is spent, so that it is not left running (for `timeout`) after the gang
            # stopped waiting for it. Not on CUDA: NCCL's watchdog counts from the work's creation,
            # the device's queued compute included, and may end the process instead of the step.
            if self._device.type == "cpu":
                self._calls.timeout = timedelta(seconds=max(0.001, min(self._timeout.total_seconds(), self._budget)))
            try:
                work = call(self._pg)
            finally:
                self._calls.timeout = None
            if work is not None:
                self._finish(work)
        except BACKEND_ERRORS as ex:
            if self._budget <= _SPENT and _timed_out(ex):  # gloo's timeout (what was left) ended it, as the watch would
                spent = RuntimeError(f"stopped waiting: the step attempt's {self._attempt_seconds()} is spent ({ex})")
                spent.__cause__, ex = ex, spent
            self._record(operation, ex)
            return False
        return True

    def _forget_pending(self) -> None:
        """Give up this step's unwaited works (the step failed or ended): waiting for them returns at once."""
        pending, self._pending = self._pending, []
        for work in pending:
            work.forget()

    def _fault(self, operation: str) -> None:
        """Raise what the test-only seam :data:`_fault_hook` returns for this collective, if anything."""
        if _fault_hook is not None:
            fault = _fault_hook(self, operation)
            if fault is not None:
                raise fault

    def _record(self, operation: str, ex: BaseException, *, abort: bool = True, ours: bool = True) -> None:
        """Record this step's error; with ``abort``, end the step on every member at once.

        Aborting drops the process group (destroying it closes its connections, so peers blocked
        in a collective with this process fail at once instead of at the timeout) and votes
        against committing (peers already voting decide at once). An error raised by this
        module or the backend (``ours``) loses its traceback and those of the errors it chains
        (:func:`gang.ft.group.forget_frames`), whose frames would keep the group (or a ``Work`` of
        it, and so its connections) alive; the caller's own exceptions keep theirs.
        """
        if ours:
            forget_frames(ex)
        if isinstance(ex, StoreUnreachableError) and self._store_lost is None:
            self._store_lost = self._store_error(operation, ex)  # not asked again, by this step or later ones
        where = "" if self._quorum is None else f" of {self._quorum.describe()}"
        error = operation_error(
            operation, self, f"replica {self._replica_id!r} in step {self._step_number + 1}{where}: {ex}"
        )
        error.__cause__ = ex
        self._error = self._last_error = error
        self._trace.failed(error)
        if abort and self._in_step:
            self._forget_pending()
            self._drop_group()
            if self._commit is None:
                with suppress(GangError), self._waiting():  # the store is lost: the vote stays "not committed"
                    self._vote(False)
            elif self._quorum is not None:  # after the vote: the next quorum must not reuse the group
                with suppress(*BACKEND_ERRORS):
                    self._protocol.mark_dropped(self._quorum)

    @override
    def _barrier(self) -> None:
        self._run("barrier", self._calls.barrier)

    # Results are written in place; a collective that fails may leave its output partly written
    # (the step is then not committed anywhere), and the later ones of the step do not run.

    # Each collective starts through the torch translation it shares with `ProcessGroupGang`
    # (`gang._torch_ops`), on the standalone group of the quorum: started as torch's async
    # operations, waited for by `_run` (watching the peers) or handed back as a `_StepWork`.

    @override
    def _all_reduce(self, tensor: Tensor, op: ReduceOperation, async_op: bool) -> Work | None:
        return self._start("all_reduce", lambda pg: self._calls.all_reduce(pg, tensor, op, True), async_op)

    @override
    def _all_gather(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None:
        return self._start(
            "all_gather", lambda pg: self._calls.all_gather(pg, output_tensor, input_tensor, True), async_op
        )

    @override
    def _all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        self._run(
            "all_gather_to_list", lambda pg: self._calls.all_gather_to_list(pg, output_tensors, input_tensor, True)
        )

    @override
    def _reduce_scatter(
        self, output_tensor: Tensor, input_tensor: Tensor, op: ReduceOperation, async_op: bool
    ) -> Work | None:
        total = input_tensor.clone()  # gloo has no reduce-scatter of one tensor: reduce all rows
        return self._start(
            "reduce_scatter",
            lambda pg: self._calls.all_reduce(pg, total, op, True),
            async_op,
            then=lambda: output_tensor.copy_(total[self.rank]),
        )

    @override
    def _all_to_all(self, output_tensor: Tensor, input_tensor: Tensor, async_op: bool) -> Work | None:
        return self._start(
            "all_to_all", lambda pg: self._calls.all_to_all(pg, output_tensor, input_tensor, [], [], True), async_op
        )

    @override
    def _broadcast(self, tensor: Tensor, source_rank: int, async_op: bool) -> Work | None:
        return self._start("broadcast", lambda pg: self._calls.broadcast(pg, tensor, source_rank, True), async_op)

    @override
    def _send_recv(
        self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], async_op: bool, operation: str
    ) -> Work | None:
        raise NotSupportedError(_NOT_ACROSS_REPLICAS.format(operation))

    @override
    def _all_to_all_uneven(
        self,
        output: Tensor,
        input: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        async_op: bool,
    ) -> Work | None:
        raise NotSupportedError(_NOT_ACROSS_REPLICAS.format("all_to_all_uneven"))

    @override
    def _refuse_traffic(self, operation: str) -> None:
        raise NotSupportedError(_NOT_ACROSS_REPLICAS.format(operation))

    def _start(
        self,
        operation: str,
        call: Callable[[StandaloneGroup], Any],
        async_op: bool,
        then: Callable[[], object] | None = None,
    ) -> Work | None:
        """Run ``call`` as :meth:`_run` does; with ``async_op``, return its work unwaited (a :class:`_StepWork`)."""
        if not async_op:
            if self._run(operation, call) and then is not None:
                then()
            return None
        if not self._in_step:
            raise InvalidOperationError(f"`{operation}` must be called inside `with gang.step():`.")
        if self._error is not None or self._pg is None:
            return None  # skipped, as the blocking call is
        try:
            self._fault(operation)
            work = call(self._pg)
        except BACKEND_ERRORS as ex:
            self._record(operation, ex)
            return None
        handle = _StepWork(self, operation, work, then)
        self._pending.append(handle)
        return handle

    def _settle_pending(self) -> None:
        """Wait for the works of this step that the caller did not wait for (before the vote)."""
        while self._pending:
            self._pending[0].wait()

    @override
    def _broadcast_objects(self, objects: list[object], source_rank: int) -> None:
        # Header and payload must both arrive, or the list stays as it is.
        if not self._in_step:
            raise InvalidOperationError("`broadcast_objects` must be called inside `with gang.step():`.")
        if self._error is not None:
            return
        snapshot = list(objects)
        try:
            super()._broadcast_objects(objects, source_rank)
        except (EOFError, pickle.UnpicklingError):
            if self.errored() is None:
                raise
        if self.errored() is not None:
            objects[:] = snapshot

    @override
    def _split(self, groups: list[list[int]]) -> Gang | None:
        raise NotSupportedError("A `ReplicaGang` cannot be split: its membership changes at every quorum.")

    @override
    def _as_process_group(self) -> ProcessGroup:
        if self._process_group is None:
            self._process_group = ReplicaProcessGroup(self)
            register_python_group(self._process_group, BACKEND_NAME)
        return self._process_group

    # -- DDP and FSDP2 across replicas (gang.ft.replica_process_group) ---------------------------

    def replicate_ddp(self, ddp_model: DistributedDataParallel) -> None:
        """Make ``ddp_model`` average its gradients over the replicas of each step's quorum.

        Registers a DDP communication hook that replaces each gradient bucket with its mean over
        the current quorum (:func:`gang.ft.replica_process_group.average`: an all-gather through this
        gang, summed in rank order). DDP's own reduction divides by the size its group had when
        DDP was built, which a changing quorum invalidates; the hook takes over instead. Build
        ``ddp_model`` once, outside any step, as ``DistributedDataParallel(model,
        process_group=gang.as_process_group(), init_sync=False)`` (replicas agree through the
        gang's healing instead of DDP's start-up broadcast), call this before its first forward
        pass, and run forward and backward inside ``with gang.step():``. The buckets are fixed
        here in parameter order (DDP would otherwise reorder them after its first backward pass,
        so a restarted replica's layout would differ from the others'). A failed exchange leaves
        the bucket as it is and the step is not committed.

        :raises TypeError: If ``ddp_model`` is not a ``DistributedDataParallel``.
        :raises ValueError: If ``ddp_model`` was not built over :meth:`as_process_group`, was built
            with ``find_unused_parameters=True`` (without ``static_graph=True``), has assigned its
            buckets already (a second forward pass, an earlier call) or is inside a forward pass.
        :raises NotSupportedError: If this torch's DDP reducer lacks the private calls that fix the
            buckets (see :mod:`gang._torch_groups`).
        """
        check_open(self, "replicate_ddp")
        replicate_ddp(self, ddp_model)

    def replicate_fsdp(self, module: torch.nn.Module) -> None:
        """Average the gradient shards of an FSDP2 ``module`` over the replicas of each step's quorum (HSDP).

        ``module`` is sharded with ``fully_shard`` over this replica's own processes (a 1-D mesh,
        for example ``gang_mesh.fsdp_mesh(gangs)``). Installs FSDP2's all-reduce hook
        (``FSDPModule.set_all_reduce_hook``) on every FSDP module in it: after the reduce-scatter
        inside the replica, each gradient shard is replaced with its mean over the current quorum
        (:func:`gang.ft.replica_process_group.average`). Each process of a replica joins this gang with
        its replica rank, so shard ``k`` is averaged with shard ``k`` of the other replicas, and a
        healed process receives the state of the process of equal replica rank: ``state_dict``
        returns the local shards (``DTensor.to_local()``).

        :raises TypeError: If ``module`` is not a ``torch.nn.Module``.
        :raises ValueError: If ``module`` has no FSDP module, or a parameter on a mesh of more
            than one dimension (FSDP2's own HSDP would average a second time).
        """
        check_open(self, "replicate_fsdp")
        replicate_fsdp(self, module)

    @override
    def _close(self) -> None:
        self._heartbeat.stop(self._quorum_timeout.total_seconds() + self._heartbeat_timeout.total_seconds())
        with suppress(*BACKEND_ERRORS):  # if the store is gone, the others see the heartbeat stop
            self._protocol.leave()
        self._heartbeat.release()  # after `leave`: a watcher that sees the sockets close finds it gone
        self._drop_group()
        if self._process_group is not None:
            unregister_python_group(self._process_group)
        # Destroying a group while the interpreter exits aborts the process (a gloo thread still
        # runs), so a closed gang's groups are gone when `close()` returns.
        reaper.wait(self._timeout.total_seconds())

    # -- helpers ----------------------------------------------------------------------------------

    def _connect(self) -> StoreClient:
        host, port = self._address
        try:
            return StoreClient(host, port, retry=self._quorum_timeout.total_seconds(), timeout=self._timeout)
        except BACKEND_ERRORS as ex:
            raise self._store_error("join", ex) from ex

    def _store_error(self, operation: str, ex: Exception) -> GangError:
        where = "" if self._quorum is None else f" in {self._quorum.describe()}"
        host, port = self._address
        return GangError(
            f"`{operation}` failed on replica {self._replica_id!r} in step {self._step_number + 1}{where}: "
            f"the coordination store at {host}:{port} is unreachable ({ex})."
        )

    def _raise_beat_error(self, operation: str) -> None:
        error = self._heartbeat.error
        if isinstance(error, IdentityError):
            raise GangError(f"`{operation}` failed: {error}.") from error
        if error is not None:
            raise self._store_error(operation, error) from error

    def _trace_ranks(self, quorum: Quorum) -> list[int] | None:
        """The global rank of each member of ``quorum`` in the flight recorder's dumps (``None``: unknown)."""
        try:
            return [int(self._store.raw.get(_trace_key(m, self._replica_rank))) for m in quorum.members]
        except BACKEND_ERRORS:
            return None

    def _drop_group(self) -> None:
        pg, self._pg, self._pg_round = self._pg, None, -1
        if pg is not None:
            reaper.drop(pg)


_SPENT = 0.05
"""Seconds of a step attempt's budget under which a collective that failed is said to have spent it."""


def _timed_out(ex: BaseException) -> bool:
    """Whether ``ex`` is a backend's own timeout (gloo's "Timed out waiting ..."), not the watch's."""
    text = str(ex)
    return "timed out" in text.lower() and not text.startswith("stopped waiting")


def _trace_key(replica_id: str, replica_rank: int) -> str:
    """Where a replica's process publishes its global rank in the flight recorder's dumps."""
    return f"{ROOT}trace/{replica_id}/{replica_rank}"


__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_REPLICA_TIMEOUT", "ReplicaGang", "ReplicaStatus"]
