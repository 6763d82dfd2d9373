"""Run functions on real local processes: what users need to test their own distributed code.

:func:`spawn` runs ``fn(gang, *args)`` once on ``world_size`` fresh processes, each holding a real
gloo :class:`~gang.ProcessGroupGang` on the CPU. :class:`World` keeps such processes alive so that
many functions can run on them one after another (much faster in a test suite). :func:`launch`
runs ``fn(*args)`` with torchrun's environment but no gang, for code that creates its own.

The processes are forked from a fork server that has imported torch and gang once, so that each
starts in a fraction of a second instead of importing torch again (where the platform has no fork
server, they are spawned). ``fn`` and its arguments travel by pickle, so ``fn`` must be a
module-level function of an importable module. A failure on any rank is re-raised in the caller
as the same exception type, with the rank and the remote traceback attached; every other rank is
then stopped, and no process outlives the call (or the :class:`World`).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from gang._torch_groups import serve_store
from gang.address import LOOPBACK, free_port, is_loopback, local_env, non_loopback_sockets
from gang.errors import InvalidOperationError
from gang.extend import GangView, check_device, check_int, check_rank
from gang.process_group_gang import ProcessGroupGang
from gang.testing_hosts import Flap, Host, HostProcess, TestHosts
from gang.testing_hosts import skip_reason as test_hosts_skip_reason

__all__ = [
    "LOOPBACK",
    "DEFAULT_GANG_TIMEOUT",
    "DEFAULT_RUN_TIMEOUT",
    "Flap",
    "Host",
    "HostProcess",
    "RemoteTraceback",
    "TestHosts",
    "World",
    "WorkerDiedError",
    "close_shared_worlds",
    "dry_run",
    "free_port",
    "is_loopback",
    "launch",
    "local_env",
    "member_ranks",
    "non_loopback_sockets",
    "shared_world",
    "spawn",
    "test_hosts_skip_reason",
]

DEFAULT_RUN_TIMEOUT = 120.0
"""Seconds a single :meth:`World.run` (or :func:`spawn`, :func:`launch`) may take before every rank is stopped."""

DEFAULT_GANG_TIMEOUT = 60.0
"""Seconds each collective of a test gang (:class:`World`, :func:`spawn`, :func:`shared_world`) waits for its peers."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised on another process; chained as ``__cause__``."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"\n\nTraceback on rank {rank}:\n{text}")
        self.rank = rank
        self.text = text

    def __reduce__(self) -> tuple[type[RemoteTraceback], tuple[int, str]]:
        return (RemoteTraceback, (self.rank, self.text))


class WorkerDiedError(RuntimeError):
    """A worker process exited (or was killed) while a function was running on it.

    :attr:`results` holds what the other ranks returned before the world was stopped, by rank,
    so a test can check how the survivors saw the death.
    """

    def __init__(self, message: str, results: dict[int, Any]) -> None:
        super().__init__(message)
        self.results = results


def _watch_caller() -> None:
    """End this process as soon as the process that started it (the caller) is gone.

    The caller holds one end of a pipe whose other end is ``multiprocessing``'s parent sentinel
    here: it becomes ready when the caller exits or is killed. (With a fork server the caller is
    not this process's parent, so the parent's pid would not tell.)
    """
    caller = mp.parent_process()
    if caller is not None:
        wait([caller.sentinel])
        os._exit(1)


def _worker_main(conn: Connection, env: dict[str, str], init_gang: bool, gang_timeout: float) -> None:
    # The whole environment, as the caller had it when the world started (the fork server's is older).
    os.environ.clear()
    os.environ.update(env)
    threading.Thread(target=_watch_caller, daemon=True).start()
    torch.set_num_threads(1)
    gang = None
    try:
        if init_gang:
            from gang.process_group_gang import ProcessGroupGang

            gang = ProcessGroupGang.create_default_process_group(
                torch.device("cpu"), timeout=timedelta(seconds=gang_timeout)
            )
            _check_loopback_only()
        conn.send_bytes(pickle.dumps(("ok", None)))
    except BaseException as ex:
        conn.send_bytes(_error_reply(ex))
        return
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not message:
            break
        try:
            fn, args = pickle.loads(message)
            result = fn(gang, *args) if init_gang else fn(*args)
            reply = pickle.dumps(("ok", result))
        except BaseException as ex:
            reply = _error_reply(ex)
        conn.send_bytes(reply)
    if gang is not None:
        gang.close()
    elif dist.is_initialized():
        dist.destroy_process_group()


def _check_loopback_only() -> None:
    """Raise if this process's sockets (its gang's: the store, gloo's pairs) reach beyond loopback."""
    try:
        outside = non_loopback_sockets(os.getpid())
    except OSError:  # no /proc to read (not Linux): nothing to check
        return
    if outside:
        raise RuntimeError(f"A local world must talk over loopback only, but {'; '.join(outside)}.")


def _add_note(ex: BaseException, note: str) -> None:
    """``ex.add_note(note)`` on Python 3.11+; on 3.10 the note is kept in ``__notes__`` (not printed,
    but the chained :class:`RemoteTraceback` names the rank too)."""
    add_note = getattr(ex, "add_note", None)
    if add_note is not None:
        add_note(note)
    else:
        ex.__notes__ = [*getattr(ex, "__notes__", []), note]  # type: ignore[attr-defined]


def _error_reply(ex: BaseException) -> bytes:
    text = "".join(traceback.format_exception(ex))
    try:
        blob = pickle.dumps(ex)
        pickle.loads(blob)
    except Exception:
        blob = b""
    return pickle.dumps(("error", (type(ex).__name__, str(ex), blob, text)))


_WORLDS: weakref.WeakSet[World] = weakref.WeakSet()


def _context() -> Any:
    """The start method of the worker processes: a fork server where the platform has one, else spawn.

    The fork server imports torch and gang once (:mod:`gang._testing_preload`) and forks every
    worker from that single-threaded process, so that a worker does not import them again. It is
    ``multiprocessing``'s one fork server of this process, whose list of preloaded modules this
    sets.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["gang._testing_preload"])
    return ctx


@atexit.register
def _stop_all_worlds() -> None:
    for world in list(_WORLDS):
        world.close()


class World:
    """``world_size`` local processes that stay alive and run functions on request.

    Each process holds a gloo :class:`~gang.ProcessGroupGang` over all of them (or no gang with
    ``init_gang=False``), created once. After a failure or a timeout on any rank the world stops
    every process and becomes unusable (:attr:`alive` is ``False``): create a new one.

    :param world_size: The number of processes, at least 1.
    :param gang_timeout: The timeout of the gangs' collectives, in seconds.
    :param init_gang: Whether each process creates the default gang.
    :param start_timeout: Seconds the processes may take to start.
    :param env: Extra environment variables for the processes, on top of the caller's environment
        as it is when the world starts. They are set as a process starts, after torch and gang are
        imported (a variable that torch reads at import is not seen).
    :raises ValueError: If ``world_size``, ``gang_timeout`` or ``start_timeout`` is not positive, or
        ``env`` sets ``MASTER_ADDR`` to anything but a loopback address (a world's store listens on
        ``127.0.0.1`` only, and its processes talk over loopback only).
    """

    def __init__(
        self,
        world_size: int,
        *,
        gang_timeout: float = DEFAULT_GANG_TIMEOUT,
        init_gang: bool = True,
        start_timeout: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> None:
        world_size = check_int("world_size", world_size, minimum=1)
        for name, seconds in (("gang_timeout", gang_timeout), ("start_timeout", start_timeout)):
            if seconds <= 0:
                raise ValueError(f"`{name}` must be positive, but is {seconds} instead.")
        master = (env or {}).get("MASTER_ADDR", LOOPBACK)
        if not is_loopback(master):  # a local world talks over loopback only
            raise ValueError(f"`env['MASTER_ADDR']` must be a loopback address, but is {master!r} instead.")
        self.world_size = world_size
        self.init_gang = init_gang
        self._gang_timeout = gang_timeout
        self._store = serve_store(LOOPBACK, world_size=world_size)
        ctx = _context()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        base_env = {
            **os.environ,
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(self._store.port),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": "1",
            **local_env(),  # gloo on the loopback interface
            **(env or {}),
        }
        _WORLDS.add(self)
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            proc = ctx.Process(
                target=_worker_main,
                args=(child_conn, proc_env, init_gang, gang_timeout),
                daemon=True,
                name=f"gang-rank-{rank}",
            )
            proc.start()
            child_conn.close()
            self._conns.append(parent_conn)
            self._procs.append(proc)
        self._alive = True
        self._collect("starting the world", start_timeout)

    @property
    def alive(self) -> bool:
        """Whether the processes are running and can take another function."""
        return self._alive

    @property
    def store_port(self) -> int:
        """The port of the rendezvous store this world's processes use."""
        return int(self._store.port)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_RUN_TIMEOUT) -> list[Any]:
        """Run ``fn(gang, *args)`` (``fn(*args)`` without a gang) on every rank; return results in rank order.

        :raises ValueError: If ``fn`` or ``args`` cannot be pickled.
        :raises RuntimeError: If the world is no longer alive.
        :raises TimeoutError: If a rank does not finish within ``timeout`` seconds.
        :raises WorkerDiedError: If a worker process dies.
        :raises Exception: The exception of the failing rank, with the remote traceback as cause.
        """
        if not self._alive:
            raise RuntimeError("This `World` was stopped after an earlier failure; create a new one.")
        try:
            message = pickle.dumps((fn, args))
        except Exception as ex:
            raise ValueError(
                f"`fn` and `args` must be picklable (a module-level function), but pickling failed: {ex}"
            ) from ex
        for conn in self._conns:
            conn.send_bytes(message)
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: list[tuple[int, tuple[str, str, bytes, str]]] = []
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        died: list[int] = []
        while pending:
            remaining = deadline - time.monotonic()
            # A death is noticed by the survivors within their gang timeout: wait that long for them.
            grace = 1.0 if errors else self._gang_timeout + 5.0 if died else None
            if grace is not None and remaining > grace:
                # After the first failure, give the other ranks a moment to report theirs, then stop.
                deadline = time.monotonic() + grace
                remaining = grace
            if remaining <= 0:
                break
            for ready in wait(list(pending), timeout=remaining):
                assert isinstance(ready, Connection)
                rank = pending.pop(ready)
                try:
                    status, payload = pickle.loads(ready.recv_bytes())
                except (EOFError, OSError):
                    died.append(rank)
                    continue
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append((rank, payload))
        if errors:
            self.close(force=True)
            rank, (name, message, blob, text) = errors[0]
            ex: BaseException = RuntimeError(f"{name}: {message}")
            if blob:
                try:
                    ex = pickle.loads(blob)
                except Exception as unpickling:  # e.g. its class cannot be imported here
                    _add_note(ex, f"(the original `{name}` could not be unpickled here: {unpickling!r})")
            _add_note(ex, f"(raised on rank {rank} of {self.world_size} while running {what})")
            raise ex from RemoteTraceback(rank, text)
        if died:
            procs = list(self._procs)
            self.close(force=True)
            codes = {rank: procs[rank].exitcode for rank in died}
            raise WorkerDiedError(f"Rank(s) {sorted(died)} died while running {what} (exit codes {codes}).", results)
        if pending:
            stuck = sorted(pending.values())
            self.close(force=True)
            raise TimeoutError(
                f"Rank(s) {stuck} did not finish {what} within {timeout} seconds; all ranks were stopped."
            )
        return [results[rank] for rank in range(self.world_size)]

    def close(self, *, force: bool = False) -> None:
        """Stop every process (politely if idle, by force otherwise, or at once with ``force``). Idempotent."""
        if not getattr(self, "_alive", False) and not getattr(self, "_procs", None):
            return
        self._alive = False
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(b"")
        deadline = time.monotonic() + (0.0 if force else 2.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs = []
        self._conns = []
        _WORLDS.discard(self)

    def __enter__(self) -> World:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


_SHARED: dict[int, World] = {}


def shared_world(size: int) -> World:
    """Return this process's shared live :class:`World` of ``size`` processes, starting it on first use.

    A world that a failure stopped is replaced by a new one. Test suites (and the pytest plugin's
    ``@pytest.mark.gang`` tests) share these worlds, so that each size starts only once per session.
    Stop them with :func:`close_shared_worlds` (they are also stopped when the process exits).
    """
    world = _SHARED.get(size)
    if world is None or not world.alive:
        world = World(size, gang_timeout=DEFAULT_GANG_TIMEOUT)
        _SHARED[size] = world
    return world


def close_shared_worlds() -> None:
    """Stop every world of :func:`shared_world` and the fork server they were forked from. Idempotent.

    The fork server would otherwise outlive this process briefly (it exits on its own once this
    process is gone), which a check for stray processes right after pytest would see. A later
    world starts a new one.
    """
    for world in _SHARED.values():
        world.close()
    _SHARED.clear()
    _stop_fork_server()


def _stop_fork_server() -> None:
    """Stop ``multiprocessing``'s fork server of this process, if it runs, and wait for it to exit."""
    from multiprocessing import forkserver

    # CPython's own way to stop it (its tests use it); where it is missing the server exits by itself.
    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if callable(stop):
        stop()


def member_ranks(gang: GangView, rank: int | None = None) -> list[int]:
    """Who is really in ``gang``, learned by an all-gather through it rather than read from its metadata.

    Every member calls this (it is a collective of ``gang``) and contributes ``rank``, by default its
    rank in torch's default process group; the result lists them in gang rank order.

    .. code-block:: python

        gangs = create_parallel_gangs(root, tp_size=2)
        print(member_ranks(gangs.tp))  # e.g. [4, 5] on global ranks 4 and 5

    :param gang: The gang.
    :param rank: What this process contributes (any integer, e.g. its node number).
    """
    mine = dist.get_rank() if rank is None else rank
    out = torch.empty((gang.size, 1), dtype=torch.int64, device=gang.device)
    gang.all_gather(out, torch.tensor([mine], dtype=torch.int64, device=gang.device))
    return [int(x) for x in out.view(-1).tolist()]


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_RUN_TIMEOUT,
    gang_timeout: float = DEFAULT_GANG_TIMEOUT,
) -> list[Any]:
    """Run ``fn(gang, *args)`` on ``world_size`` new local processes and return the results in rank order.

    Each process gets a real gloo :class:`~gang.ProcessGroupGang` on the CPU (a fresh rendezvous
    port every time). A failure on any rank is re-raised here with the rank and the remote
    traceback; every other rank is stopped, and no process outlives the call.

    :param fn: A module-level function taking the gang first.
    :param world_size: The number of processes.
    :param timeout: Seconds the whole run may take (start-up excluded).
    :param gang_timeout: The collective timeout of the gangs, in seconds.
    """
    with World(world_size, gang_timeout=gang_timeout) as world:
        return world.run(fn, *args, timeout=timeout)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_RUN_TIMEOUT) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new processes with torchrun's environment but no gang.

    For code that creates its own gang, e.g. with :func:`gang.create_default_gang`. The
    rendezvous store is hosted by the caller, as torchrun's agent does.
    """
    with World(world_size, init_gang=False) as world:
        return world.run(fn, *args, timeout=timeout)


@contextlib.contextmanager
def dry_run(world_size: int, *, rank: int = 0, device: torch.device | str = "cpu") -> Iterator[ProcessGroupGang]:
    """Pretend, in this one process, to be rank ``rank`` of ``world_size`` processes.

    Yields a root :class:`~gang.ProcessGroupGang` on torch's ``fake`` backend: the factories,
    :meth:`Gangs.flatten <gang.Gangs.flatten>` and the mesh bridge give rank ``rank`` exactly the
    gangs and members it would get on a real cluster of that size, so a layout for 100,000 GPUs is
    checked on a laptop. Collectives complete without computing anything; what needs values from
    peers (:meth:`~gang.Gang.broadcast_objects`, :func:`~gang.all_gather_objects` and the other
    helpers, debug mode) raises :class:`~gang.NotSupportedError` naming the dry run. On exit
    every group is destroyed.

    .. code-block:: python

        with dry_run(131_072, rank=70_000) as root:
            gangs = create_fsdp_gangs(create_parallel_gangs(root, tp_size=8, cp_size=2), 64)
            print(gangs.sdp.size, gangs.flatten("sdp", "cp").size)

    :param world_size: The number of processes to pretend.
    :param rank: This process's rank among them.
    :param device: The gangs' device (nothing runs on it).
    :raises ValueError: If ``world_size`` is not positive or ``rank`` is outside ``[0, world_size)``.
    :raises TypeError: If an argument has the wrong type.
    :raises InvalidOperationError: If torch's default process group already exists.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    rank = check_rank("rank", rank, world_size)
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"`device` must be a `torch.device` or a `str`, but is {device!r} instead.")
    if isinstance(device, str):
        device = torch.device(device)
    device = check_device("device", device)
    if dist.is_initialized():
        raise InvalidOperationError("`dry_run` needs torch's default process group to be absent, but it exists.")
    with ProcessGroupGang.create_dry_run(world_size, rank, device) as root:
        yield root
