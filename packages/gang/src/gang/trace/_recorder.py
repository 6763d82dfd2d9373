"""The flight recorder and the hooks: what every gang operation goes through when tracing is on.

One :class:`GangTrace` per gang keeps the gang's name, members (global ranks), sequence numbers
and a bounded ring (a ``deque``) of its last operations. :meth:`GangTrace.run` is the one place a gang's
public methods call into when tracing is on (:data:`STATE`); it records the operation, calls the
user's hooks, runs the operation and records its end (for an ``async_op`` call, when the handle's
``wait()`` returns or raises). A :class:`~gang.GangError` raised there dumps every gang's ring of
this process to ``<dir>/gang_trace_rank_<global rank>`` in torch's flight-recorder format.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gang.errors import GangError
from gang.work import CompletedWork, Work

if TYPE_CHECKING:
    from gang.gang import Gang

_LOG = logging.getLogger("gang.trace")

FILE_PREFIX = "gang_trace_rank_"
"""Each rank's dump is ``<dir>/gang_trace_rank_<global rank>`` (torch's analyzer: ``-p gang_trace_rank_``)."""

FORMAT_VERSION = "2.10"
"""The version of torch's flight-recorder format the dumps follow."""

DEFAULT_BUFFER_SIZE = 2000
"""How many operations each gang keeps when ``GANG_TRACE_BUFFER_SIZE`` is not set."""

DEFAULT_FRAMES = 1
"""How many frames of the caller each record keeps when ``GANG_TRACE_FRAMES`` is not set."""

DUMP_SIGNAL = signal.SIGUSR1
"""The signal that makes a process dump its recorder (installed only where nothing else handles it)."""

# Indices into a record (a list, the cheapest mutable record to build on the hot path).
# _IN and _OUT hold the (shape, dtype) of each tensor (_META True): the ring keeps no tensor. Records
# made by `GangTrace.start` hold the tensors themselves until the operation ends (or a hook or a dump
# asks; _OUT None: in place, the inputs). _END is the end time (of a failed operation, or any with hooks).
_ID, _SEQ, _P2P, _OP, _IN, _OUT, _PEERS, _START, _END, _STATE, _ERROR, _FRAMES, _CONTEXT, _META = range(14)

_STARTED, _COMPLETED, _FAILED = "started", "completed", "failed"

_TORCH_NAMES = {
    "all_reduce": "all_reduce",
    "all_gather": "_all_gather_base",
    "all_gather_to_list": "all_gather",
    "reduce_scatter": "_reduce_scatter_base",
    "all_to_all": "all_to_all_single",
    "all_to_all_uneven": "all_to_all_single",
    "broadcast": "broadcast",
    "broadcast_objects": "broadcast",
    "barrier": "barrier",
}
"""Torch's name for each gang collective, as torch's analyzer knows them (traffic is ``send``/``recv``)."""

_TRAFFIC = frozenset({"send", "recv", "send_recv"})

_DTYPE_NAMES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}
"""torch's own names of dtypes in flight-recorder entries (``c10::ScalarType``)."""


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"`{name}` must be a non-negative integer, but is {text!r} instead.") from None
    if value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer, but is {text!r} instead.")
    return value


class _State:
    """What every gang of the process shares: whether tracing is on, the ring size, the hooks, the rank."""

    __slots__ = (
        "buffer_size",
        "claimed_rank",
        "directory",
        "frames",
        "general",
        "hooks",
        "lock",
        "on",
        "rank",
        "roots",
    )

    def __init__(self) -> None:
        self.buffer_size = _env_int("GANG_TRACE_BUFFER_SIZE", DEFAULT_BUFFER_SIZE)
        self.frames = _env_int("GANG_TRACE_FRAMES", DEFAULT_FRAMES)
        self.directory: str | None = None
        self.hooks: tuple[Hook, ...] = ()
        self.rank: int | None = None  # set by `set_rank`
        self.claimed_rank: int | None = None  # the first root gang's global rank
        self.roots: dict[str, int] = {}  # roots of each kind made so far, for their ids
        self.lock = threading.Lock()
        self.on = self.general = False
        self.update()

    def update(self) -> None:
        self.on = self.buffer_size > 0 or bool(self.hooks)
        self.general = bool(self.hooks) or self.frames != 1  # not `GangTrace.run`'s common case


STATE = _State()
"""The process's tracing state; a gang's public method checks ``STATE.on`` before calling :meth:`GangTrace.run`."""

_TRACES: weakref.WeakSet[GangTrace] = weakref.WeakSet()
_RECORD_IDS = itertools.count()


@dataclass(frozen=True)
class Hook:
    """What a user observes: :func:`gang.trace.add_hook` returns this handle; :meth:`remove` takes it off.

    :param started: Called with each operation's :class:`OpRecord` before the operation starts.
    :param ended: Called with the same record once the operation ended (its ``error`` set if it failed).
    """

    started: Callable[[OpRecord], object] | None
    ended: Callable[[OpRecord], object] | None

    def remove(self) -> None:
        """Stop calling this hook (idempotent)."""
        with STATE.lock:
            STATE.hooks = tuple(h for h in STATE.hooks if h is not self)
            STATE.update()


class OpRecord:
    """One operation of a gang, as hooks see it (a view of the recorder's entry; read it, do not keep it long).

    Attributes are read from the entry when asked, so a hook that reads nothing costs nothing.
    """

    __slots__ = ("_entry", "_trace")

    def __init__(self, trace: GangTrace, entry: list[Any]) -> None:
        self._trace = trace
        self._entry = entry

    @property
    def gang(self) -> Gang | None:
        """The gang (``None`` once it was garbage collected)."""
        return self._trace.gang()

    @property
    def gang_name(self) -> str:
        """The gang's role and position (``"tp of pp 1, dp 0"``, ``"replica gang at step 812"``)."""
        return self._trace.name

    @property
    def operation(self) -> str:
        """The gang method (``"all_reduce"``, ``"send_recv"``, ``"split"``, a replica gang's ``"step"``)."""
        return str(self._entry[_OP])

    @property
    def seq(self) -> int:
        """The gang's sequence number of this operation: its collectives count 1, 2, ... on every member alike
        (point-to-point operations have their own count, :attr:`p2p_seq`)."""
        return int(self._entry[_SEQ])

    @property
    def p2p_seq(self) -> int:
        """The gang's count of point-to-point operations up to this one."""
        return int(self._entry[_P2P])

    @property
    def shapes(self) -> list[list[int]]:
        """The shape of each input tensor, then of each output tensor."""
        return [list(s) for s, _ in (*self._entry[_IN], *self._entry[_OUT])]

    @property
    def dtypes(self) -> list[torch.dtype]:
        """The dtype of each input tensor, then of each output tensor."""
        return [d for _, d in (*self._entry[_IN], *self._entry[_OUT])]

    @property
    def bytes(self) -> int:
        """The bytes of the input tensors (what this rank contributes; a receive's output otherwise)."""
        metas = self._entry[_IN] or self._entry[_OUT]
        return sum(_numel(s) * d.itemsize for s, d in metas)

    @property
    def start_ns(self) -> int:
        """When the operation started (``time.time_ns()``)."""
        return int(self._entry[_START])

    @property
    def duration_s(self) -> float | None:
        """Seconds from start to end (``None`` while it runs)."""
        end = self._entry[_END]
        return None if end is None else (end - self._entry[_START]) / 1e9

    @property
    def error(self) -> str | None:
        """What the operation raised (or a replica gang recorded), as ``"Type: message"``, else ``None``.

        Only the text is kept: the exception's traceback would keep what its frames hold alive.
        """
        error = self._entry[_ERROR]
        return None if error is None else str(error)

    def __repr__(self) -> str:
        return f"OpRecord({self.operation} #{self.seq} of {self.gang_name!r}, shapes={self.shapes})"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class GangTrace:
    """A gang's name, members, sequence numbers and ring of its last operations."""

    __slots__ = (
        "__weakref__",
        "backend",
        "context",
        "gang",
        "members",
        "name",
        "p2p_seq",
        "ring",
        "seq",
        "splits",
        "uid",
    )

    def __init__(self, gang: Gang) -> None:
        self.gang = weakref.ref(gang)
        kind = type(gang).__name__
        with STATE.lock:
            k = STATE.roots.get(kind, 0)
            STATE.roots[kind] = k + 1
        self.uid = kind if k == 0 else f"{kind}#{k}"  # a root's; a sub-gang's is set by `adopt`
        self.name = "world" if gang.size > 1 else self.uid  # a root of several ranks
        self.members: tuple[int, ...] | None = None  # global ranks; None: as `gang._trace_members()` says
        self.backend = "nccl" if gang.device.type == "cuda" else "gloo"
        self.seq = 0
        self.p2p_seq = 0
        self.splits = 0
        self.context: str | None = None  # what the gang is inside (a replica gang's step)
        self.ring: deque[list[Any]] = deque(maxlen=STATE.buffer_size)
        _TRACES.add(self)
        if not _signal_installed:
            install_signal_handler()

    def adopt(self, parent: GangTrace, index: int, members: Sequence[int] | None) -> None:
        """Name this sub-gang after its parent and the parent's ``index``-th split (equal on every member)."""
        self.uid = f"{parent.uid}/{index}"
        self.name = f"split {index} of {parent.name}"
        if members is not None and parent.members is not None:
            self.members = tuple(parent.members[r] for r in members)

    def rename(self, name: str, uid: str | None = None, members: Sequence[int] | None = None) -> None:
        """Give the gang a role name (the factories), or a new identity (a replica gang's new group: seq restarts)."""
        self.name = name
        if uid is not None:
            self.uid, self.seq, self.p2p_seq = uid, 0, 0
        if members is not None:
            self.members = tuple(members)

    # -- the hot path ------------------------------------------------------------------------------

    def run(
        self,
        operation: str,
        async_op: bool,
        inputs: Sequence[Tensor],
        outputs: Sequence[Tensor] | None,
        impl: Callable[..., Work | None],
        args: tuple[Any, ...],
        peers: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> Work | None:
        """Record ``operation``, call ``impl(*args)`` (a gang's protected method) and record its end.

        ``outputs`` ``None``: the inputs are updated in place (``all_reduce``, ``broadcast``).

        Returns what the public method returns: ``None``, or with ``async_op`` a :class:`Work` that
        records the end when its ``wait()`` returns or raises.

        The common case (a blocking call, no hook, one caller frame) does the least it can: it
        appends one entry, shapes and dtypes and the caller's code and instruction offset
        included, and marks it completed afterwards; the end time is taken only for hooks and
        failures, and everything else (lines, names, lists) waits for a dump.
        """
        fast = not (async_op or STATE.general)
        if fast:
            if peers is None:
                self.seq += 1
            else:
                self.p2p_seq += 1
            metas: tuple[tuple[Any, torch.dtype], ...]
            outs: tuple[tuple[Any, torch.dtype], ...]
            if outputs is None and len(inputs) == 1:
                t = inputs[0]
                metas = outs = ((t.shape, t.dtype),)
            else:
                metas = _metas(inputs)
                outs = metas if outputs is None else _metas(outputs)
            f = _getframe(2)  # the caller of the gang's method; its line is found at dump time
            # One entry, in the order of the _ID, _SEQ, ... indices.
            entry = [
                next(_RECORD_IDS),
                self.seq,
                self.p2p_seq,
                operation,
                metas,
                outs,
                peers,
                _now(),
                None,
                _STARTED,
                None,
                (f.f_code, f.f_lasti),
                self.context,
                True,
            ]
            self.ring.append(entry)
        else:
            entry = self.start(operation, inputs, outputs, peers, 3)
        try:
            work = impl(*args)
            if work is not None and not async_op:
                work.wait()
        except BaseException as ex:
            self.end(entry, ex)
            raise
        if fast:
            if entry[9] is _STARTED:  # _STATE (a literal index: a global's lookup counts here); a replica
                entry[9] = _COMPLETED  # gang may have marked it failed meanwhile (`failed`)
            return None
        if work is not None and async_op:
            return _TracedWork(work, self, entry)
        self.end(entry, None)
        return CompletedWork(operation) if async_op else None

    def start(
        self,
        operation: str,
        inputs: Sequence[Tensor] = (),
        outputs: Sequence[Tensor] | None = (),
        peers: tuple[Sequence[int], Sequence[int]] | None = None,
        caller: int = 2,
    ) -> list[Any]:
        """Record the start of ``operation`` (and call the hooks' ``started``); return its entry.

        ``outputs`` ``None``: the inputs, updated in place. ``caller``: how many frames up the caller is.
        As little as possible happens here, before the operation is posted: the tensors are kept
        as they are until the operation ends (:meth:`end` keeps their shapes and dtypes instead).
        """
        if peers is not None:
            self.p2p_seq += 1
        elif operation != "step":
            self.seq += 1
        frames: list[Any] = []
        f: Any = sys._getframe(caller) if STATE.frames else None
        while f is not None and len(frames) < 2 * STATE.frames:
            frames += (f.f_code, f.f_lasti)
            f = f.f_back
        entry = [
            next(_RECORD_IDS),
            self.seq,
            self.p2p_seq,
            operation,
            inputs,
            outputs,
            peers,
            _now(),
            None,
            _STARTED,
            None,
            tuple(frames),
            self.context,
            False,
        ]
        self.ring.append(entry)
        if STATE.hooks:
            _settle(entry)
            try:
                _call_hooks(self, entry, "started")
            except BaseException as ex:  # the operation does not run: record why
                entry[_END], entry[_STATE], entry[_ERROR] = _now(), _FAILED, _text(ex)
                raise
        return entry

    def end(self, entry: list[Any], error: BaseException | None) -> None:
        """Record the end of an operation (``error``: what it raised); a :class:`GangError` dumps the recorder."""
        entry[_END] = _now()
        if not entry[_META]:
            _settle(entry)
        if error is None:
            if entry[_STATE] == _STARTED:  # a replica gang may have marked it failed meanwhile (`failed`)
                entry[_STATE] = _COMPLETED
        else:
            entry[_STATE], entry[_ERROR] = _FAILED, _text(error)
            if isinstance(error, GangError):
                dump_on_error(error)
        if STATE.hooks:
            _call_hooks(self, entry, "ended")

    def failed(self, error: BaseException) -> None:
        """A gang that records its failures instead of raising them (a replica gang): mark its last operation
        still running as failed (or the last one) and dump the recorder."""
        entries = self.entries()
        running = [e for e in entries if e[_STATE] == _STARTED]
        if running or entries:
            entry = (running or entries)[-1]
            entry[_END] = entry[_END] or time.time_ns()
            entry[_STATE], entry[_ERROR] = _FAILED, _text(error)
        dump_on_error(error)

    def entries(self) -> list[list[Any]]:
        """The ring's entries, oldest first."""
        return list(self.ring)

    def resize(self, size: int) -> None:
        self.ring = deque(self.ring, maxlen=size)


_now = time.time_ns
_getframe = sys._getframe


def _metas(tensors: Sequence[Tensor]) -> tuple[tuple[Any, torch.dtype], ...]:
    """The (shape, dtype) of each tensor: what the ring keeps of them."""
    return tuple([(t.shape, t.dtype) for t in tensors])


def _text(error: BaseException) -> str:
    """What the ring keeps of an error: its text (the exception's traceback would keep its frames, and what
    they hold, such as a process group, alive)."""
    return f"{type(error).__name__}: {error}"


def _settle(entry: list[Any]) -> None:
    """Replace an entry's tensors by their shapes and dtypes (the ring must not keep tensors alive)."""
    if entry[_META]:
        return
    inputs, outputs = entry[_IN], entry[_OUT]
    metas = _metas(inputs)
    entry[_IN] = metas
    entry[_OUT] = metas if outputs is None else _metas(outputs)
    entry[_META] = True


def _call_hooks(trace: GangTrace, entry: list[Any], which: str) -> None:
    """Call every hook's ``which``; one that raises is logged and its exception propagates (after the others ran)."""
    record = OpRecord(trace, entry)
    failure: BaseException | None = None
    for hook in STATE.hooks:
        fn = hook.started if which == "started" else hook.ended
        if fn is None:
            continue
        try:
            fn(record)
        except Exception as ex:
            _LOG.error("a gang.trace hook raised in `%s` of %r", which, record, exc_info=True)
            failure = failure or ex
    if failure is not None:
        raise failure


class _TracedWork(Work):
    """The handle of a traced ``async_op`` call: the operation ends when ``wait()`` returns or raises."""

    __slots__ = ("_entry", "_inner", "_trace")

    def __init__(self, inner: Work, trace: GangTrace, entry: list[Any]) -> None:
        super().__init__(inner.operation)
        self._inner, self._trace, self._entry = inner, trace, entry

    def _wait(self, timeout: float | None) -> bool:
        inner = self._inner
        try:
            inner.wait(timeout)
        except GangError as ex:
            if not inner._done:  # only the `wait` timeout passed: the operation is still in flight
                return False
            self._trace.end(self._entry, ex)
            raise
        except BaseException as ex:
            self._trace.end(self._entry, ex)
            raise
        self._trace.end(self._entry, None)
        return True

    def _poll(self) -> bool:
        return self._inner.is_completed()


# -- the process's rank, the directory, dumping ------------------------------------------------------


def claim_rank(rank: int) -> None:
    """A root gang tells the recorder this process's global rank (the first claim counts)."""
    if STATE.claimed_rank is None:
        STATE.claimed_rank = rank


def process_rank() -> int:
    """This process's global rank in dump file names: ``set_rank``, else ``GANG_TRACE_RANK``, else the first
    root gang's global rank, else ``RANK``, else 0."""
    if STATE.rank is not None:
        return STATE.rank
    text = os.environ.get("GANG_TRACE_RANK", "").strip()
    if text:
        return int(text)
    if STATE.claimed_rank is not None:
        return STATE.claimed_rank
    text = os.environ.get("RANK", "").strip()
    return int(text) if text.isdigit() else 0


def trace_directory() -> Path:
    """Where dumps go: ``set_trace_dir``, else ``GANG_TRACE_DIR``, else ``<temp dir>/gang_trace``."""
    chosen = STATE.directory or os.environ.get("GANG_TRACE_DIR", "").strip()
    return Path(chosen) if chosen else Path(tempfile.gettempdir()) / "gang_trace"


def _frames(frames: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Recorded frames (``code, offset of the instruction``, flat, innermost first) as torch's analyzer reads them."""
    return [
        {"name": code.co_name, "filename": code.co_filename, "line": _line(code, at)}
        for code, at in zip(frames[::2], frames[1::2], strict=True)
    ]


def _line(code: Any, offset: int) -> int:
    """The source line of the instruction at ``offset`` of ``code``."""
    for start, end, line in code.co_lines():
        if start <= offset < end and line is not None:
            return int(line)
    return int(code.co_firstlineno)


def _members(trace: GangTrace) -> list[int]:
    if trace.members is not None:
        return list(trace.members)
    gang = trace.gang()
    known = None if gang is None else gang._trace_members()
    if known is not None:
        return list(known)
    me = process_rank()
    if gang is None or gang.size == 1:
        return [me]
    return [me - gang.rank + i for i in range(gang.size)]


def snapshot(reason: str) -> dict[str, Any]:
    """This process's recorder in torch's flight-recorder format (``version`` 2.10), plus gang's own ``"gang"`` key."""
    me = process_rank()
    entries: list[tuple[int, dict[str, Any]]] = []
    pg_config: dict[str, dict[str, str]] = {}
    pg_status: dict[str, dict[str, int]] = {}
    gangs: dict[str, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []
    for pg_id, trace in enumerate(sorted(_TRACES, key=lambda t: t.uid)):
        members = _members(trace)
        gang = trace.gang()
        ranks = str(members)
        pg_config[trace.uid] = {"name": trace.uid, "desc": trace.name, "ranks": ranks}
        gangs[trace.uid] = {
            "name": trace.name,
            "kind": "?" if gang is None else type(gang).__name__,
            "ranks": members,
            "rank": None if gang is None else gang.rank,
            "seq": trace.seq,
            "closed": gang is None or gang.closed,
        }
        last = {"last_enqueued_collective": -1, "last_started_collective": -1, "last_completed_collective": -1}
        transfers = itertools.count(1)
        for e in trace.entries():
            _settle(e)
            records.append(_own_record(trace, e))
            if e[_OP] == "split" or e[_OP] == "step":
                continue
            if e[_PEERS] is None:
                last["last_enqueued_collective"] = last["last_started_collective"] = e[_SEQ]
                if e[_STATE] == _COMPLETED:
                    last["last_completed_collective"] = e[_SEQ]
            for torch_entry in _torch_entries(trace, pg_id, e, transfers):
                entries.append((e[_ID], torch_entry))
        pg_status[trace.uid] = last
    entries.sort(key=lambda pair: pair[0])
    torch_entries = [e for _, e in entries]
    for i, torch_entry in enumerate(torch_entries):
        torch_entry["record_id"] = i  # torch's analyzer aligns ranks by record id: count this dump's entries only
    records.sort(key=lambda r: r["record_id"])
    return {
        "version": FORMAT_VERSION,
        "comm_lib_version": "",
        "pg_config": pg_config,
        "pg_status": pg_status,
        "entries": torch_entries,
        "gang": {
            "rank": me,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time_ns": time.time_ns(),
            "reason": reason,
            "gangs": gangs,
            "records": records,
        },
    }


def _shapes(metas: Sequence[tuple[Sequence[int], torch.dtype]]) -> tuple[list[list[int]], list[str]]:
    return [list(s) for s, _ in metas], [_DTYPE_NAMES.get(d, str(d)) for _, d in metas]


def _own_record(trace: GangTrace, e: list[Any]) -> dict[str, Any]:
    """A record as ``python -m gang.trace`` reads it (every operation, steps and splits included)."""
    in_sizes, in_dtypes = _shapes(e[_IN])
    out_sizes, out_dtypes = _shapes(e[_OUT])
    error = e[_ERROR]
    return {
        "record_id": e[_ID],
        "gang": trace.uid,
        "gang_name": trace.name,
        "operation": e[_OP],
        "seq": e[_SEQ],
        "p2p_seq": e[_P2P],
        "input_sizes": in_sizes,
        "input_dtypes": in_dtypes,
        "output_sizes": out_sizes,
        "output_dtypes": out_dtypes,
        "peers": None if e[_PEERS] is None else [list(e[_PEERS][0]), list(e[_PEERS][1])],
        "state": e[_STATE],
        "error": error,
        "time_created_ns": e[_START],
        "time_ended_ns": e[_END],
        "frames": _frames(e[_FRAMES]),
        "context": e[_CONTEXT],
    }


def _torch_entries(trace: GangTrace, pg_id: int, e: list[Any], transfers: Iterator[int]) -> list[dict[str, Any]]:
    """The entries torch's recorder would have made for one gang operation.

    A point-to-point call gives one entry per transfer, each with its own ``p2p_seq_id`` (from
    ``transfers``): torch's analyzer pairs them in order, so between two ranks the lower one lists
    its sends to the other first and the higher one its receives first (a ``send_recv`` runs its
    transfers in any order, so each side's order is as true as another).
    """
    op = e[_OP]
    if op == "split" or op == "step":
        return []
    state = {_STARTED: "started", _COMPLETED: "completed", _FAILED: "started"}[e[_STATE]]
    gang = trace.gang()
    me = 0 if gang is None else gang.rank
    base = {
        "pg_id": pg_id,
        "process_group": (trace.uid, trace.name),
        "collective_seq_id": e[_SEQ],
        "p2p_seq_id": e[_P2P],
        "time_created_ns": e[_START],
        "time_discovered_started_ns": e[_START],
        "time_discovered_completed_ns": e[_END] if e[_STATE] == _COMPLETED else None,
        "state": state,
        "retired": e[_STATE] != _STARTED,
        "timeout_ms": 0,
        "frames": _frames(e[_FRAMES]),
        "thread_id": "",
        "thread_name": "python",
    }
    if e[_ERROR] is not None:
        base["error"] = e[_ERROR]
    if e[_PEERS] is None:
        in_sizes, in_dtypes = _shapes(e[_IN])
        out_sizes, out_dtypes = _shapes(e[_OUT])
        return [
            {
                **base,
                "profiling_name": f"{trace.backend}:{_TORCH_NAMES.get(op, op)}",
                "is_p2p": False,
                "input_sizes": in_sizes,
                "input_dtypes": in_dtypes,
                "output_sizes": out_sizes,
                "output_dtypes": out_dtypes,
            }
        ]
    moves = [
        (peer, (kind == "send") != (me < peer), i, kind, meta)
        for metas, peers, kind in ((e[_IN], e[_PEERS][0], "send"), (e[_OUT], e[_PEERS][1], "recv"))
        for i, (meta, peer) in enumerate(zip(metas, peers, strict=False))
    ]
    result = []
    for peer, _, _, kind, meta in sorted(moves, key=lambda m: m[:3]):
        sizes, dtypes = _shapes([meta])
        name = f"{me}->{peer}" if kind == "send" else f"{me}<-{peer}"
        result.append(
            {
                **base,
                "profiling_name": f"{trace.backend}:{kind} {name}",
                "is_p2p": True,
                "p2p_seq_id": next(transfers),
                "input_sizes": sizes,
                "input_dtypes": dtypes,
                "output_sizes": sizes,
                "output_dtypes": dtypes,
            }
        )
    return result


_DUMP_LOCK = threading.Lock()


def dump(reason: str = "on request", directory: str | os.PathLike[str] | None = None) -> Path:
    """Write this process's recorder to ``<directory>/gang_trace_rank_<global rank>`` and return the path.

    The file is replaced atomically, so a reader never sees half a dump.
    """
    where = Path(directory) if directory is not None else trace_directory()
    data = pickle.dumps(snapshot(reason))
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{FILE_PREFIX}{process_rank()}"
    with _DUMP_LOCK:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


_dumped_to: set[Path] = set()


def dump_on_error(error: BaseException) -> None:
    """Dump on a :class:`GangError` (when the recorder is on); never raises (the error in flight matters more)."""
    if STATE.buffer_size == 0:
        return
    try:
        path = dump(f"{type(error).__name__}: {error}")
    except Exception:
        _LOG.warning("gang.trace could not write its dump", exc_info=True)
        return
    if path not in _dumped_to:
        _dumped_to.add(path)
        _LOG.warning(
            "gang.trace: a GangError dumped the flight recorder to %s (read it with python -m gang.trace)", path
        )


_signal_installed = False


def install_signal_handler() -> None:
    """Dump on :data:`DUMP_SIGNAL` (``SIGUSR1``) if nothing else handles it; only from the main thread."""
    global _signal_installed
    if threading.current_thread() is not threading.main_thread():
        return
    _signal_installed = True
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(DUMP_SIGNAL) in (signal.SIG_DFL, None):
            signal.signal(DUMP_SIGNAL, _on_signal)


def _on_signal(signum: int, frame: object) -> None:
    try:
        path = dump(f"signal {signal.Signals(signum).name}")
        _LOG.warning("gang.trace: dumped the flight recorder to %s", path)
    except Exception:
        _LOG.warning("gang.trace could not write its dump", exc_info=True)
