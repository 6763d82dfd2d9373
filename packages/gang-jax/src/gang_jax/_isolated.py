"""An isolated JAX runtime: JAX runs in a child process, so a dead peer cannot take this process down.

JAX's coordination service ends every process of a job when one of them dies (``SIGABRT``), and
a collective that talks to a dead peer may fail or wait. With ``JaxGang.create_default(...,
isolated=True)`` this process starts one child (:func:`gang_jax._server.child_main`) that
initialises ``jax.distributed`` and holds a :class:`~gang_jax._engine.LocalEngine` per gang; this
process keeps only an :class:`IsolatedEngine` per gang, the proxy of the child's engine. This
module is the parent's side and the wire format (:func:`layout`, :func:`view`) both sides share.

A collective copies the input tensor into a shared-memory segment, sends a short request over a
socket, waits for the child's answer at most the gang's timeout, and copies the result back.
When the child dies (JAX aborted it, or it was killed) or does not answer in time, the pending
call and every later call raise :class:`RuntimeError` (which the gang reports as a
:class:`~gang.GangError`), and this process goes on. The child dies with this process (Linux
parent-death signal, and a watcher thread elsewhere), so no child outlives its parent.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gang_jax._engine import Engine, Op
from gang_jax._rendezvous import Rendezvous

_ALIGN = 64
_MIN_SEGMENT = 1 << 20
_START_GRACE_S = 120.0  # on top of the timeout: starting Python, importing torch and JAX in the child
ISOLATED_GRACE_S = 5.0
"""How long past the timeout the gang's lane waits for an isolated call before ending the child itself
(the parent's own wait for the child's answer, bounded by the timeout, normally ends it first)."""
_CHILD_COMMAND = "import sys; from gang_jax._server import child_main; child_main(int(sys.argv[1]), int(sys.argv[2]))"


class ChildGone(RuntimeError):
    """The child process is dead or stopped answering; nothing more can run on it."""


class RemoteFailure(RuntimeError):
    """A collective failed inside the child; the message is the child's error."""


def _package_paths() -> list[str]:
    import gang
    import gang_jax

    return [str(Path(m.__file__ or "").resolve().parent.parent) for m in (gang_jax, gang)]


class _Child:
    """The child process, the socket to it and the shared-memory segment both map."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()
        self.start_s = self.timeout_s + _START_GRACE_S
        self.gone: str | None = None
        self.next_id = 1
        self._segment: mmap.mmap | None = None
        self._bytes: Tensor = torch.empty(0, dtype=torch.uint8)
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        inherited = filter(None, env.get("PYTHONPATH", "").split(os.pathsep))
        env["PYTHONPATH"] = os.pathsep.join([*_package_paths(), *inherited])
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _CHILD_COMMAND, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                env=env,
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.pid = self.process.pid

    def request(self, message: tuple[Any, ...], wait_s: float | None = None) -> Any:
        """Send ``message``; return the child's answer, waiting at most ``wait_s`` (the timeout)."""
        if self.gone is not None:
            raise ChildGone(self.gone)
        try:
            self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            wait_s = self.timeout_s if wait_s is None else wait_s
            if not self.conn.poll(wait_s):
                self.stop(f"the JAX child process (pid {self.pid}) did not answer within {wait_s:g} s")
                raise ChildGone(self.gone)
            status, payload = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as ex:
            self.stop(self._death(ex))
            raise ChildGone(self.gone) from None
        if status == "error":
            raise RemoteFailure(payload)
        return payload

    def _death(self, ex: BaseException) -> str:
        try:
            code = self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return f"the connection to the JAX child process (pid {self.pid}) broke: {ex!r}"
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        hint = " (JAX's coordination service ends every process when one dies)" if code == -signal.SIGABRT else ""
        return f"the JAX child process (pid {self.pid}) died with {how}{hint}"

    def stop(self, reason: str) -> None:
        """Mark the child gone for ``reason`` and make sure it is dead and reaped."""
        if self.gone is None:
            self.gone = reason
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10.0)
        self.conn.close()

    def shutdown(self) -> None:
        """Ask the child to shut JAX down and exit; kill it if it does not within the timeout."""
        if self.gone is None:
            with contextlib.suppress(RuntimeError):  # stop() below reaps whatever state it is in
                self.request(("shutdown",))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=self.timeout_s)
        self.stop("the gang was closed")

    def staging(self, nbytes: int) -> Tensor:
        """The shared segment as bytes, at least ``nbytes`` long (a bigger one is mapped by both sides)."""
        if nbytes > self._bytes.numel():
            size = max(nbytes, 2 * self._bytes.numel(), _MIN_SEGMENT)
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="gang_jax_", dir=folder)
            try:
                os.ftruncate(fd, size)
                segment = mmap.mmap(fd, size)
                self.request(("map", path, size))
            finally:
                os.close(fd)
                os.unlink(path)  # both sides have it mapped: nothing is left behind whatever happens
            self._segment = segment
            self._bytes = torch.frombuffer(segment, dtype=torch.uint8)
        return self._bytes


def layout(tensors: list[Tensor]) -> tuple[list[tuple[int, str, tuple[int, ...]]], int]:
    """Offsets (aligned) of ``tensors`` in the segment, with their dtype names and shapes, and the total size."""
    specs, offset = [], 0
    for t in tensors:
        specs.append((offset, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return specs, offset


def view(segment: Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """The tensor of ``dtype`` and ``shape`` at ``offset`` in ``segment`` (a new empty tensor if it has no elements)."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    nbytes = numel * dtype.itemsize
    return segment[offset : offset + nbytes].view(dtype).view(shape)


class IsolatedEngine(Engine):
    """The collectives of one gang, run by the child process (see the module documentation).

    :param child: The child process shared by the root gang and its sub-gangs.
    :param gang_id: The child's name for this gang.
    :param info: ``(rank, size, members)`` of the gang.
    :param owns_child: Whether closing this engine ends the child (the root's engine).
    """

    def __init__(self, child: _Child, gang_id: int, info: tuple[int, int, tuple[int, ...]], owns_child: bool) -> None:
        self._child = child
        self._id = gang_id
        self.rank, self.size, self.members = info
        self._owns_child = owns_child
        self._closed = False

    @classmethod
    def start(cls, where: Rendezvous, timeout: timedelta) -> IsolatedEngine:
        """Start the child, initialise ``jax.distributed`` there, and return the root gang's engine.

        :raises RuntimeError: If the child fails to start or to join within the timeout.
        """
        child = _Child(timeout)
        try:
            root = child.request(
                # The children start at different times (importing torch and JAX), so their JAX runtime
                # gets the start-up grace on top of the timeout; this process still gives up on any
                # request that takes longer than the timeout, which is what bounds a collective.
                (
                    "init",
                    where.coordinator_address,
                    where.num_processes,
                    where.process_id,
                    child.timeout_s + _START_GRACE_S,
                ),
                child.timeout_s + _START_GRACE_S,
            )
        except BaseException:
            child.stop("the JAX runtime failed to start")
            raise
        return cls(child, 0, root, owns_child=True)

    def run(self, op: Op, outputs: Sequence[Tensor], inputs: Sequence[Tensor], args: tuple[Any, ...]) -> None:
        """Run ``op`` in the child on copies of the tensors in the segment; copy ``outputs`` back.

        A tensor that is both an input and an output (an in-place operation) has one copy.
        """
        tensors: list[Tensor] = []
        index: dict[int, int] = {}
        for t in (*outputs, *inputs):
            index.setdefault(id(t), len(tensors))
            if index[id(t)] == len(tensors):
                tensors.append(t)
        specs, total = layout(tensors)
        segment = self._child.staging(total)
        views = [view(segment, off, t.dtype, tuple(t.shape)) for (off, _, _), t in zip(specs, tensors, strict=True)]
        for t in inputs:
            views[index[id(t)]].copy_(t)
        roles = ([index[id(t)] for t in outputs], [index[id(t)] for t in inputs])
        failed = True
        try:
            self._child.request(("run", self._id, op.name, specs, roles, args))
            failed = False
        finally:
            if failed and self._child.gone is None:
                # A collective that failed in JAX leaves its runtime unusable: end the child now, so
                # every later call fails at once instead of waiting for the timeout.
                self._child.stop(f"an earlier collective failed in the JAX child process (pid {self._child.pid})")
        for t in outputs:
            t.copy_(views[index[id(t)]])

    def split(self, ranks: list[int]) -> IsolatedEngine:
        """The sub-gang of ``ranks``, created in the child."""
        new_id = self._child.next_id
        self._child.next_id += 1
        info = self._child.request(("split", self._id, ranks, new_id))
        return IsolatedEngine(self._child, new_id, info, owns_child=False)

    @property
    def num_compiled(self) -> int:
        """The compiled programs of this gang, counted in the child."""
        return int(self._child.request(("num_compiled", self._id)))

    @property
    def child_pid(self) -> int:
        """The process id of the child that runs JAX."""
        return self._child.pid

    def abort(self, reason: str) -> None:
        """End the child (shared by the root and its sub-gangs): an operation overran its timeout."""
        self._child.stop(reason)

    def close(self) -> None:
        """Close this gang in the child; the root's engine also ends the child."""
        if self._closed:
            return
        self._closed = True
        if self._owns_child:
            self._child.shutdown()
        elif self._child.gone is None:
            with contextlib.suppress(RuntimeError):
                self._child.request(("close", self._id))
