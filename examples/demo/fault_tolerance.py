"""The demo's fault-tolerance run (``nox -s demo``): 3 replicas train, one is killed and later restarted.

Starts the coordination store (``python -m gang.ft.store``) and 3 replica processes of
``examples/fault_tolerance.py`` (each with ``GANG_FT_STORE`` and ``GANG_FT_REPLICA_ID``), lets them
train, ``SIGKILL``\\ s replica 2 at step 10 and starts it again at step 20. Every replica prints the
quorum whenever it changes, the lowest rank of the quorum prints the loss of every committed step,
and the restarted replica prints how it healed (its step number jumps to its peers'). The run ends
when every replica has finished with the same parameters, and kills every process it started.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fault_tolerance import run_local_job

if __name__ == "__main__":
    run_local_job(steps=40, kill_at=10, restart_at=20, pace=0.1)
