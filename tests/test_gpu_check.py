"""The GPU check's CPU half: ``.ci/gpu_check.py --cpu`` runs every check on the CPU and gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GPU_CHECK = Path(__file__).resolve().parent.parent / ".ci" / "gpu_check.py"


def test_gpu_check_runs_every_check_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = [sys.executable, str(GPU_CHECK), "--cpu", "--no-install", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu" and "install" not in report
    checks = report["checks"]
    assert list(checks) == ["nccl_gang", "gloo_cuda", "work_polling", "fsdp2", "jax_gang"]
    assert all(entry["ok"] for entry in checks.values()), checks
    assert checks["nccl_gang"]["result"]["sub_gangs"] == 2
    assert checks["gloo_cuda"]["result"]["size"] == 2
    losses = checks["fsdp2"]["result"]["losses"]
    assert len(losses) == 5 and losses[-1] < losses[0]
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith("gpu_check cpu: 5/5 passed"), summary


def test_gpu_check_reports_a_failing_check(tmp_path: Path) -> None:
    # A check whose processes outlive its timeout fails, is reported with why, and sets the exit status.
    out = tmp_path / "report.json"
    argv = [sys.executable, str(GPU_CHECK), "--cpu", "--no-install", "--only", "gloo_cuda", "--timeout", "0.5"]
    done = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    entry = json.loads(out.read_text())["checks"]["gloo_cuda"]
    assert not entry["ok"] and entry["errors"] == ["no result (timed out or died)"] * 2
    assert "FAILED: gloo_cuda" in done.stdout.strip().splitlines()[-1]
