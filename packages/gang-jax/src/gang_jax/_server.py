"""The child process of an isolated JAX runtime: it runs the engines that the parent's proxies talk to.

The parent (:mod:`gang_jax._isolated`) starts ``child_main`` with one end of a socket pair. The
child initialises ``jax.distributed`` and holds a :class:`~gang_jax._engine.LocalEngine` per gang
of the parent (the parent's :class:`~gang.Gang` has checked every argument already, so none is
checked again here), runs each request on views of the shared-memory segment, and answers
``("ok", result)`` or ``("error", "<type>: <message>")``. It ends with the parent.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import signal
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import jax
import torch
from torch import Tensor

from gang_jax._engine import LocalEngine, Op, start_runtime, stop_runtime
from gang_jax._isolated import view
from gang_jax._rendezvous import Rendezvous


def _die_with_parent(parent: int) -> None:
    """End this process as soon as its parent is gone (SIGKILL from the kernel where possible)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


def _info(engine: LocalEngine) -> tuple[int, int, tuple[int, ...]]:
    return engine.rank, engine.size, engine.members


def child_main(fd: int, parent: int) -> None:
    """The child's loop: answer the parent's requests on the socket ``fd`` until told to stop."""
    _die_with_parent(parent)
    conn = Connection(fd)
    engines: dict[int, LocalEngine] = {}
    segments: list[Tensor] = []

    def reply(status: str, payload: Any) -> None:
        conn.send_bytes(pickle.dumps((status, payload), protocol=pickle.HIGHEST_PROTOCOL))

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone or closed the socket: nothing to shut down cleanly
        kind = message[0]
        try:
            if kind == "run":
                _, engine_id, name, specs, (outputs, inputs), args = message
                views = [view(segments[-1], off, getattr(torch, dt), shape) for off, dt, shape in specs]
                engines[engine_id].run(Op[name], [views[i] for i in outputs], [views[i] for i in inputs], args)
                reply("ok", None)
            elif kind == "init":
                address, num_processes, process_id, timeout_s = message[1:]
                start_runtime(Rendezvous(address, num_processes, process_id), timedelta(seconds=timeout_s))
                engines[0] = LocalEngine.of_processes(list(range(jax.process_count())))
                reply("ok", _info(engines[0]))
            elif kind == "map":
                _, path, size = message
                with open(path, "r+b") as f:
                    segments.append(torch.frombuffer(mmap.mmap(f.fileno(), size), dtype=torch.uint8))
                del segments[:-1]
                reply("ok", None)
            elif kind == "split":
                _, engine_id, ranks, new_id = message
                engines[new_id] = engines[engine_id].split(ranks)
                reply("ok", _info(engines[new_id]))
            elif kind == "num_compiled":
                reply("ok", engines[message[1]].num_compiled)
            elif kind == "close":
                engines.pop(message[1]).close()
                reply("ok", None)
            elif kind == "shutdown":
                for engine in engines.values():
                    engine.close()
                stop_runtime()
                reply("ok", None)
                conn.close()
                return
            else:
                reply("error", f"unknown request {kind!r}")
        except Exception as ex:
            reply("error", f"{type(ex).__name__}: {ex}")
