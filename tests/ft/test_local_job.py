"""The examples' local launcher (``examples/_ft_launch.py``'s ``LocalJob``) reports a process that
exits with an error right after its last line, even while the other processes keep printing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import _ft_launch  # noqa: E402
from _ft_launch import LocalJob, matching  # noqa: E402

CHATTY = "import time\nfor i in range({n}):\n    print('tick', i, flush=True)\n    time.sleep(0.005)\n"
"""A process printing a line every 5 ms (``n`` lines): the job's queue of lines is never quiet."""

NEVER = 60.0
"""The timeout of a wait that must end on the failure: only a bound on a hang."""


def test_a_failed_process_is_reported_after_its_last_line_while_others_print() -> None:
    with LocalJob(echo=False) as job:
        job.start("chatty", ["-c", CHATTY.format(n=4000)])  # at least 20 s of lines
        job.expect(matching("tick", "chatty"))
        job.start("crasher", ["-c", "import sys; print('boom', flush=True); sys.exit(3)"])
        assert job.expect(matching("boom")).name == "crasher"  # a line before the exit is still returned
        with pytest.raises(RuntimeError, match=r"^crasher exited with status 3$"):
            job.expect(lambda line: False, NEVER)
        with pytest.raises(RuntimeError, match=r"^crasher exited with status 3$"):  # and again
            job.expect(lambda line: False, NEVER)
        # Reported while the other one still prints (a launcher that looks only when no line
        # comes for a while would report it once `chatty` ended, or at the timeout).
        assert job.returncode("chatty") is None


def test_a_stopped_or_successful_process_does_not_fail_a_wait() -> None:
    with LocalJob(echo=False) as job:
        job.start("killed", ["-c", CHATTY.format(n=100_000)])
        job.start("done", ["-c", "print('bye', flush=True)"])
        job.expect(matching("tick", "killed"))
        job.kill("killed")
        job.start("last", ["-c", "import time; time.sleep(0.5); print('last', flush=True)"])
        assert job.expect(matching("last")).name == "last"  # past the ends of `killed` and `done`
        assert job.returncode("killed") == -9 and job.returncode("done") == 0


def test_a_failed_process_whose_child_holds_its_output_is_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_ft_launch, "STOP_GRACE", 0.5)
    stop = tmp_path / "stop"
    # The parent exits with an error while its child (a torchrun's worker, say) keeps printing to
    # the output they share until `stop` exists (60 s at most): the parent's end is never queued.
    child = (
        "import os, time\n"
        "print('child', os.getpid(), flush=True)\n"
        "end = time.monotonic() + 60\n"
        f"while not os.path.exists({str(stop)!r}) and time.monotonic() < end:\n"
        "    print('tick', flush=True)\n"
        "    time.sleep(0.005)\n"
    )
    parent = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nsys.exit(4)\n"
    with LocalJob(echo=False) as job:
        job.start("torchrun", ["-c", parent])
        pid = int(job.expect(matching("child", "torchrun")).text.split()[1])
        try:
            with pytest.raises(RuntimeError, match=r"^torchrun exited with status 4$"):
                job.expect(lambda line: False, NEVER)
            os.kill(pid, 0)  # reported while the child still prints (it would raise once the child ended)
        finally:
            stop.touch()
