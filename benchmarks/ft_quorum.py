"""The gang.ft quorum at scale: 4, 16, 64 and 256 replicas against one coordination store.

``python -m benchmarks.ft_quorum [--replicas 4 16 64 256] [--steps N] [--out results.json]``
starts ``python -m gang.ft.store`` and, in this process, one thread per replica, each with its
own store client (:class:`gang.ft.quorum.StoreClient`, counted by :class:`CountingClient`, a thin
subclass that counts the requests it sends). Every replica registers, then runs ``--steps``
steps of the store protocol only (``form`` then ``vote``: no collectives). The heartbeats of
every replica come from one more thread with its own client, every 0.5 s, and are not counted
(a process's heartbeat is one read and one write every 0.1 s whatever the number of replicas). A step's
*quorum time* is from the moment every replica is released into it until the last replica has
its commit decision; *requests per process per step* is each client's count over the steps,
divided by the steps, without the polls of a round's result, decision or count: the mean over replicas,
and the maximum (a round's leader reads the joins, the registry and every heartbeat, in a
constant number of requests of growing size, each time the round's count changes and every
50 ms); *polls* (mean) are counted apart, as their number follows the time waited.

The replicas are threads of one Python process sharing one interpreter lock, so the quorum time
at 64 and 256 replicas measures that lock as much as the protocol; the request counts do not
depend on it. The rows go to ``<out stem>_ft_quorum.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from gang._torch_groups import TCPStore
from gang.bench.metrics import Row, make_row, median
from gang.ft.policy import Policy
from gang.ft.quorum import QuorumClient, StoreClient

_T = TypeVar("_T")
LONG = 600.0
"""The quorum and vote timeouts: longer than the run."""
HEARTBEAT_TIMEOUT = 10.0
"""The heartbeat timeout: the replicas' heartbeats come from one thread of their own (not counted)."""


class CountingClient(StoreClient):
    """A store client that counts the requests it sends, and apart the polls of a round's result,
    decision or (by its leader) count: their number follows the time waited, at most one per
    millisecond for the first 50 ms of a wait and one per 10 ms after."""

    def __init__(self, port: int) -> None:
        super().__init__("127.0.0.1", port, retry=LONG, timeout=timedelta(seconds=LONG))
        self.requests = 0
        self.polls = 0

    def _call(self, request: Callable[[TCPStore], _T], since: int | None = None) -> _T:
        self.requests += 1
        return super()._call(request, since)

    def peek(self, key: str) -> bytes | None:
        """Count a poll of a result or decision, then read ``key``."""
        if key.endswith(("/result", "/decision")):
            self.polls += 1
        return super().peek(key)

    def add(self, key: str, amount: int) -> int:
        """Count a poll of a round's count (by its leader: ``amount`` 0), then add."""
        if amount == 0:
            self.polls += 1
        return super().add(key, amount)


def measure(port: int, replicas: int, steps: int) -> dict[str, float]:
    """Run ``steps`` quorum rounds of ``replicas`` replica threads; return the medians and counts."""
    policy = Policy(replicas, LONG, HEARTBEAT_TIMEOUT)
    tokens = [uuid.uuid4().hex[:16] for _ in range(replicas)]
    clients = [QuorumClient(CountingClient(port), f"{replicas}x{i}", 0, 1, t, policy) for i, t in enumerate(tokens)]
    for c in clients:
        c.register(0)
    beats = StoreClient("127.0.0.1", port, retry=LONG, timeout=timedelta(seconds=LONG))
    beaters = [QuorumClient(beats, c.replica_id, 0, 1, c.token, policy) for c in clients]
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.5):
            for b in beaters:
                b.beat(0)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    for c in clients:
        assert isinstance(c.client, CountingClient)
        c.client.requests = c.client.polls = 0
    start, done = threading.Barrier(replicas + 1), threading.Barrier(replicas + 1)
    errors: list[BaseException] = []

    def replica(c: QuorumClient) -> None:
        last = 0
        try:
            for step in range(steps):
                start.wait()
                quorum = c.form(last, step)
                assert c.vote(quorum, True, LONG) and len(quorum.members) == replicas
                last = quorum.round
                done.wait()
        except BaseException as ex:  # reported by the driver thread
            errors.append(ex)
            start.abort()
            done.abort()

    threads = [threading.Thread(target=replica, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    times = []
    for _ in range(steps):
        start.wait()
        t0 = time.perf_counter()
        done.wait()
        times.append(time.perf_counter() - t0)
    for t in threads:
        t.join()
    stop.set()
    beater.join()
    if errors:
        raise errors[0]
    counting = [c.client for c in clients if isinstance(c.client, CountingClient)]
    others = [(c.requests - c.polls) / steps for c in counting]
    polls = [c.polls / steps for c in counting]
    return {
        "quorum_ms": median(times) * 1e3,
        "requests_mean": sum(others) / len(others),
        "requests_max": max(others),
        "polls_mean": sum(polls) / len(polls),
    }


def main(argv: list[str] | None = None) -> None:
    """Start the store, measure every size, print a table and write the rows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", nargs="*", type=int, default=[4, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="5 steps per size")
    parser.add_argument("--out", default="results.json", help="the rows go to <stem>_ft_quorum.json next to it")
    args, _ = parser.parse_known_args(argv)
    steps = 5 if args.quick else args.steps
    store = subprocess.Popen(
        [sys.executable, "-m", "gang.ft.store", "--port", "0", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert store.stdout is not None
        port = int(store.stdout.readline().strip().rpartition(":")[2])
        time.sleep(HEARTBEAT_TIMEOUT)  # a store younger than that closes no round (it may have been restarted)
        rows: list[Row] = []
        print("# gang.ft quorum at scale: one store, one thread per replica (form + vote per step)")
        print(f"{'replicas':>9} {'quorum ms/step':>15} {'requests/process/step':>22} {'(max)':>7} {'+ polls':>8}")
        for n in args.replicas:
            r = measure(port, n, steps)
            counts = f"{r['requests_mean']:>22.1f} {r['requests_max']:>7.1f} {r['polls_mean']:>8.1f}"
            print(f"{n:>9} {r['quorum_ms']:>15.2f} {counts}", flush=True)
            extra = {k: r[k] for k in ("requests_mean", "requests_max", "polls_mean")} | {"steps": steps}
            rows.append(make_row("gang.ft", "ft_quorum", 0, n, r["quorum_ms"] * 1e-3, bandwidth=False, **extra))
    finally:
        store.terminate()
        store.wait()
    out = Path(args.out).resolve()
    out = out.with_name(out.stem + "_ft_quorum.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
