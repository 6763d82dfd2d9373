"""The demo's fault-tolerance runs (``nox -s demo``): a replica killed and restarted, then the same with HSDP.

First, the coordination store (``python -m gang.ft.store``) and 3 replica processes of
``examples/fault_tolerance.py`` (each with ``GANG_FT_STORE`` and ``GANG_FT_REPLICA_ID``) train;
replica 2 is ``SIGKILL``\\ ed at step 10 and started again at step 20 (counted from the step at which
all 3 first train together, 0 unless one started late). Every replica prints the
quorum whenever it changes, the lowest rank of the quorum prints the loss of every committed step,
and the restarted replica prints how it healed (its step number jumps to its peers').

Then HSDP across replicas: 3 replicas of ``examples/ft_hsdp.py``, each one ``torchrun`` of 2
processes that shard the model with FSDP2 inside the replica and average the gradient shards
across replicas through the ``ReplicaGang`` (:meth:`~gang.ft.ReplicaGang.replicate_fsdp`). At step
10 one process of replica 2 is ``SIGKILL``\\ ed (its torchrun ends the replica, the others go on
without it); at step 20 replica 2 is started again and each of its processes heals from the
process of equal rank in a live replica. The quorum is printed whenever it changes, and the loss
of every committed step with the quorum it was averaged over.

Last, training across data centres: 3 replicas of ``examples/diloco.py`` train on their own and
synchronise through streaming DiLoCo (2 fragments, each every 8 local steps, its exchange
overlapped with the next 2 local steps); replica 2 is ``SIGKILL``\\ ed a few syncs after all 3
synced together and started again a few syncs later (it heals at the survivors' next sync).

Each run ends when every replica has finished with the same parameters (shards), and kills every
process it started. Every move waits for an event (a line, a process's exit), never for a time,
and no run can end before the killed replica is back: a loaded machine makes the demo slower, not
failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import diloco
import fault_tolerance
import ft_hsdp

if __name__ == "__main__":
    fault_tolerance.run_local_job(steps=40, kill_at=10, restart_at=20, pace=0.1)
    print("=== HSDP across replicas: FSDP2 inside each replica of 2 processes, gang.ft across them")
    ft_hsdp.run_local_job(steps=40, kill_at=10, restart_at=20, pace=0.1)
    print("=== Training across data centres: streaming DiLoCo over 3 replicas, one killed and restarted")
    diloco.run_local_job()
