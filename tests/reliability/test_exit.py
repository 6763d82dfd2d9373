"""Gangs exit cleanly: jobs that start, use and exit gangs never abort at interpreter exit."""

from __future__ import annotations

import exit_stress
import pytest


@pytest.mark.parametrize("path", exit_stress.paths())
def test_jobs_that_leave_a_handle_waiting_exit_without_abort(path: str) -> None:
    # Rank 0 exits while its handle's thread is inside torch's wait(); before gang's exit handler
    # the thread was ended mid-call at finalization: "terminate called without an active exception".
    result = exit_stress.stress(path, runs=2, world=2, late=0.2, timeout=280.0)  # generous: a loaded machine
    assert result["aborts"] == 0 and result["failures"] == 0, result
