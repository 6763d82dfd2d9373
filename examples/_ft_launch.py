"""Start and stop the processes of a fault-tolerant job on this machine (used by the fault-tolerance examples).

A real job runs the coordination store (``python -m gang.ft.store``) on one host and one launcher
per replica (``torchrun`` on each replica's node). :class:`LocalJob` does the same with local
processes, all on loopback (the store listens on ``127.0.0.1``, so every process's death signal
does too, and gloo uses the loopback interface), so that an example can kill a replica with
``SIGKILL`` and start it again: every process's output is read line by line in a thread (each line
stamped with the wall time it was read at, and echoed with the seconds since the job started and
the process's name), and :meth:`LocalJob.close` kills every process that is still running, so
nothing outlives the example.

The waits synchronise on events, not on time: :meth:`LocalJob.expect` returns at the line it waits
for, and fails as soon as a process the job did not stop ends with an error, right after that
process's last line, however busily the other processes print (a process whose output a child of
its own still holds open, such as a torchrun's worker, is caught :data:`STOP_GRACE` seconds
after a wait first sees it exited); their timeouts (:data:`HANG`, 10 minutes) only bound a hang,
so a slow machine is slow, not failed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gang.testing import LOOPBACK, local_env


def wait_for_port(port: int, timeout: float) -> None:
    """Wait until something accepts connections on ``127.0.0.1:port``.

    :raises TimeoutError: If nothing does within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on port {port} after {timeout} s") from None
            time.sleep(0.05)


@dataclass(frozen=True)
class Line:
    """One line of output of a process of the job."""

    name: str
    """The name the process was started under."""
    time: float
    """``time.time()`` when the line was read."""
    text: str
    """The line, without its newline."""


@dataclass(frozen=True)
class _Ended:
    """Queued by a process's reader after its last line: the process closed its output."""

    name: str
    proc: subprocess.Popen[str]


HANG = 600.0
"""Seconds a wait of :class:`LocalJob` gives up after: a bound on a hang, far above what any step
of the examples takes even on a loaded machine (the waits end at events, not at a time)."""

STOP_GRACE = 10.0
"""Seconds :meth:`LocalJob.close` gives a process (and a torchrun its workers) after ``SIGTERM``;
also how long :meth:`LocalJob.expect` waits for the status of a process that closed its output,
and after first seeing a failed process exit while a child of its own holds its output open."""


class LocalJob:
    """The processes of one fault-tolerant job, started, watched and killed by name.

    Use it as a context manager: on exit (normal, exception or ``SIGTERM``) every process still
    running is killed and waited for.
    """

    def __init__(self, *, echo: bool = True) -> None:
        self.echo = echo
        self._procs: dict[str, subprocess.Popen[str]] = {}
        self._readers: list[threading.Thread] = []
        self._reader_of: dict[str, threading.Thread] = {}  # of the latest process of each name
        self._stopped: set[subprocess.Popen[str]] = set()  # the processes the job killed or waited for
        self._drained: set[subprocess.Popen[str]] = set()  # the processes whose last line was consumed
        self._failed_at: dict[subprocess.Popen[str], float] = {}  # when each failed one was first seen
        self._lines: queue.Queue[Line | _Ended] = queue.Queue()
        self._history: list[Line] = []
        self._old_sigterm: object = None
        self._started = time.time()
        self._print_lock = threading.Lock()  # one whole line at a time from the reader threads

    def __enter__(self) -> LocalJob:
        self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        signal.signal(signal.SIGTERM, self._old_sigterm)  # type: ignore[arg-type]

    def start_store(self, *, timeout: float = HANG) -> str:
        """Start ``python -m gang.ft.store --host 127.0.0.1 --port 0``; return the ``host:port`` it
        prints once it listens (on loopback: every process of a local job is on this machine)."""
        self.start("store", ["-m", "gang.ft.store", "--host", LOOPBACK, "--port", "0"])
        line = self.expect(matching("GANG_FT_STORE=", "store"), timeout)
        return line.text.removeprefix("GANG_FT_STORE=")

    def start(
        self, name: str, args: Sequence[str], env: dict[str, str] | None = None, *, python: str | None = None
    ) -> float:
        """Start ``python args`` as process ``name`` (output read line by line); return ``time.time()`` of the launch.

        ``env`` is added to this process's environment; ``PYTHONUNBUFFERED`` is set so that lines
        arrive when they are printed, and :func:`gang.address.local_env` keeps gloo on loopback.
        ``python`` is the interpreter (default: this one).
        """
        if name in self._procs and self._procs[name].poll() is None:
            raise ValueError(f"`name` must not be a running process, but {name!r} is running.")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **local_env(), **(env or {})}
        launched = time.time()
        proc = subprocess.Popen(
            [python or sys.executable, *args],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",  # a byte that is not UTF-8 must not end the reader before the process's end
        )
        self._procs[name] = proc
        reader = threading.Thread(target=self._read, args=(name, proc), daemon=True)
        reader.start()
        self._readers.append(reader)
        self._reader_of[name] = reader
        return launched

    def _read(self, name: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                line = Line(name, time.time(), raw.rstrip("\n"))
                if self.echo:
                    self._print(f"{line.time - self._started:6.2f}s [{name}] {line.text}")
                self._history.append(line)
                self._lines.put(line)
        finally:
            self._lines.put(_Ended(name, proc))

    def say(self, text: str) -> None:
        """Print ``text`` stamped like the processes' lines (seconds since the job started)."""
        self._print(f"{time.time() - self._started:6.2f}s {text}")

    def _print(self, text: str) -> None:
        with self._print_lock:
            print(text, flush=True)

    def kill(self, name: str) -> float:
        """Send ``SIGKILL`` to process ``name`` and wait for it; return ``time.time()`` just before the signal."""
        proc = self._procs[name]
        self._stopped.add(proc)
        killed = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return killed

    def ending(self, name: str) -> None:
        """Take the exit of process ``name`` as expected from now on (:meth:`expect` does not fail
        on it): before ending it from outside the job, such as a signal to one of a torchrun's
        workers, which ends the torchrun with an error."""
        self._stopped.add(self._procs[name])

    def wait(self, name: str, timeout: float = HANG) -> int:
        """Wait for process ``name`` to exit (an exit the job then expects: :meth:`expect` does not
        fail on it); return its exit status.

        :raises subprocess.TimeoutExpired: If it is still running after ``timeout`` seconds.
        """
        self._stopped.add(self._procs[name])
        return self._procs[name].wait(timeout)

    def returncode(self, name: str) -> int | None:
        """Return the exit status of process ``name``, or ``None`` while it runs."""
        return self._procs[name].poll()

    def expect(self, match: Callable[[Line], bool], timeout: float = HANG) -> Line:
        """Return the next line (of any process) for which ``match`` is true; the lines before it are
        consumed.

        :raises RuntimeError: If, before it, a process that the job neither killed nor waited for
            (:meth:`kill`, :meth:`wait`, :meth:`ending`) exits with a status other than 0: right after its last
            line, or, while a child of its own still holds its output open, :data:`STOP_GRACE`
            seconds after a wait first saw it exited.
        :raises TimeoutError: If none arrives within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no expected line within {timeout} s")
            try:
                item = self._lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                item = None
            if isinstance(item, Line):
                if match(item):
                    return item
            elif isinstance(item, _Ended):
                self._drained.add(item.proc)
                if item.proc not in self._stopped:
                    with contextlib.suppress(subprocess.TimeoutExpired):  # an output closed at exit: its status follows
                        item.proc.wait(max(0.0, min(STOP_GRACE, deadline - time.monotonic())))
            self._check_exited()

    def _check_exited(self) -> None:
        """Raise if a process the job did not stop exited with an error and its last line was
        consumed, or a wait first saw it exited :data:`STOP_GRACE` seconds ago and a child of its
        own still holds its output open (its end is then never queued)."""
        now = time.monotonic()
        for name, proc in self._procs.items():
            status = proc.poll()
            if proc in self._stopped or status in (None, 0):
                continue
            held = self._reader_of[name].is_alive() and now - self._failed_at.setdefault(proc, now) >= STOP_GRACE
            if proc in self._drained or held:
                raise RuntimeError(f"{name} exited with status {status}")

    def pid(self, name: str) -> int:
        """Return the pid of the latest process started as ``name``."""
        return self._procs[name].pid

    def expect_same_ending(self, pattern: str, names: Sequence[str], timeout: float = HANG) -> str:
        """Wait for one line starting with ``pattern`` from each process of ``names`` (the last line a
        replica prints), then for each of them to exit; return the line they all printed.

        :raises RuntimeError: If a process exited with a status other than 0, or the lines differ.
        """
        finals = [self.expect(matching(pattern), timeout) for _ in names]
        for name in names:
            status = self.wait(name, timeout)
            if status != 0:
                raise RuntimeError(f"{name} exited with status {status}")
        if len({line.text for line in finals}) != 1:
            raise RuntimeError(f"the replicas finished differently: {[line.text for line in finals]}")
        return finals[0].text

    def names(self) -> list[str]:
        """Return the names of every process started so far."""
        return list(self._procs)

    def output(self, name: str) -> list[str]:
        """Return every line process ``name`` printed so far (across restarts under that name)."""
        return [line.text for line in list(self._history) if line.name == name]

    def close(self) -> None:
        """Stop every process still running, wait for them and for their output.

        Each gets ``SIGTERM`` first, so that a torchrun stops the workers it started (they run in
        sessions of their own, out of reach of a signal to the torchrun's process group), then
        ``SIGKILL`` after :data:`STOP_GRACE` seconds."""
        running = [proc for proc in self._procs.values() if proc.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + STOP_GRACE
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs.values():
            proc.wait()
        for reader in self._readers:
            reader.join(timeout=5)


def number_after(word: str, text: str) -> int:
    """The integer that follows ``word`` at the start of ``text`` (``"step 12 loss ..."``), else -1."""
    parts = text.split()
    return int(parts[1]) if len(parts) > 1 and parts[0] == word and parts[1].isdigit() else -1


def matching(pattern: str, name: str | None = None) -> Callable[[Line], bool]:
    """Return a predicate for :meth:`LocalJob.expect`: the line starts with ``pattern`` (and is ``name``'s)."""
    regex = re.compile(pattern)
    return lambda line: (name is None or line.name == name) and regex.match(line.text) is not None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
