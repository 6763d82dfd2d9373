"""gang.ft against network faults: 3 replicas and the store, each on its own test host.

The replicas run ``tests/ft/ft_workers.py`` (one process each, steps paced by ``FT_STEP_SECONDS``)
on hosts 1 to 3, the store ``python -m gang.ft.store --host 0.0.0.0`` on host 0, and the faults are
made on the network (:class:`gang.testing.TestHosts`): a cut link, a partition of two replicas
that both still reach the store and the third, a flapping link. Each scenario is judged by state
as ``tests/ft/test_ft.py`` judges its own (:meth:`Cluster.check_training`): every committed step
was committed by every replica that logged it with the same members and bit-identical parameters
(no split brain), and every finishing replica's parameters equal a single-process replay of the
logged membership schedule. A replica that ends with ``GangError`` (its store unreachable for
``timeout + quorum_timeout``) is started again once its link is back, as a supervisor would, and
heals in. Every step attempt of every replica (from ``enter``, or from the end of a wait outside
the quorum, to its step's end) must end within ``timeout + quorum_timeout`` plus a small slack
(the watch interval, scheduling): that bound is the guarantee
itself. The times of detection and recovery are checked with a generous margin (the machine is
shared and loaded). The measured times are printed (``-s``) for the docs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "ft"))

from test_diloco import DILOCO_WORKER, DiLoCoCluster
from test_ft import WORKER, Cluster  # tests/ft is not a package

from gang.ft.policy import PARTITION_ABORTS
from gang.testing import TestHosts

TIMEOUT = 3.0  # seconds: timeout, quorum_timeout and heartbeat_timeout of every replica
PACE = "0.2"  # seconds: the least time of one step
MARGIN = 15.0  # seconds added to the bounds on detection and recovery (a loaded 2-core machine)
ATTEMPT = 2 * TIMEOUT  # the bound on a step attempt: timeout + quorum_timeout
# Seconds past it allowed: the watch interval and scheduling on a loaded machine. A store request
# ends by the attempt's deadline (test_a_store_request_over_a_cut_link_ends_at_the_step_attempts_deadline).
SLACK = 1.0
STORE_PORT = "29400"  # the store's port on its own host


class NetCluster(Cluster):
    """:class:`Cluster` on test hosts: the store on host 0, replica ``i`` on host ``i + 1``."""

    port = STORE_PORT

    def __init__(self, root: Path, hosts: TestHosts) -> None:
        self.hosts = hosts
        Cluster.__init__(self, root)  # not DiLoCoCluster's (see NetDiLoCo)
        self.address = f"{hosts[0].address}:{self.port}"

    def _serve(self, port: str) -> Any:
        self._port_file = self.root / f"store.{len(self.procs)}.port"
        cmd = [sys.executable, "-m", "gang.ft.store", "--host", "0.0.0.0", "--port", self.port]
        proc = self._popen([*cmd, "--port-file", str(self._port_file)], dict(os.environ))
        self._until(lambda: self._port_file.exists(), "the store to listen")
        return proc

    def _popen(self, cmd: list[str], env: dict[str, str]) -> Any:
        if self.script and str(WORKER) in cmd:
            at = cmd.index(str(WORKER))
            cmd = [*cmd[:at], *self.script, *cmd[at + 1 :]]
        rid = env.get("GANG_FT_REPLICA_ID") if "gang.ft.store" not in cmd else None
        host = self.hosts[0] if rid is None else self.hosts[1 + int(rid)]
        proc = host.popen(cmd, env=env, log=self.root / f"out.{len(self.procs)}.{host.name}")
        self.procs.append(proc)  # type: ignore[arg-type]  # a Popen of text, used as the others are
        return proc

    def launch(self, steps: int, rids: tuple[str, ...] = ("0", "1", "2")) -> None:
        """Start replicas ``rids`` training ``steps`` paced steps, together from their first step."""
        env = {"FT_STEP_SECONDS": PACE, "FT_QUORUM_TIMEOUT": str(TIMEOUT), "FT_HEARTBEAT_TIMEOUT": str(TIMEOUT)}
        for rid in rids:
            self.start(rid, steps=steps, timeout=str(TIMEOUT), env=env)
        for rid in rids:
            self.wait(rid, "paused", 1)
        for rid in rids:
            self.release(rid, "enter", 1)

    def restart(self, rid: str, steps: int) -> None:
        """Start replica ``rid`` again (its last incarnation ended) and let it begin."""
        self.launch(steps, (rid,))

    def ended(self, rid: str) -> bool:
        """Whether the latest incarnation of ``rid`` logged its end (``done`` or ``error``)."""
        return any(e["event"] in ("done", "error") for log in self.current(rid) for e in self.events(log))

    def all_events(self, rid: str) -> list[dict[str, Any]]:
        """Every event of every incarnation of ``rid``, in order."""
        return [e for log in self.logs[rid] for e in self.events(log)]

    def commits_after(self, rid: str, t: float) -> list[dict[str, Any]]:
        return [e for e in self.all_events(rid) if e["event"] == "commit" and e["t"] >= t]

    def until(self, condition: Any, what: str) -> None:
        self._until(condition, what)

    def longest_attempt(self) -> float:
        """The longest step attempt of any replica: from an ``enter`` (or from the end of a wait
        outside the quorum, its ``outside`` record) to its step's end (commit, abort, error)."""
        longest = 0.0
        for logs in self.logs.values():
            for log in logs:
                began: float | None = None
                for e in self.events(log):
                    if e["event"] == "enter":
                        began = e["t"]
                    elif e["event"] == "ft_log" and e["ft"].get("event") == "outside" and began is not None:
                        began += e["ft"]["seconds"]
                    elif e["event"] in ("commit", "abort", "error") and began is not None:
                        longest = max(longest, e["t"] - began)
                        began = None
        return longest

    def check_attempts(self, what: str) -> None:
        """Report the longest step attempt and check it against ``timeout + quorum_timeout``."""
        longest = self.longest_attempt()
        report(f"{what}: longest step attempt of any replica", longest)
        assert longest < ATTEMPT + SLACK, longest


class NetDiLoCo(NetCluster, DiLoCoCluster):
    """:class:`NetCluster` running ``diloco_workers.py one`` (judged by DiLoCo's replay)."""

    def __init__(self, root: Path, hosts: TestHosts, port: str) -> None:
        self.mode, self.script, self.port = "one", (str(DILOCO_WORKER), "one"), port
        root.mkdir()
        NetCluster.__init__(self, root, hosts)


@pytest.fixture
def net(tmp_path: Path) -> Iterator[NetCluster]:
    with TestHosts(4, prefix="ft") as hosts:
        cluster = NetCluster(tmp_path, hosts)
        try:
            yield cluster
            assert hosts.leaks() == []
        finally:
            cluster.close()


def report(what: str, seconds: float) -> None:
    print(f"[ft network] {what}: {seconds:.2f} s")


def steps_for(seconds: float) -> int:
    return int(seconds / float(PACE))


@pytest.mark.parametrize("cut", [10.0, 40.0])
def test_a_replicas_host_cut_off_is_dropped_then_healed_back_in(net: NetCluster, cut: float) -> None:
    steps = steps_for(cut + 25)  # the cut, the restart and the heal, with room for a slow start
    net.launch(steps)
    net.wait("2", "commit", 5)
    t_cut = time.time()
    net.hosts.cut(3)
    # The survivors commit without it within a heartbeat's silence plus one step.
    net.until(lambda: any(e["members"] == ["0", "1"] for e in net.commits_after("0", t_cut)), "a commit without 2")
    dropped = min(e["t"] for e in net.commits_after("0", t_cut) if e["members"] == ["0", "1"]) - t_cut
    report(f"cut {cut:g} s: survivors' first commit without the cut replica", dropped)
    assert dropped < 2 * TIMEOUT + float(PACE) + MARGIN
    # The cut replica cannot reach the store: GangError within timeout + quorum_timeout of its last try.
    net.until(lambda: net.ended("2"), "replica 2 to end")
    error = [e for e in net.all_events("2") if e["event"] == "error"]
    assert error and "unreachable" in error[0]["error"], error
    report(f"cut {cut:g} s: the cut replica's GangError after the cut", error[0]["t"] - t_cut)
    assert error[0]["t"] - t_cut < 2 * TIMEOUT + TIMEOUT + MARGIN
    time.sleep(max(0.0, t_cut + cut - time.time()))
    net.hosts.restore(3)
    t_back = time.time()
    net.restart("2", steps)
    net.until(lambda: any(e["members"] == ["0", "1", "2"] for e in net.commits_after("0", t_back)), "2 back")
    back = min(e["t"] for e in net.commits_after("0", t_back) if e["members"] == ["0", "1", "2"]) - t_back
    report(f"cut {cut:g} s: link back to the restarted replica's first commit with all", back)
    assert [e for e in net.all_events("2") if e["event"] == "healed"]
    net.finish({"0": 0, "1": 0, "2": 0})
    net.check_training(["0", "1", "2"], steps)
    net.check_attempts(f"cut {cut:g} s")


def test_the_stores_host_cut_briefly_training_goes_on(net: NetCluster) -> None:
    steps = steps_for(10)
    net.launch(steps)
    net.wait("2", "commit", 5)
    net.hosts.cut(0)
    time.sleep(1.5)  # less than every timeout
    net.hosts.restore(0)
    net.finish({"0": 0, "1": 0, "2": 0})
    net.check_training(["0", "1", "2"], steps)
    net.check_attempts("store cut 1.5 s")


def test_the_stores_host_cut_for_long_every_replica_gets_gang_error(net: NetCluster) -> None:
    steps = steps_for(60)
    net.launch(steps)
    net.wait("2", "commit", 5)
    t_cut = time.time()
    net.hosts.cut(0)
    net.finish({"0": 3, "1": 3, "2": 3})  # none hangs: every process ends
    for rid in ("0", "1", "2"):
        error = next(e for e in net.all_events(rid) if e["event"] == "error")
        assert "unreachable" in error["error"], error
        report(f"store cut: replica {rid}'s GangError after the cut", error["t"] - t_cut)
        assert error["t"] - t_cut < 2 * TIMEOUT + TIMEOUT + MARGIN
    net.hosts.restore(0)
    net.check_training([], max(e["step"] for e in net.all_events("0") if e["event"] == "commit"))


def test_two_replicas_that_cannot_reach_each_other_commit_apart_then_heal(net: NetCluster) -> None:
    steps = steps_for(35)
    net.launch(steps)
    net.wait("2", "commit", 5)
    t_part = time.time()
    net.hosts.partition(1, 2)  # replicas 0 and 1; both still reach the store and replica 2
    net.until(lambda: any(e["members"] == ["0", "2"] for e in net.commits_after("0", t_part)), "a commit of 0 and 2")
    first = min(e["t"] for e in net.commits_after("0", t_part) if e["members"] == ["0", "2"])
    aborted = [e for e in net.all_events("0") if e["event"] == "abort" and t_part <= e["t"] <= first]
    report("partition: replica 0's first commit with 2 only", first - t_part)
    print(f"[ft network] partition: steps aborted on replica 0 before it: {len(aborted)}")
    assert len(aborted) <= PARTITION_ABORTS, aborted
    assert not net.ended("1")  # it waits apart, as a spare
    time.sleep(3.0)  # it keeps waiting apart (no GangError) while the link stays broken
    net.hosts.heal(1, 2)
    t_heal = time.time()
    net.until(lambda: any(e["members"] == ["0", "1", "2"] for e in net.commits_after("1", t_heal)), "1 back")
    back = min(e["t"] for e in net.commits_after("1", t_heal) if e["members"] == ["0", "1", "2"]) - t_heal
    report("partition healed: first commit of all three", back)
    net.finish({"0": 0, "1": 0, "2": 0})
    net.check_training(["0", "1", "2"], steps)
    assert [e for e in net.all_events("1") if e["event"] == "healed"]
    net.check_attempts("partition")


def test_a_flapping_link_no_hang_no_split_brain_all_back(net: NetCluster) -> None:
    steps = steps_for(35)
    net.launch(steps)
    net.wait("2", "commit", 5)
    net.hosts.flap(3, period=1.0, duration=12.0).join()
    t_end = time.time()
    if net.ended("2"):  # it got GangError during the flapping: its supervisor starts it again
        net.restart("2", steps)
    net.until(lambda: any(e["members"] == ["0", "1", "2"] for e in net.commits_after("0", t_end)), "all back")
    back = min(e["t"] for e in net.commits_after("0", t_end) if e["members"] == ["0", "1", "2"]) - t_end
    report("flapping link: its end to the first commit of all three", back)
    assert back < 2 * TIMEOUT + TIMEOUT + MARGIN
    net.finish({"0": 0, "1": 0, "2": 0})
    net.check_training(["0", "1", "2"], steps)
    net.check_attempts("flapping link")


RATE = 20_000_000  # bits per second: replica 2's link in the rate-limited run
HIDDEN = "32768"  # the model's hidden width: 3.4 MB of float64 parameters, fragments of 2.1 and 1.3 MB


def test_streaming_diloco_with_a_rate_limited_link_completes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # DiLoCo of 3 replicas, 2 fragments, every 4 local steps: one run, every link as it is for the
    # first half, then (all replicas paused before local step 12) replica 2's link limited to
    # 20 Mbit/s (tbf). It completes and matches the replay; the outer step's time (exchange and
    # update) of each half is reported side by side (a benchmark row; with HOSTS_DILOCO_OUT set,
    # written there as JSON for docs/performance.rst).
    env = {"FT_SYNC_EVERY": "4", "FT_FRAGMENTS": "2", "FT_TIMEOUT": "30", "FT_QUORUM_TIMEOUT": "20"}
    env |= {"FT_HEARTBEAT_TIMEOUT": "3"}
    monkeypatch.setenv("FT_HIDDEN", HIDDEN)  # the workers' model and the replay's
    steps, limit_at = 24, 12
    load = [os.getloadavg()[0]]
    with TestHosts(4, prefix="dl") as hosts:
        cluster = NetDiLoCo(tmp_path / "run", hosts, "29401")
        try:
            for rid in ("0", "1", "2"):
                cluster.start(rid, steps=steps, env=env, pause=f"step:{limit_at}")
            for rid in ("0", "1", "2"):
                cluster.wait(rid, "paused", 1)
            for rid in ("0", "1", "2"):
                cluster.release(rid, "enter", 1)
            for rid in ("0", "1", "2"):
                cluster.wait(rid, "paused", limit_at)
            hosts.limit_rate(3, RATE)
            for rid in ("0", "1", "2"):
                cluster.release(rid, "step", limit_at)
            cluster.finish({"0": 0, "1": 0, "2": 0})
            syncs = cluster.check_replay(delay=0, alpha=0.0)
            assert len(syncs) >= steps // 2 and all(s["quorum"] == ["0", "1", "2"] for s in syncs), syncs
            assert hosts.leaks() == []
        finally:
            cluster.close()
    load.append(os.getloadavg()[0])
    rows = []
    for name, limited in (("unlimited", False), ("limited", True)):
        # Not the first step's sync (it only heals); the limit holds from local step `limit_at` on.
        exchanges = [s for s in syncs if s["fragments"] and (s["local_steps"] > limit_at) == limited]
        seconds = sorted(s["seconds"] for s in exchanges)
        sent = [s["bytes"] for s in exchanges]
        rows.append(
            {
                "link": name,
                "rate_bits_per_second": RATE if limited else None,
                "outer_step_s": seconds[len(seconds) // 2],
                "bytes_per_exchange": sum(sent) / len(sent),
                "syncs": len(exchanges),
            }
        )
    for row in rows:
        print(
            f"[ft network] DiLoCo 2 fragments, replica 2's link {row['link']}: median outer step "
            f"{row['outer_step_s']:.3f} s, {row['bytes_per_exchange']:.0f} B sent per exchange"
        )
    out = os.environ.get("HOSTS_DILOCO_OUT")
    if out:
        result = {"rows": rows, "load": f"{load[0]:.1f} at the start, {load[1]:.1f} at the end"}
        Path(out).write_text(json.dumps(result, indent=1) + "\n")


# A replica's store client on host 1, the store on host 0: after the link is cut, one request on the
# open connection (its answer never comes) and one that must connect again, each made with a step
# attempt's deadline, print how far past the deadline they ended.
DEADLINE_CLIENT = r"""
import json, os, sys, time
from datetime import timedelta
from gang.ft.quorum import StepDeadlineError, StoreClient
client = StoreClient(sys.argv[1], int(sys.argv[2]), retry=30.0, timeout=timedelta(seconds=3))
client.peek("k")
print("ready", flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.01)
past, errors = [], []
for budget in (0.5, 1.5, 1.0):
    client.deadline = time.monotonic() + budget
    try:
        client.peek("k")
    except StepDeadlineError as ex:
        past.append(time.monotonic() - client.deadline)
        errors.append(str(ex))
print("past", json.dumps([past, errors]), flush=True)
"""


def test_a_store_request_over_a_cut_link_ends_at_the_step_attempts_deadline(tmp_path: Path) -> None:
    # Neither the kernel's TCP_USER_TIMEOUT (checked only when it retransmits) nor torch's connect
    # (it retries past the timeout it is given) ends a request by the deadline on its own: the first
    # request waits for its answer on the socket (SO_RCVTIMEO), the others connect on a thread.
    go = tmp_path / "go"
    with TestHosts(2, prefix="dl") as hosts:
        cmd = [sys.executable, "-m", "gang.ft.store", "--host", "0.0.0.0", "--port", STORE_PORT]
        store = hosts[0].popen([*cmd, "--port-file", str(tmp_path / "port")])
        deadline = time.monotonic() + 60
        while not (tmp_path / "port").exists():
            assert time.monotonic() < deadline, "the store did not listen"
            time.sleep(0.05)
        client = hosts[1].popen(
            [sys.executable, "-c", DEADLINE_CLIENT, hosts[0].address, STORE_PORT, str(go)], stdout=subprocess.PIPE
        )
        assert client.stdout is not None
        while "ready" not in client.stdout.readline():
            assert client.poll() is None, "the client ended before it was ready"
        hosts.cut(0)
        time.sleep(0.3)
        go.touch()
        while not (line := client.stdout.readline()).startswith("past "):  # its output and torch's warnings
            assert line, "the client ended without its result"
        past, errors = json.loads(line.removeprefix("past "))
        client.wait(30)
        store.kill()
        assert hosts.leaks() == []
    report("store requests over a cut link: the latest end past the step attempt's deadline", max(past))
    assert len(errors) == 3, errors  # every request ended with StepDeadlineError
    # The first request's answer was waited for on the socket, with what was left (torch's
    # "Socket Timeout"), not until the kernel gave the unacknowledged request up ("Connection
    # timed out", at a retransmission after the deadline).
    assert "Socket Timeout" in errors[0], errors
    assert "the step attempt's deadline passed" in errors[0], errors
