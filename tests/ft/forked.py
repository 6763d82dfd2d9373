"""Replica and store processes forked from :mod:`gang.testing`'s fork server instead of started anew.

A fresh interpreter spends about 1.7 s of CPU importing torch; ``tests/ft`` starts a hundred of
them. :class:`Forked` runs the same command (``python SCRIPT ARGS...`` or ``python -m MODULE
ARGS...``) in a process forked from the fork server that already imported torch and gang
(:mod:`gang._testing_preload`), and hands back what :class:`subprocess.Popen` would: a real
process with its own pid and session, which takes ``SIGKILL`` and ``SIGSTOP`` like any other, and
its exit code. The script runs as ``__main__`` with ``sys.argv`` and the environment it was
given; its standard output is discarded and its standard error goes to ``stderr_path``.
Launchers (``torchrun``) are not forked: they stay real commands.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from gang.testing import _context


class Forked:
    """A command run in a process forked from the fork server; the part of :class:`subprocess.Popen`
    that ``tests/ft`` uses (``args``, ``pid``, ``poll``, ``wait``, ``kill``, ``stderr``).

    :param cmd: ``[sys.executable, SCRIPT, ...]`` or ``[sys.executable, "-m", MODULE, ...]``.
    :param env: The whole environment of the process.
    :param stderr_path: Where its standard error goes.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], stderr_path: Path) -> None:
        self.args = cmd
        self.stderr = None
        self._proc: Any = _context().Process(target=_run, args=(cmd[1:], env, str(stderr_path)))
        self._proc.start()
        self.pid: int = self._proc.pid

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), ``None`` while it runs or is stopped."""
        code: int | None = self._proc.exitcode
        return code

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        self._proc.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def kill(self) -> None:
        """Send ``SIGKILL``."""
        os.kill(self.pid, signal.SIGKILL)


def can_fork(cmd: list[str]) -> bool:
    """Whether ``cmd`` is a Python script or module :class:`Forked` runs (not a launcher)."""
    return (cmd[0] == sys.executable and cmd[1] != "-m") or cmd[1:3] == ["-m", "gang.ft.store"]


def _run(argv: list[str], env: dict[str, str], stderr_path: str) -> None:
    """In the forked process: become a session of its own, take the environment and standard
    streams given, and run the script or module as ``python`` would."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 2)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).parent))
        runpy.run_path(argv[0], run_name="__main__")
