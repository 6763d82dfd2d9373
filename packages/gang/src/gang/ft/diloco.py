"""Semi-synchronous training across replicas: :class:`LocalSGD` and (streaming) :class:`DiLoCo`.

Replicas in different buildings or clouds cannot average gradients every step. With these, each
replica trains on its own and the replicas synchronise every ``sync_every`` local steps through a
:class:`~gang.ft.ReplicaGang`, surviving the faults every step of the gang survives. Both are
context managers around the training loop, driven as torchft's are: inside ``with``, every
``step()`` of the (inner) optimizer counts one local step (an optimizer step post-hook) and runs a
sync when one is due. Each sync is one ``with rg.step():`` of the replica gang; the user never
enters a step or votes.

How a sync goes (one ``rg.step()``):

1. The quorum forms; a replica that is behind (restarted, new) is healed: it receives the user's
   state (``join(state_dict=...)``) and this object's own state (global parameters, the outer
   optimizer's state, the local step and which fragments are due) from an up-to-date member.
2. The members exchange what they contribute for the due fragments (``LocalSGD``: their
   parameters; ``DiLoCo``: their pseudo-gradients, global minus local parameters) in two
   collectives, the bytes of a ring all-reduce: an all-to-all gives member ``j`` chunk ``j`` of
   every member's contribution; it sums that chunk in rank order over the members that were *not*
   healed in this step (a healed member's contribution would repeat its healer's) and divides;
   an all-gather gives every member every averaged chunk. Each element is summed in the same
   order on every member, so every member, and a replay in one process, gets the same bits.
   The contribution is written straight into the buffer the all-to-all sends from, and the
   all-gather writes the averages back into it; a fragment's buffers (about ``2 + 1/n`` times its
   bytes for ``n`` members) are kept for its next exchange, unless this one failed. With
   ``quantize="int8"`` or ``"float8"`` the row is quantized before the all-to-all (blocks of 128
   elements with ``float32`` scales, :mod:`gang.ft.quantize`); the member averaging a chunk
   dequantizes the chunks, sums them in ``float32`` in rank order, divides and quantizes the
   average once; the all-gather sends the quantized averages, which every member dequantizes:
   the same bits everywhere, and about a quarter of ``float32``'s bytes.
3. The members vote (:meth:`~gang.ft.ReplicaGang.should_commit`). Only a committed sync changes
   anything: ``LocalSGD`` writes the average into the parameters; ``DiLoCo`` sets the fragment's
   parameters to their global values, puts the average in ``.grad`` and calls
   ``outer_optimizer.step()``: the result is the new global fragment, which becomes the local one
   (``fragment_update_alpha`` mixes in the local values). A sync that was not committed (a member
   died or hung in the exchange) changes nothing on any survivor: local progress is kept, and the
   sync is retried after the next local step with the survivors (its pseudo-gradient then spans
   one more step). With ``fragment_sync_delay=d`` the exchange runs through async handles while
   ``d`` more local steps compute (the all-gather starts as soon as the inner optimizer's
   ``step()`` finds the all-to-all complete, on entering or on leaving it; at the latest at the
   vote), and the vote and the application follow local step ``t + d``.

Every committed sync is logged on the ``gang.ft`` logger (event ``sync``: ``step``,
``local_steps`` when the exchange started, ``applied_after`` local steps, ``fragments``,
``quorum``, ``healed``, ``averaged``, ``bytes`` this process contributed (quantized: its codes and
scales as sent, padding included), ``seconds`` from the exchange's start (once the quorum formed
and any heal ended) to the end of the application, ``waited``, the seconds of those spent blocked
in the vote and the application (with a delay, the part of the exchange that the local steps did
not hide), and ``quorum_seconds``, what forming the quorum and healing took before. The guide is
``docs/diloco.rst``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, final

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gang.errors import InvalidOperationError
from gang.extend import check_int, check_open
from gang.ft.log import log_event
from gang.ft.quantize import check_quantize, chunk_width, dequantize_rows, mean_of_rows, quantize_rows, wire_bytes
from gang.ft.replica import ReplicaGang


def _local(p: Tensor) -> Tensor:
    """The tensor this process holds of ``p``: its local shard for a ``DTensor`` (FSDP2), else ``p`` itself."""
    to_local = getattr(p, "to_local", None)
    with torch.no_grad():
        local = p if to_local is None else to_local()
    assert isinstance(local, Tensor)
    return local.detach()


def _like(p: Tensor, local: Tensor) -> Tensor:
    """``local`` wrapped as ``p`` is: a ``DTensor`` on ``p``'s mesh and placements if ``p`` is one."""
    if not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    assert isinstance(p, DTensor)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def cut_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Cut parameters of ``sizes`` bytes (in registration order) into ``fragments`` contiguous, non-empty
    groups of near-equal bytes; return the parameter indices of each group.

    The boundary before group ``k`` (``k = 1 .. fragments - 1``) is the parameter index whose
    cumulative byte count is nearest ``k * total / fragments``, leaving every group at least one
    parameter (ties go to the earlier index).
    """
    total = sum(sizes)
    cumulative = [0]
    for size in sizes:
        cumulative.append(cumulative[-1] + size)
    bounds = [0]
    for k in range(1, fragments):
        lo, hi = bounds[-1] + 1, len(sizes) - (fragments - k)
        target = k * total / fragments
        bounds.append(min(range(lo, hi + 1), key=lambda i: (abs(cumulative[i] - target), i)))
    bounds.append(len(sizes))
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def prepare_offsets(sync_every: int, fragments: int) -> list[int]:
    """The local step (modulo ``sync_every``) after which each fragment is prepared: fragment ``k``
    after local step ``t`` (counted from 0) when ``t % sync_every == ((k + 1) * sync_every) // fragments - 1``."""
    return [((k + 1) * sync_every) // fragments - 1 for k in range(fragments)]


class _SemiSync:
    """What :class:`LocalSGD` and :class:`DiLoCo` share: the step hook, the counters, the sync and its faults."""

    _kind = ""

    def __init__(
        self,
        rg: ReplicaGang,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        fragments: int,
        fragment_sync_delay: int,
        fragment_update_alpha: float,
        quantize: str | None,
        optimizer_name: str,
    ) -> None:
        if not isinstance(rg, ReplicaGang):
            raise TypeError(f"`rg` must be a `ReplicaGang`, but is of type `{type(rg).__name__}` instead.")
        if not isinstance(module, nn.Module):
            raise TypeError(f"`module` must be a `torch.nn.Module`, but is of type `{type(module).__name__}` instead.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"`{optimizer_name}` must be a `torch.optim.Optimizer`, but is of type `{type(optimizer).__name__}` "
                "instead."
            )
        self._sync_every = check_int("sync_every", sync_every, minimum=1)
        fragments = check_int("fragments", fragments, minimum=1)
        params = list(module.parameters())
        if not params:
            raise ValueError(f"`module` must have parameters, but {type(module).__name__} has none.")
        if fragments > min(self._sync_every, len(params)):
            raise ValueError(
                f"`fragments` must be at most `sync_every` ({self._sync_every}) and the number of parameters "
                f"({len(params)}), but is {fragments} instead."
            )
        delay = check_int("fragment_sync_delay", fragment_sync_delay, minimum=0)
        gap = self._sync_every // fragments
        if delay >= gap:
            raise ValueError(
                f"`fragment_sync_delay` must be less than `sync_every // fragments` ({gap}), so that a fragment is "
                f"applied before the next one is prepared, but is {delay} instead."
            )
        if isinstance(fragment_update_alpha, bool) or not isinstance(fragment_update_alpha, (int, float)):
            raise TypeError(f"`fragment_update_alpha` must be a `float`, but is {fragment_update_alpha!r} instead.")
        alpha = float(fragment_update_alpha)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"`fragment_update_alpha` must be in [0, 1], but is {fragment_update_alpha!r} instead.")
        self._quantize = check_quantize(quantize)
        self._rg = rg
        self._module = module
        self._optimizer = optimizer
        self._params = params
        self._delay = delay
        self._alpha = alpha
        # Bytes of the whole parameter (a DTensor's global size), so every process cuts alike.
        sizes = [p.numel() * p.element_size() for p in params]
        self._fragments = cut_fragments(sizes, fragments)
        self._offsets = prepare_offsets(self._sync_every, fragments)
        self._local_step = 0
        self._due: list[int] = []  # fragments whose exchange is due (prepared, or failed and retried)
        self._flight: _Exchange | None = None  # an exchange started and not yet finished (a delayed fragment)
        self._buffers: dict[tuple[int, ...], _Buffers] = {}  # per fragment: its last exchange's, reused
        self._handles: list[RemovableHandle] = []  # the inner optimizer's step hooks, while entered
        self._restored = False
        self._name = f"gang.ft.{self._kind}"

    # -- what a user sees -------------------------------------------------------------------------

    @property
    def local_step(self) -> int:
        """The number of local (inner optimizer) steps taken so far (a healed replica takes its healer's)."""
        return self._local_step

    @property
    def fragments(self) -> list[list[int]]:
        """The parameter indices (in ``module.parameters()`` order) of each fragment."""
        return [list(f) for f in self._fragments]

    def __enter__(self) -> _SemiSync:
        check_open(self._rg, f"{self._kind}.__enter__")
        if self._handles:
            raise InvalidOperationError(f"This `{self._kind}` is already entered.")
        if not self._restored:
            self._reset()
        self._rg._attach_state(self._name, self._state, self._load)
        try:
            # A job's start (or a replica started anew): one step of the replica gang makes the
            # replicas agree (the gang's `init_sync`), or heals this one and takes part in the
            # sync the others run (its exchange may then be in flight). Retried until this
            # replica has a step number.
            while self._rg.step_number == 0:
                if self._start().apply_after <= self._local_step - 1:
                    self._finish()
        except BaseException:
            self._rg._detach_state(self._name)
            raise
        self._handles = [
            self._optimizer.register_step_pre_hook(self._before_step),
            self._optimizer.register_step_post_hook(self._after_step),
        ]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Leave: an exchange in flight is finished and applied (or, when leaving on an exception,
        aborted on every member); the step hooks are removed."""
        try:
            flight, self._flight = self._flight, None
            if flight is not None and kind is None:
                self._flight = flight
                self._finish()
            elif flight is not None:
                self._discard(flight.buffers)
                flight.stack.__exit__(kind, value, traceback)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._rg._detach_state(self._name)

    def state_dict(self) -> dict[str, Any]:
        """This object's state, for a checkpoint (save it with the model's and ``rg.state_dict()``).

        ``local_step``, the fragments whose exchange is ``due`` (or in flight), and for
        :class:`DiLoCo` the ``global`` parameters (this process's local shards under FSDP2) and
        the ``outer`` optimizer's state. Tensors are copies.
        """
        state: dict[str, Any] = _copy(self._state())
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (before entering, or between steps).

        :raises TypeError: If ``state_dict`` is not a mapping.
        :raises ValueError: If it lacks a key of :meth:`state_dict` or has a bad local step.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"`state_dict` must be a mapping, but is {state_dict!r} instead.")
        missing = [k for k in self._state() if k not in state_dict]
        if missing:
            raise ValueError(f"`state_dict` must have the keys {missing}, but has {sorted(state_dict)} instead.")
        check_int("state_dict['local_step']", state_dict["local_step"], minimum=0)
        self._load(_copy(state_dict))
        self._restored = True

    # -- the hook and the sync ---------------------------------------------------------------------

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Before the inner optimizer's step: the second half of a delayed exchange can overlap it.
        self._gather_if_ready()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        t = self._local_step
        self._local_step += 1
        self._gather_if_ready()
        failed = self._flight is not None and t >= self._flight.apply_after and not self._finish()
        for k, offset in enumerate(self._offsets):
            if t % self._sync_every == offset and k not in self._due:
                self._due.append(k)
        # After a failed exchange, the due fragments are retried after the next local step.
        if not failed and self._due and self._flight is None and self._start().apply_after <= t:
            self._finish()

    def _start(self) -> _Exchange:
        """Enter one step of the replica gang and start exchanging the due fragments.

        Without a delay the exchange is blocking and :meth:`_finish` follows at once; with
        ``fragment_sync_delay=d`` it goes through async handles and the step stays open while
        ``d`` more local steps compute, until :meth:`_finish` after local step ``t + d``.
        """
        begun = time.monotonic()
        rg = self._rg
        stack = ExitStack()
        stack.enter_context(rg.step())  # forms the quorum; heals this replica if it is behind
        started = time.monotonic()  # the exchange starts: the quorum and the heal are behind
        buffers = None
        try:
            quorum = rg.current_quorum
            assert quorum is not None
            due = sorted(self._due)  # after a heal: the healer's
            healed = {quorum.members.index(m) for m in quorum.heal}
            t = self._local_step - 1  # after a heal: the healer's
            buffers = self._buffers_for(due, rg.size)
            self._pack(buffers)
            # The first half of the exchange: chunk j of every member's row goes to member j.
            works = [
                rg.all_to_all(out, inp, async_op=True) if self._delay > 0 else rg.all_to_all(out, inp)
                for out, inp in zip(buffers.received, buffers.wire_sends, strict=True)
            ]
        except BaseException as ex:
            if buffers is not None:  # a collective started before the failure may still write them
                self._discard(buffers)
            stack.__exit__(type(ex), ex, ex.__traceback__)
            raise
        self._flight = _Exchange(
            stack=stack,
            due=due,
            buffers=buffers,
            works=[w for w in works if w is not None],
            averaged=[r for r in range(rg.size) if r not in healed],
            members=list(quorum.members),
            healed=dict(quorum.heal),
            local_steps=t + 1,
            apply_after=t + self._delay if due else t,
            started=started,
            quorum_seconds=started - begun,
        )
        return self._flight

    def _finish(self) -> bool:
        """Vote on the exchange in flight (waiting for its handles), apply it if committed; return whether it was."""
        flight, self._flight = self._flight, None
        assert flight is not None
        rg = self._rg
        waiting = time.monotonic()
        committed = False
        try:
            with flight.stack:
                if not flight.gathered:
                    for work in flight.works:
                        work.wait()  # a failure is recorded by the gang (the vote then fails), not raised
                    self._gather(flight, async_op=False)
                committed = rg.should_commit()
        finally:
            if not committed:
                self._discard(flight.buffers)
        if not committed:
            return False
        if flight.due:
            if self._quantize is not None:  # every member's averaged chunk, quantized: its values
                for send, wire in zip(flight.buffers.sends, flight.buffers.wire_sends, strict=True):
                    dequantize_rows(wire, send.shape[1], self._quantize, out=send)
            self._land(self._split(flight.buffers))
        self._due = [k for k in self._due if k not in flight.due]
        now = time.monotonic()
        buffers = flight.buffers
        if self._quantize is None:
            sent = sum(n * send.element_size() for n, send in zip(buffers.numels, buffers.sends, strict=True))
        else:  # the quantized row as sent: codes and scales, padding included
            sent = sum(wire.numel() for wire in buffers.wire_sends)
        averaged = [flight.members[r] for r in flight.averaged]
        log_event(
            "sync",
            f"{self._kind} sync at step {rg.step_number} after {flight.local_steps} local steps on replica "
            f"{rg.replica_id!r} rank {rg.replica_rank}: fragments {flight.due} averaged over {averaged} of "
            f"{flight.members}, {sent} bytes sent; exchange and update {now - flight.started:.3f} s "
            f"({now - waiting:.3f} s waited) after {flight.quorum_seconds:.3f} s of quorum and heal",
            level=logging.INFO,
            replica=rg.replica_id,
            replica_rank=rg.replica_rank,
            step=rg.step_number,
            local_steps=flight.local_steps,
            applied_after=self._local_step,
            fragments=flight.due,
            quorum=flight.members,
            healed=flight.healed,
            averaged=averaged,
            bytes=sent,
            seconds=round(now - flight.started, 6),
            waited=round(now - waiting, 6),
            quorum_seconds=round(flight.quorum_seconds, 6),
        )
        return True

    def _gather_if_ready(self) -> None:
        """Start the second half of a delayed exchange (async) if the first half has completed."""
        if self._flight is not None and not self._flight.gathered and _completed(self._flight.works):
            self._gather(self._flight, async_op=True)

    def _gather(self, flight: _Exchange, *, async_op: bool) -> None:
        """The second half of the exchange (the first is complete): each member averages its chunk, in rank
        order over the members averaged, and all-gathers the averaged chunks into the buffer its row
        was sent from (then waited for by the vote)."""
        flight.gathered = True
        buffers = flight.buffers
        for table, received, mine, send in zip(
            buffers.wire_sends, buffers.received, buffers.mine, buffers.sends, strict=True
        ):
            if self._quantize is None:
                _ordered_mean(received, flight.averaged, out=mine)
            else:
                mean_of_rows(received, flight.averaged, send.shape[1], self._quantize, out=mine.view(1, -1))
            if async_op:
                self._rg.all_gather(table, mine, async_op=True)
            else:
                self._rg.all_gather(table, mine)

    def _buffers_for(self, due: list[int], size: int) -> _Buffers:
        """The buffers of an exchange of the fragments ``due`` among ``size`` members: those of the last
        exchange of that one fragment when it committed among as many, else new ones."""
        key = tuple(due)
        cached = self._buffers.get(key)
        if cached is not None and cached.size == size:
            return cached
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k in due:
            for i in self._fragments[k]:
                by_dtype.setdefault(self._params[i].dtype, []).append(i)
        groups = list(by_dtype.values())
        numels, sends, wire_sends, received, mine = [], [], [], [], []
        for group in groups:
            first = _local(self._params[group[0]])
            numels.append(sum(_local(self._params[i]).numel() for i in group))
            if self._quantize is None:
                width = -(-numels[-1] // size)
                sends.append(first.new_zeros(size, width))
                wire_sends.append(sends[-1])
                received.append(first.new_empty(size, width))
                mine.append(first.new_empty(width))
            else:  # chunks of whole blocks; the wire tables hold their codes and scales
                width = chunk_width(numels[-1], size)
                sends.append(first.new_zeros(size, width))
                wire_sends.append(torch.empty(size, wire_bytes(width), dtype=torch.uint8, device=first.device))
                received.append(torch.empty_like(wire_sends[-1]))
                mine.append(torch.empty(wire_bytes(width), dtype=torch.uint8, device=first.device))
        buffers = _Buffers(key, size, groups, numels, sends, wire_sends, received, mine)
        if len(due) == 1:  # a retry of several fragments at once is rare: not kept
            self._buffers[key] = buffers
        return buffers

    def _discard(self, buffers: _Buffers) -> None:
        """Stop reusing ``buffers``: a collective of an exchange that failed may still write them."""
        if self._buffers.get(buffers.key) is buffers:
            del self._buffers[buffers.key]

    def _pack(self, buffers: _Buffers) -> None:
        """Write what this process contributes for ``buffers``' fragments into their rows (zero-padded)."""
        with torch.no_grad():
            for group, send in zip(buffers.groups, buffers.sends, strict=True):
                row = send.view(-1)
                at = 0
                for i in group:
                    local = _local(self._params[i])
                    self._contribute(i, local, row[at : at + local.numel()].view(local.shape))
                    at += local.numel()
                row[at:].zero_()
            if self._quantize is not None:
                for send, wire in zip(buffers.sends, buffers.wire_sends, strict=True):
                    quantize_rows(send, self._quantize, out=wire)

    def _split(self, buffers: _Buffers) -> dict[int, Tensor]:
        """The averaged rows (gathered into ``buffers.sends``) as one view per parameter index (local shapes)."""
        out: dict[int, Tensor] = {}
        for group, table in zip(buffers.groups, buffers.sends, strict=True):
            mean = table.view(-1)
            at = 0
            for i in group:
                local = _local(self._params[i])
                out[i] = mean[at : at + local.numel()].view(local.shape)
                at += local.numel()
        return out

    # -- what each kind does -------------------------------------------------------------------------

    def _reset(self) -> None:
        """Take the current parameters as the starting point (on entering, unless restored)."""

    def _contribute(self, i: int, local: Tensor, out: Tensor) -> None:
        """Write what this process contributes for parameter ``i`` (whose local tensor is ``local``) into ``out``."""
        raise NotImplementedError

    def _land(self, averaged: dict[int, Tensor]) -> None:
        """Apply a committed exchange: ``averaged`` maps each synced parameter's index to its average."""
        raise NotImplementedError

    def _state(self) -> dict[str, Any]:
        return {
            "local_step": self._local_step,
            "due": list(self._due),
        }

    def _load(self, state: Mapping[str, Any]) -> None:
        self._local_step = int(state["local_step"])
        self._due = [int(k) for k in state["due"]]


@dataclass
class _Buffers:
    """The tensors of an exchange of some fragments among ``size`` members, one per dtype group.

    ``sends`` holds this process's rows cut into one chunk per member (zero-padded), sent by the
    all-to-all; once that is complete, the all-gather writes every member's averaged chunk into
    it. Kept for the next exchange of the same fragment unless the exchange failed. Quantized,
    ``wire_sends`` holds ``sends`` quantized (:mod:`gang.ft.quantize`, chunks of whole blocks) and
    is what the all-to-all sends and the all-gather fills; the averages are then dequantized
    into ``sends``. Unquantized, ``wire_sends`` is ``sends``.
    """

    key: tuple[int, ...]  # the fragments
    size: int
    groups: list[list[int]]  # the parameter indices of each dtype group
    numels: list[int]  # the elements of each group's row (without the padding)
    sends: list[Tensor]  # (size, width): this process's row, then the averaged chunks of every member
    wire_sends: list[Tensor]  # what is sent and gathered: `sends`, or (size, wire bytes) of its codes and scales
    received: list[Tensor]  # like `wire_sends`: chunk `rank` of every member's row
    mine: list[Tensor]  # this member's averaged chunk (width,), or its wire bytes


@dataclass
class _Exchange:
    """An exchange started by :meth:`_SemiSync._start`: its open step of the replica gang and its buffers."""

    stack: ExitStack  # holds the open `rg.step()`
    due: list[int]
    buffers: _Buffers
    works: list[Any]  # the first half's handles (with a delay)
    averaged: list[int]  # the ranks averaged (not healed in this step)
    members: list[str]
    healed: dict[str, str]
    local_steps: int  # the local steps taken when the exchange started
    apply_after: int  # the local step after which it is voted on and applied
    started: float  # when the exchange started (after the quorum and the heal)
    quorum_seconds: float  # the seconds `rg.step()` took to form the quorum and heal
    gathered: bool = False  # whether the second half (the all-gather) started


def _completed(works: list[Any]) -> bool:
    """Whether every handle of the first half of an exchange has completed."""
    return all(work.is_completed() for work in works)


def _ordered_mean(table: Tensor, ranks: list[int], *, out: Tensor) -> Tensor:
    """The mean of rows ``ranks`` of ``table``, summed in rank order, written into ``out``."""
    out.copy_(table[ranks[0]])
    for r in ranks[1:]:
        out.add_(table[r])
    return out.div_(len(ranks))


def _copy(state: Any) -> Any:
    """``state`` with every tensor cloned (lists, tuples and dicts walked)."""
    if isinstance(state, Tensor):
        return state.detach().clone()
    if isinstance(state, Mapping):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_copy(v) for v in state)
    return state


@final
class LocalSGD(_SemiSync):
    """Local SGD across replicas: every ``sync_every`` local steps, the quorum averages its parameters.

    Use it as a context manager around the training loop; each ``optimizer.step()`` inside counts
    one local step, and after local step ``t`` (counted from 0) with ``t % sync_every ==
    sync_every - 1`` the replicas of the quorum average their parameters in one ``rg.step()`` of
    the replica gang (a committed sync adds 1 to ``rg.step_number``). On entering a job at step 0,
    the replicas first agree on the starting parameters (the gang's ``init_sync``: one step of the
    gang that heals every replica from the one with the smallest id). A replica healed at a sync
    is left out of that sync's average and receives it. A sync that was not committed changes
    nothing and is retried after the next local step.

    :param rg: The replica gang.
    :param module: The model whose parameters are averaged (under FSDP2, each process's shards).
    :param optimizer: The local optimizer; its ``step()`` counts local steps.
    :param sync_every: The number of local steps between syncs.
    :param quantize: ``None`` (full precision), ``"int8"`` or ``"float8"``: each member's parameters
        are sent quantized in blocks of 128 elements with ``float32`` absmax scales, and the average
        comes back quantized (:mod:`gang.ft.quantize`); every replica must pass the same.
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If ``sync_every`` is below 1, ``module`` has no parameters or ``quantize`` is
        not one of the above.
    """

    _kind = "LocalSGD"

    def __init__(
        self,
        rg: ReplicaGang,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        quantize: str | None = None,
    ) -> None:
        super().__init__(
            rg,
            module,
            optimizer,
            sync_every=sync_every,
            fragments=1,
            fragment_sync_delay=0,
            fragment_update_alpha=0.0,
            quantize=quantize,
            optimizer_name="optimizer",
        )

    def __enter__(self) -> LocalSGD:
        super().__enter__()
        return self

    def _contribute(self, i: int, local: Tensor, out: Tensor) -> None:
        out.copy_(local)

    def _land(self, averaged: dict[int, Tensor]) -> None:
        with torch.no_grad():
            for i, mean in averaged.items():
                _local(self._params[i]).copy_(mean)


@final
class DiLoCo(_SemiSync):
    """DiLoCo, and streaming DiLoCo with ``fragments > 1``, across replicas.

    Each replica trains locally with ``inner_optimizer``; the replicas keep one *global* copy of
    the parameters. After local step ``t`` (counted from 0), fragment ``k`` is prepared when ``t %
    sync_every == ((k + 1) * sync_every) // fragments - 1``: its pseudo-gradient (global minus
    local parameters) is averaged over the quorum in one ``rg.step()`` of the replica gang (a
    committed sync adds 1 to ``rg.step_number``); the fragment's parameters are set to their
    global values, the average is put in their ``.grad`` and ``outer_optimizer.step()`` applies
    it (other parameters' gradients are ``None`` meanwhile, so the outer optimizer leaves them;
    every ``.grad`` is restored afterwards): the result is the fragment's new global value. The
    local parameters become ``alpha * local + (1 - alpha) * new_global`` (``alpha`` is
    ``fragment_update_alpha``). Without a delay all of it happens after local step ``t``. With
    ``fragment_sync_delay=d`` the exchange (an all-to-all of chunks, each member averaging its
    chunk in rank order, then an all-gather of the averages) starts after local step ``t``
    through async handles (``async_op=True``) and the step of the replica gang stays open while
    ``d`` more local steps compute (the all-gather starts as soon as the inner optimizer's
    ``step()`` finds the all-to-all complete, on entering or on leaving it); after local step
    ``t + d`` the handles are waited for, the members vote, and the fragment is applied (to the
    local values of step ``t + d``). A failed exchange is then retried after the next local step.

    On entering a job at step 0, the replicas first agree on the starting parameters (the gang's
    ``init_sync``). A replica healed at a sync (restarted, or new) receives the global parameters,
    the outer optimizer's state and the counters from an up-to-date member (and the user's own
    state, which should hold the model and the inner optimizer), is left out of that sync's
    average, and receives its result. A sync that was not committed (a member died mid-exchange)
    changes nothing on any survivor and is retried after the next local step with the survivors.
    A replica started anew waits in its first step for the others' next sync, which must come
    within the gang's ``quorum_timeout``.

    :param rg: The replica gang.
    :param module: The model (under FSDP2, each process averages its own shards with the process
        of equal replica rank).
    :param inner_optimizer: The local optimizer; its ``step()`` counts local steps.
    :param outer_optimizer: The outer optimizer, built over ``module.parameters()`` (for example
        SGD with Nesterov momentum).
    :param sync_every: The number of local steps between two syncs of a fragment.
    :param fragments: The number of fragments: the parameters in registration order are cut into
        that many contiguous groups of near-equal bytes (:attr:`fragments`).
    :param fragment_sync_delay: The number of local steps between a fragment's exchange and its
        application; less than ``sync_every // fragments``.
    :param fragment_update_alpha: The weight of the local values when a fragment is applied, in ``[0, 1]``.
    :param quantize: ``None`` (full precision), ``"int8"`` or ``"float8"`` (``torch.float8_e4m3fn``):
        each member's pseudo-gradients (of each fragment) are sent quantized in blocks of 128
        elements with ``float32`` absmax scales; the member averaging a chunk dequantizes, sums in
        ``float32`` in rank order and quantizes the average once for the all-gather, so every member
        gets the same bits (:mod:`gang.ft.quantize`); every replica must pass the same.
    :raises TypeError: If an argument has the wrong type.
    :raises ValueError: If an argument has a bad value (``fragments`` above ``sync_every`` or the
        number of parameters, a delay not below ``sync_every // fragments``, ``alpha`` outside
        ``[0, 1]``, an outer optimizer over a parameter that is not ``module``'s, ``quantize`` not
        one of the above).
    """

    _kind = "DiLoCo"

    def __init__(
        self,
        rg: ReplicaGang,
        module: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        quantize: str | None = None,
    ) -> None:
        super().__init__(
            rg,
            module,
            inner_optimizer,
            sync_every=sync_every,
            fragments=fragments,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            quantize=quantize,
            optimizer_name="inner_optimizer",
        )
        if not isinstance(outer_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "`outer_optimizer` must be a `torch.optim.Optimizer`, but is of type "
                f"`{type(outer_optimizer).__name__}` instead."
            )
        if outer_optimizer is inner_optimizer:
            raise ValueError("`outer_optimizer` must not be `inner_optimizer`, but is the same object.")
        own = {id(p) for p in self._params}
        foreign = [p for group in outer_optimizer.param_groups for p in group["params"] if id(p) not in own]
        if foreign:
            raise ValueError(
                "`outer_optimizer` must be built over `module.parameters()`, but holds "
                f"{len(foreign)} parameter(s) that are not `module`'s instead."
            )
        self._outer = outer_optimizer
        self._global: list[Tensor] = [_local(p).clone() for p in self._params]

    def __enter__(self) -> DiLoCo:
        super().__enter__()
        return self

    def _reset(self) -> None:
        with torch.no_grad():
            for g, p in zip(self._global, self._params, strict=True):
                g.copy_(_local(p))

    def _contribute(self, i: int, local: Tensor, out: Tensor) -> None:
        torch.sub(self._global[i], local, out=out)

    def _land(self, averaged: dict[int, Tensor]) -> None:
        # The outer optimizer steps from the global values with the averages as gradients (views of
        # the exchange's buffer: no optimizer keeps a gradient); its result is the new global
        # value, and stays the local one when `alpha` is 0.
        saved = [p.grad for p in self._params]
        kept = {i: _local(self._params[i]).clone() for i in averaged} if self._alpha else {}
        try:
            with torch.no_grad():
                for i, p in enumerate(self._params):
                    p.grad = None
                    if i in averaged:
                        _local(p).copy_(self._global[i])
                        p.grad = _like(p, averaged[i])
            self._outer.step()
            with torch.no_grad():
                for i in averaged:
                    local = _local(self._params[i])
                    self._global[i].copy_(local)
                    if self._alpha:
                        torch.mul(kept[i], self._alpha, out=local).add_(self._global[i], alpha=1.0 - self._alpha)
        finally:
            for p, grad in zip(self._params, saved, strict=True):
                p.grad = grad

    def _state(self) -> dict[str, Any]:
        outer = self._outer.state_dict()
        state = {
            i: {k: _local(v) if isinstance(v, Tensor) else v for k, v in entry.items()}
            for i, entry in outer["state"].items()
        }
        return {**super()._state(), "global": self._global, "outer": {**outer, "state": state}}

    def _load(self, state: Mapping[str, Any]) -> None:
        super()._load(state)
        with torch.no_grad():
            for g, theirs in zip(self._global, state["global"], strict=True):
                if g is not theirs:
                    g.copy_(theirs)
        self._outer.load_state_dict(dict(state["outer"]))
        # A DTensor parameter's state travelled as its local shard: wrap it again.
        for p in self._params:
            entry = self._outer.state.get(p)
            if entry is None or not hasattr(p, "to_local"):
                continue
            shape = _local(p).shape
            for key, value in entry.items():
                if isinstance(value, Tensor) and not hasattr(value, "to_local") and value.shape == shape:
                    entry[key] = _like(p, value)


__all__ = ["DiLoCo", "LocalSGD", "cut_fragments", "prepare_offsets"]
