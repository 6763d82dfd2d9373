"""Training across data centres with :class:`gang.ft.DiLoCo`: replicas sync every few steps, and survive a kill.

As a replica (``GANG_FT_STORE`` and ``GANG_FT_REPLICA_ID`` set, as a launcher of the replica sets
them): :func:`train` joins the job and trains its own copy of the model with AdamW inside
streaming DiLoCo (2 fragments, each synchronised every 8 local steps through the replica gang,
its exchange overlapped with the next 2 local steps, applied by an outer SGD with Nesterov
momentum) until ``--steps`` local steps are done and every
replica is back in the quorum. Every sync is printed from the
``gang.ft`` logger's ``sync`` record (fragment, quorum, members averaged, bytes, and the
milliseconds the vote waited after the overlapped local steps).

Run as is (``python examples/diloco.py``): :func:`run_local_job` starts the coordination store and
3 replicas of this file on this machine, ``SIGKILL``\\ s replica 2 a few syncs after all 3 synced
together, starts it again a few syncs later (it heals: global parameters, outer momentum and counters, and takes part
in the sync it arrives at), and checks that every replica finished with bit-identical global
parameters. Every move waits for an event (a line of a replica, a process's exit), never for a
time, and the replicas (``--until-recovered``) train on until the job has lost a replica and has
all of them again: however slow the machine, replica 2 is killed while it trains.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional

from gang.ft import DiLoCo, ReplicaGang

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ft_launch import LocalJob, matching, number_after
from fault_tolerance import TIMEOUT  # the replicas' timeouts

REPLICAS = 3
SYNC_EVERY = 8
FRAGMENTS = 2
DELAY = 2  # local steps that compute while a fragment's exchange is in flight


def batch(replica_id: str, step: int) -> tuple[Tensor, Tensor]:
    """Replica ``replica_id``'s own batch of local step ``step`` (each data centre reads its own shard)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{replica_id}/{step}".encode()))
    x = torch.randn(16, 8, generator=generator)
    return x, (x @ torch.linspace(-1, 1, 8).unsqueeze(1)).tanh()


def fingerprint(tensors: list[Tensor]) -> str:
    """A short hash of the tensors' bytes: equal on two replicas only if they are bit-identical."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


class PrintSyncs(logging.Handler):
    """Prints ``sync`` records of the ``gang.ft`` logger (every 8th, and each whose quorum changed)
    and ``heal`` records, in one short line each."""

    def __init__(self) -> None:
        super().__init__()
        self.quorum: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "gang_ft", {})
        changed = fields.get("quorum") != self.quorum
        if fields.get("event") == "sync" and fields["fragments"] and (changed or fields["step"] % 8 == 0):
            self.quorum = fields["quorum"]
            print(
                f"sync {fields['step']:3d} after {fields['local_steps']:3d} local steps: "
                f"fragment {fields['fragments']} averaged over {fields['averaged']} of {fields['quorum']}, "
                f"{fields['bytes']} bytes, waited {1000 * fields['waited']:.1f} ms"
            )
        elif fields.get("event") == "heal" and fields.get("source") != fields.get("replica"):
            print(f"healed from replica {fields['source']!r}: {fields['bytes']} bytes")


def train(steps: int, pace: float, until_recovered: bool = False) -> None:
    """Train inside DiLoCo until ``steps`` local steps are done and every replica took part in the
    last sync (with ``until_recovered``: and a sync after all of them had fewer, so the job lost
    one and has it back); print the final global parameters' fingerprint."""
    replica_id = os.environ["GANG_FT_REPLICA_ID"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    logger = logging.getLogger("gang.ft")
    logger.setLevel(logging.INFO)
    logger.addHandler(PrintSyncs())

    # Whether a sync had every replica, and whether one after it had fewer: the same on every
    # member of a sync (they saw the same quorums), and a healed replica receives its peer's.
    progress = {"full": False, "recovered": not until_recovered}

    def state_dict() -> dict[str, Any]:  # the user's own state: the model, the inner optimizer, `progress`
        return {"model": model.state_dict(), "inner": inner.state_dict(), "progress": dict(progress)}

    def load_state_dict(state: Mapping[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        progress.update(state["progress"])

    gang = ReplicaGang.join(state_dict=state_dict, load_state_dict=load_state_dict, min_replicas=2, timeout=TIMEOUT)
    with (
        gang,
        DiLoCo(
            gang, model, inner, outer, sync_every=SYNC_EVERY, fragments=FRAGMENTS, fragment_sync_delay=DELAY
        ) as diloco,
    ):
        # Until `steps` local steps are done and the last sync had every replica (the same on
        # every replica: they all took part in it), at the end of a round of fragments.
        while (
            diloco.local_step < steps
            or gang.size < REPLICAS
            or diloco.local_step % SYNC_EVERY
            or not progress["recovered"]
        ):
            x, y = batch(replica_id, diloco.local_step)
            loss = functional.mse_loss(model(x), y)
            inner.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            time.sleep(pace)  # the rest of a real model's forward and backward
            inner.step()  # counts one local step; runs a sync when one is due
            if gang.size == REPLICAS:
                progress["full"] = True
            elif progress["full"]:
                progress["recovered"] = True
            if diloco.local_step % (4 * SYNC_EVERY) == 0:
                print(f"local step {diloco.local_step:3d}  loss {loss.item():.4f}")
        final = fingerprint(diloco.state_dict()["global"])
    print(f"final sync {gang.step_number} global parameters {final}")


def run_local_job(*, steps: int = 64, kill_after: int = 4, restart_after: int = 8, pace: float = 0.02) -> None:
    """Run the store and 3 replicas locally; once all 3 synced together, kill replica 2 ``kill_after``
    syncs later and restart it ``restart_after`` syncs later."""
    with LocalJob() as job:
        store = job.start_store()
        args = [__file__, "--steps", str(steps), "--pace", str(pace), "--until-recovered"]

        def start(replica: int) -> None:
            job.start(f"replica {replica}", args, {"GANG_FT_STORE": store, "GANG_FT_REPLICA_ID": str(replica)})

        def synced(step: int) -> None:
            job.expect(lambda line: line.name == "replica 0" and _sync_of(line.text) >= step)

        for replica in range(REPLICAS):
            start(replica)
        everyone = job.expect(matching(r"sync .* of \['0', '1', '2'\]", "replica 0"))
        synced(_sync_of(everyone.text) + kill_after)
        job.say("=== SIGKILL replica 2")
        job.kill("replica 2")
        if job.returncode("replica 2") != -signal.SIGKILL:  # it cannot have ended: the job did not recover
            raise RuntimeError(f"replica 2 ended before the kill, with status {job.returncode('replica 2')}")
        job.expect(matching(r"sync .* of \['0', '1'\]", "replica 0"))  # the survivors sync without it
        synced(_sync_of(everyone.text) + restart_after)
        job.say("=== starting replica 2 again")
        start(2)
        final = job.expect_same_ending("final sync", [f"replica {replica}" for replica in range(REPLICAS)])
    print(f"=== every replica finished with the same global parameters: {final}")


def _sync_of(text: str) -> int:
    return number_after("sync", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--pace", type=float, default=0.02, help="seconds of simulated compute per local step")
    parser.add_argument(
        "--until-recovered", action="store_true", help="train on until the job lost a replica and has all of them again"
    )
    args = parser.parse_args()
    if "GANG_FT_STORE" in os.environ:
        train(args.steps, args.pace, args.until_recovered)
    else:
        run_local_job(steps=args.steps, pace=args.pace)


if __name__ == "__main__":
    main()
