"""The examples' local launcher (``examples/_ft_launch.py``'s ``LocalJob``) reports a process that
exits with an error right after its last line, even while the other processes keep printing."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import _ft_launch  # noqa: E402
from _ft_launch import Line, LocalJob, matching  # noqa: E402

CHATTY = "import time\nfor i in range({n}):\n    print('tick', i, flush=True)\n    time.sleep(0.005)\n"
"""A process printing a line every 5 ms (``n`` lines): the job's queue of lines is never quiet."""

UNTIL = (
    "import os, sys, time\n"
    "print('started', os.getpid(), flush=True)\n"
    "if len(sys.argv) > 2:\n"
    "    open(sys.argv[2], 'w').close()\n"
    "end = time.monotonic() + 120\n"
    "while not os.path.exists(sys.argv[1]) and time.monotonic() < end:\n"
    "    print('tick', flush=True)\n"
    "    time.sleep(0.005)\n"
)
"""A process printing a line every 5 ms until the file ``argv[1]`` exists (120 s at most); it
creates the file ``argv[2]``, if given, once it printed its first line."""

NEVER = 60.0
"""The timeout of a wait that must end on the failure: only a bound on a hang."""


def test_a_failed_process_is_reported_after_its_last_line_while_others_print(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    with LocalJob(echo=False) as job:
        job.start("chatty", ["-c", UNTIL, str(stop)])
        job.expect(matching("tick", "chatty"))
        job.start("crasher", ["-c", "import sys; print('boom', flush=True); sys.exit(3)"])
        try:
            assert job.expect(matching("boom")).name == "crasher"  # a line before the exit is still returned
            # `chatty` prints until told to stop. The failure comes right after the crasher's
            # last line: past at most the few lines `chatty` printed while the crasher exited (a
            # launcher that looks for failures only when no line comes for a while would read on
            # until its timeout, about 10,000 lines here).
            passed: list[Line] = []

            def never(line: Line) -> bool:
                passed.append(line)
                return False

            with pytest.raises(RuntimeError, match=r"^crasher exited with status 3$"):
                job.expect(never, NEVER)
            assert len(passed) < 1000, len(passed)  # at least 5 s of `chatty`'s lines
            with pytest.raises(RuntimeError, match=r"^crasher exited with status 3$"):  # and again
                job.expect(lambda line: False, NEVER)
        finally:
            stop.touch()


def test_a_stopped_or_successful_process_does_not_fail_a_wait() -> None:
    with LocalJob(echo=False) as job:
        job.start("killed", ["-c", CHATTY.format(n=100_000)])
        job.start("signalled", ["-c", CHATTY.format(n=100_000)])
        job.start("done", ["-c", "print('bye', flush=True)"])
        job.expect(matching("tick", "killed"))
        job.kill("killed")
        job.expect(matching("tick", "signalled"))
        job.ending("signalled")  # ended from outside the job (one of a torchrun's workers, say)
        os.kill(job.pid("signalled"), signal.SIGKILL)
        job._reader_of["signalled"].join()  # its end is queued before `last` starts (a look inside)
        job.start("last", ["-c", "import time; time.sleep(0.5); print('last', flush=True)"])
        assert job.expect(matching("last")).name == "last"  # past the ends of the other three
        assert job.returncode("killed") == -9 and job.returncode("done") == 0
        assert job.wait("signalled") == -9


def test_a_failed_process_whose_child_holds_its_output_is_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_ft_launch, "STOP_GRACE", 0.5)
    stop, started = tmp_path / "stop", tmp_path / "started"
    # The parent exits with an error once its child (a torchrun's worker, say) prints to the output
    # they share; the child goes on until `stop` exists: the parent's end is never queued meanwhile.
    parent = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {UNTIL!r}, {str(stop)!r}, {str(started)!r}])\n"
        f"while not os.path.exists({str(started)!r}):\n"
        "    time.sleep(0.01)\n"
        "sys.exit(4)\n"
    )
    with LocalJob(echo=False) as job:
        job.start("torchrun", ["-c", parent])
        job.expect(matching("tick", "torchrun"))
        try:
            with pytest.raises(RuntimeError, match=r"^torchrun exited with status 4$"):
                job.expect(lambda line: False, NEVER)
        finally:
            stop.touch()
