"""gang.ft on real processes: a store process, replica processes, SIGKILL and SIGSTOP.

Every scenario starts ``python -m gang.ft.store`` and replicas running ``ft_workers.py`` (one
process each, or one torchrun of 2 processes each), injects a failure with a real signal at a
point the replica reports in its log, and then checks:

- every committed step was committed by every replica that logged it with the same members and
  bit-identical parameters;
- the final parameters equal a single-process replay (``ft_workers.reference``) of the committed
  steps with the same data and the same membership schedule;
- the expected replicas finished (or raised the expected ``GangError``), and no process is left.

Replicas wait at step 1 until all of them have joined, so the membership schedule depends only
on the injected failures. The timeouts are short (3 s); nothing asserts wall-clock bounds. The
store and the one-process replicas are forked from ``gang.testing``'s fork server, which has
imported torch already (``forked.py``): real processes, started without importing torch again;
torchrun and its workers are started as commands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
import torch
from forked import Forked, can_fork
from ft_workers import reference

from gang._torch_groups import TCPStore
from gang.ft.quorum import ROOT
from gang.testing import free_port

WORKER = Path(__file__).parent / "ft_workers.py"
STEPS = 8
TIMEOUT = "3"  # seconds: the gang timeout of every replica
HEARTBEAT_TIMEOUT = "3"  # seconds: their heartbeat timeout (above the default, for a loaded machine)
WAIT = 180.0  # the harness's bound on waiting for one event (a loaded 2-core machine)


class Cluster:
    """A store process and replica processes, each replica logging JSON lines to its own file."""

    script: tuple[str, ...] = ()
    """What replicas run instead of ``ft_workers.py``: a script and its first arguments (empty: ``ft_workers.py``)."""
    bulky: tuple[str, ...] = ("params",)
    """The fields of log events that :meth:`dump` leaves out."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes] | Forked] = []
        self.logs: dict[str, list[Path]] = {}
        self.store = self._serve("0")
        self.address = "127.0.0.1:" + self._port_file.read_text().strip().rpartition(":")[2]

    def _serve(self, port: str) -> subprocess.Popen[bytes] | Forked:
        """Start ``python -m gang.ft.store`` on ``port`` and wait until it listens."""
        self._port_file = self.root / f"store.{len(self.procs)}.port"
        cmd = [sys.executable, "-m", "gang.ft.store", "--port", port, "--host", "127.0.0.1"]
        proc = self._popen([*cmd, "--port-file", str(self._port_file)], os.environ.copy())
        self._until(lambda: self._port_file.exists(), "the store to listen")
        return proc

    def restart_store(self) -> None:
        """Kill the store (SIGKILL) and start a new one on the same port."""
        self.store.kill()
        self.store.wait()
        self.procs.remove(self.store)
        self.store = self._serve(self.address.rpartition(":")[2])
        self.procs.insert(0, self.procs.pop())

    def _popen(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | Forked:
        """Start ``cmd``: forked from the fork server (a replica or a store), or anew (torchrun)."""
        proc: subprocess.Popen[bytes] | Forked
        if self.script and str(WORKER) in cmd:
            at = cmd.index(str(WORKER))
            cmd = [*cmd[:at], *self.script, *cmd[at + 1 :]]
        if can_fork(cmd):
            proc = Forked(cmd, env, self.root / f"stderr.{len(self.procs)}")
        else:
            with (self.root / f"stderr.{len(self.procs)}").open("wb") as stderr:
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(
        self,
        rid: str,
        *,
        pause: str = "",
        nproc: int = 1,
        nnodes: int = 1,
        pause_rank: int | None = None,
        min_replicas: int = 1,
        steps: int = STEPS,
        timeout: str = TIMEOUT,
        seeded: bool = False,
        checkpoint: Path | None = None,
        name: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes] | Forked:
        """Start one incarnation of replica ``rid``: a torchrun of ``nproc`` processes if
        ``nproc > 1``, split over ``nnodes`` torchrun agents (nodes, static rendezvous on
        loopback). ``name`` logs under another name than ``rid`` (a process that is not one of
        the replica's incarnations, such as a duplicate); ``env`` adds variables."""
        key = name or rid
        incarnation = len(self.logs.setdefault(key, []))
        log = self.root / f"{key}.{incarnation}.log"
        env = (
            os.environ
            | {
                "GANG_FT_REPLICA_ID": rid,
                "GANG_FT_STORE": self.address,
                "FT_TIMEOUT": timeout,
                "FT_HEARTBEAT_TIMEOUT": HEARTBEAT_TIMEOUT,
                "FT_MIN_REPLICAS": str(min_replicas),
                "FT_PAUSE": pause,
                "FT_GATE": "1",
                "FT_SEEDED": "1" if seeded else "0",
                "FT_CHECKPOINT": "" if checkpoint is None else str(checkpoint),
                "OMP_NUM_THREADS": "1",
            }
            | (env or {})
        )
        if pause_rank is not None:
            env["FT_PAUSE_RANK"] = str(pause_rank)
        if nproc == 1:
            size = int(env.get("GANG_FT_REPLICA_SIZE", "1"))
            self.logs[key].append(log if size == 1 else Path(f"{log}.rr{env['GANG_FT_REPLICA_RANK']}"))
            return self._popen([sys.executable, str(WORKER), str(log), str(steps)], env)
        self.logs[key].extend(Path(f"{log}.rr{k}") for k in range(nproc))
        if nnodes == 1:
            return self._popen(self._torchrun(["--standalone", f"--nproc-per-node={nproc}"], log, steps), env)
        port = str(free_port())
        for node in range(nnodes):
            nodes = [f"--nnodes={nnodes}", f"--node-rank={node}", f"--nproc-per-node={nproc // nnodes}"]
            nodes += ["--master-addr=127.0.0.1", f"--master-port={port}"]
            proc = self._popen(self._torchrun(nodes, log, steps), env)
        return proc

    @staticmethod
    def _torchrun(args: list[str], log: Path, steps: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *args,
            "--max-restarts=0",
            str(WORKER),
            str(log),
            str(steps),
        ]

    # -- observing -----------------------------------------------------------------------------

    @staticmethod
    def events(log: Path) -> list[dict[str, Any]]:
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]

    def current(self, rid: str) -> list[Path]:
        """The logs of the latest incarnation of ``rid`` (one per replica rank)."""
        logs = self.logs[rid]
        latest = logs[-1].name.split(".")[1]
        return [p for p in logs if p.name.split(".")[1] == latest]

    def wait(self, rid: str, event: str, step: int | None = None, rank: int | None = None) -> dict[str, Any]:
        """Wait until ``rank`` (default: every replica rank) of ``rid``'s latest incarnation logged ``event``."""
        found: list[dict[str, Any]] = []
        logs = self.current(rid) if rank is None else [self.current(rid)[rank]]

        def seen() -> bool:
            found.clear()
            for log in logs:
                match = [e for e in self.events(log) if e["event"] == event and (step is None or e.get("step") == step)]
                if not match:
                    return False
                found.append(match[0])
            return True

        self._until(seen, f"replica {rid} to log {event} {step}")
        return found[0]

    def release(self, rid: str, event: str, step: int) -> None:
        for log in self.current(rid):
            Path(f"{log}.release.{event}.{step}").touch()

    def start_all(
        self, pauses: dict[str, str], steps: dict[str, int] | None = None, first: int = 1, **kwargs: Any
    ) -> None:
        """Start replicas (ids mapped to their pauses; ``steps`` overrides how many steps some
        train) and let them begin step ``first`` once all joined."""
        rids = list(pauses)
        for rid, pause in pauses.items():
            self.start(rid, pause=pause, steps=(steps or {}).get(rid, STEPS), **kwargs)
        for rid in rids:
            self.wait(rid, "paused", first)
        for rid in rids:
            self.release(rid, "enter", first)

    def pid(self, rid: str, rank: int = 0) -> int:
        return int(self.wait(rid, "joined", rank=rank)["pid"])

    def signal(self, rid: str, sig: signal.Signals, rank: int = 0) -> None:
        os.kill(self.pid(rid, rank), sig)

    def wait_beating(self, rid: str) -> None:
        """Wait until replica ``rid``'s process heartbeats again (a continued process's first
        heartbeats may come after the others decide their next round, which then does not
        wait for it: a real race, but not the one a scenario tests)."""
        host, _, port = self.address.rpartition(":")
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        key = f"{ROOT}hb/{rid}/0"

        def fresh() -> bool:
            stamp = store.get(key).decode().split(" ")[0]
            return stamp not in ("left", "dead") and time.time() - float(stamp) < 0.5

        self._until(fresh, f"replica {rid}'s heartbeat")

    def _until(self, condition: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; logs:\n{self.dump()}")
            time.sleep(0.02)

    def finish(self, expect: dict[str, int]) -> None:
        """Wait for every replica process; ``expect`` maps replica ids to 0 (they must finish
        training) or 3 (they must end with a ``GangError``), as their last log line shows."""
        deadline = time.monotonic() + WAIT
        for proc in self.procs[1:]:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"replica process {proc.args!r} did not end; logs:\n{self.dump()}") from None
        for rid, code in expect.items():
            last = [e for log in self.current(rid) for e in self.events(log) if e["event"] in ("done", "error")]
            kinds = {e["event"] for e in last}
            assert kinds == ({"done"} if code == 0 else {"error"}), f"replica {rid}: {last}\n{self.dump()}"

    def logged_pids(self) -> set[int]:
        """Every process a replica logged from (torchrun's workers included)."""
        return {e["pid"] for logs in self.logs.values() for log in logs for e in self.events(log)}

    def leftovers(self) -> list[int]:
        """The replica processes still running (or stopped): launched ones and every logged one."""
        launched = {p.pid: p for p in self.procs[1:]}
        left = [pid for pid, p in launched.items() if p.poll() is None]
        for pid in self.logged_pids() - launched.keys():
            with suppress(FileNotFoundError):  # a gone process has no /proc entry; a zombie is gone too
                if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                    left.append(pid)
        return left

    def close(self) -> None:
        # torchrun's workers live in their own process groups: kill every pid a replica logged.
        for logs in self.logs.values():
            for log in logs:
                for pid in {e["pid"] for e in self.events(log)}:
                    try:
                        os.kill(pid, signal.SIGCONT)
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # a forked process not yet in a session of its own
                    with suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def dump(self) -> str:
        lines = []
        for logs in self.logs.values():
            for log in logs:
                for e in self.events(log):
                    for key in self.bulky:
                        e.pop(key, None)
                    lines.append(f"{log.name}: {e}")
        lines = lines[-200:]
        for path in sorted(self.root.glob("stderr.*")):  # why a process ended or never logged
            tail = path.read_text(errors="replace").splitlines()[-20:]
            lines += [f"{path.name}: {line}" for line in tail]
        return "\n".join(lines)

    # -- the checks --------------------------------------------------------------------------------

    def check_training(self, finishers: list[str], steps: int = STEPS) -> dict[int, list[str]]:
        """Check the invariants over every log (``steps`` committed steps); return the membership
        schedule of the committed steps."""
        by_step: dict[int, dict[int, dict[str, Any]]] = {}
        shards: dict[int, int] = {}
        for logs in self.logs.values():
            for log in logs:
                shard = int(log.name.rpartition(".rr")[2]) if ".rr" in log.name else 0
                shards[shard] = 1
                for e in self.events(log):
                    if e["event"] != "commit":
                        continue
                    key = (e["step"], shard)
                    seen = by_step.setdefault(e["step"], {}).setdefault(shard, e)
                    assert seen["members"] == e["members"], (key, seen["members"], e["members"])
                    assert seen["params"] == e["params"], f"step {key}: parameters differ between {log.name} and others"
        schedule = [by_step[s][0]["members"] for s in range(1, steps + 1)]
        expected = reference(schedule).chunk(len(shards))
        for rid in finishers:
            for k, log in enumerate(sorted(self.current(rid))):
                done = [e for e in self.events(log) if e["event"] == "done"]
                assert done and done[0]["step"] == steps, (rid, done)
                final = torch.tensor(done[0]["params"])
                assert torch.equal(final, expected[k]), f"replica {rid} shard {k} differs from the reference"
        return dict(enumerate(schedule, start=1))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
        # Before the cleanup below kills everything: every process the test started or a
        # replica logged (torchrun's workers too) must have ended by itself.
        leftovers = c.leftovers()
    finally:
        c.close()
    assert not leftovers, f"processes left running: {leftovers}"


ALL = ["0", "1", "2", "3"]


def _members_after(schedule: dict[int, list[str]], step: int) -> set[tuple[str, ...]]:
    return {tuple(m) for s, m in schedule.items() if s >= step}


@pytest.mark.parametrize("point", ["collective", "enter", "vote"])
def test_one_of_four_killed(cluster: Cluster, point: str) -> None:
    # The gang timeout is 10 minutes: the dead replica must be dropped on its death signal or its
    # heartbeat silence, not on the gang timeout (the harness would give up first).
    # `collective`: replica 2 forks a child that holds its gloo sockets open (a data-loader
    # worker), then is killed inside step 3, before the gradient exchange: the others block in it
    # with no error from gloo. The child closed its copy of the death signal's sockets at the fork,
    # so replica 1, which watches replica 2, sees it die and aborts the step. `enter`: it is
    # killed before step 3, while the others wait for it in the quorum. `vote`: it is killed after
    # step 3's collectives, before its vote, while the others wait for the decision (each in one
    # blocking request): the heartbeat thread of replica 1, watching the vote, sees it die and
    # writes `abort`, which ends their waits. Each way step 3 commits without it.
    pause = {"collective": "fork:3,collective:3", "enter": "enter:3", "vote": "vote:3"}[point]
    cluster.start_all({"0": "", "1": "", "2": pause, "3": ""}, timeout="600")
    cluster.wait("2", "paused", 3)
    cluster.signal("2", signal.SIGKILL)
    if point == "collective":
        child = int(cluster.wait("2", "forked")["child"])
        try:
            for rid in ("0", "1", "3"):
                cluster.wait(rid, "commit", 3)
        finally:
            os.kill(child, signal.SIGKILL)  # the abandoned exchange ends (its group is destroyed)
        # Replica 1 watches replica 2 (the next member): it saw the death and aborted the step.
        assert any("replica '2' rank 0 of the quorum died" in e for e in _aborted(cluster, "1", 3)), _aborted(
            cluster, "1", 3
        )
        died = [e["ft"] for e in cluster.events(cluster.current("1")[0]) if e["event"] == "ft_log"]
        assert [f for f in died if f["event"] == "died" and f["replica"] == "2"], died
    cluster.finish({"0": 0, "1": 0, "3": 0})
    schedule = cluster.check_training(["0", "1", "3"])
    assert schedule[1] == ALL and schedule[2] == ALL
    assert _members_after(schedule, 3) == {("0", "1", "3")}
    if point == "vote":  # the step replica 2 died in was aborted on every survivor, then retried without it
        assert all(len(_aborted(cluster, rid, 3)) == 1 for rid in ("0", "1", "3"))


def _aborted(cluster: Cluster, rid: str, step: int) -> list[str]:
    """The errors ``rid`` recorded in the uncommitted attempts at ``step``."""
    return [
        e["error"]
        for log in cluster.current(rid)
        for e in cluster.events(log)
        if e["event"] == "abort" and e["step"] == step
    ]


def test_two_killed_at_once(cluster: Cluster) -> None:
    cluster.start_all({"0": "", "1": "collective:3", "2": "", "3": "collective:3"})
    cluster.wait("1", "paused", 3)
    cluster.wait("3", "paused", 3)
    cluster.signal("1", signal.SIGKILL)
    cluster.signal("3", signal.SIGKILL)
    cluster.finish({"0": 0, "2": 0})
    schedule = cluster.check_training(["0", "2"])
    assert _members_after(schedule, 3) == {("0", "2")}
    assert _aborted(cluster, "0", 3), "step 3 should have failed once on the survivors"


def test_sigstop_hang_then_heal_back(cluster: Cluster) -> None:
    # Replica 1 hangs (SIGSTOP) just before the gradient exchange of step 3. A stopped process
    # keeps its sockets open: the gang timeout is 10 minutes, so the others must stop waiting on
    # its heartbeat's silence. They drop it and go on. Continued, it finds itself dropped, heals
    # and rejoins.
    cluster.start_all({"0": "enter:6", "1": "collective:3", "2": "enter:6", "3": "enter:6"}, timeout="600")
    cluster.wait("1", "paused", 3)
    cluster.signal("1", signal.SIGSTOP)
    cluster.release("1", "collective", 3)
    for rid in ("0", "2", "3"):
        cluster.wait(rid, "paused", 6)  # survivors committed step 5 without replica 1
    cluster.signal("1", signal.SIGCONT)
    cluster.wait_beating("1")
    for rid in ("0", "2", "3"):
        cluster.release(rid, "enter", 6)
    cluster.finish({"0": 0, "1": 0, "2": 0, "3": 0})
    schedule = cluster.check_training(ALL)
    assert schedule[3] == ["0", "2", "3"]
    assert schedule[STEPS] == ALL
    assert [e for e in cluster.events(cluster.current("1")[0]) if e["event"] == "healed" and e["behind"] == 2]
    # Replica 0 watches replica 1 (the next member): it saw the silence and aborted the step.
    assert any("was silent for" in e for e in _aborted(cluster, "0", 3)), _aborted(cluster, "0", 3)


def test_restarted_replica_heals_and_rejoins(cluster: Cluster) -> None:
    cluster.start_all({"0": "enter:6", "1": "enter:6", "2": "collective:3", "3": "enter:6"})
    cluster.wait("2", "paused", 3)
    cluster.signal("2", signal.SIGKILL)
    for rid in ("0", "1", "3"):
        cluster.wait(rid, "paused", 6)
    cluster.start("2")  # the same replica id, a fresh process at step 0
    cluster.wait("2", "paused", 1)
    cluster.release("2", "enter", 1)
    for rid in ("0", "1", "3"):
        cluster.release(rid, "enter", 6)
    cluster.finish({"0": 0, "1": 0, "2": 0, "3": 0})
    schedule = cluster.check_training(ALL)
    assert schedule[5] == ["0", "1", "3"] and schedule[6] == ALL
    healed = cluster.wait("2", "healed")
    first = next(e for e in cluster.events(cluster.current("2")[0]) if e["event"] == "commit")
    assert first["step"] == 6 and healed["t"] <= first["t"]


def test_new_replica_joins_and_healer_killed_during_healing(cluster: Cluster) -> None:
    # Replicas 0-2 train; a brand-new replica 3 joins before step 4. Replica 0 (the healer: the
    # lowest rank at the highest step) is killed inside `state_dict()` while it prepares the heal;
    # the step fails everywhere, and the next quorum heals replica 3 from replica 1.
    cluster.start_all({"0": "enter:4,heal:4", "1": "enter:4", "2": "enter:4"})
    for rid in ("0", "1", "2"):
        cluster.wait(rid, "paused", 4)
    cluster.start("3")
    cluster.wait("3", "paused", 1)
    cluster.release("3", "enter", 1)
    for rid in ("0", "1", "2"):
        cluster.release(rid, "enter", 4)
    cluster.wait("0", "paused", 4)
    cluster.signal("0", signal.SIGKILL)
    cluster.finish({"1": 0, "2": 0, "3": 0})
    schedule = cluster.check_training(["1", "2", "3"])
    assert schedule[3] == ["0", "1", "2"]
    # Replica 3 waits out the failed heal in a gloo receive (its broadcast parent is not the dead
    # healer, so it sees no closed socket) for the gang timeout, while 1 and 2 wait for it in the
    # next quorum for the same timeout: it rejoins at step 4 or, losing that race, at step 5.
    joined = min(s for s, members in schedule.items() if s >= 4 and "3" in members)
    assert joined in (4, 5), schedule
    assert all(members == ["1", "2", "3"] for s, members in schedule.items() if s > joined)
    assert all(members == ["1", "2"] for s, members in schedule.items() if 4 <= s < joined)
    healed = cluster.wait("3", "healed")
    first = next(e for e in cluster.events(cluster.current("3")[0]) if e["event"] == "commit")
    assert first["step"] == joined and healed["t"] <= first["t"]


def test_fewer_than_min_replicas_raises_naming_the_quorum(cluster: Cluster) -> None:
    cluster.start_all({"0": "", "1": "collective:3", "2": ""}, min_replicas=3)
    cluster.wait("1", "paused", 3)
    cluster.signal("1", signal.SIGKILL)
    cluster.finish({"0": 3, "2": 3})
    for rid in ("0", "2"):
        error = cluster.wait(rid, "error")["error"]
        assert f"replica '{rid}'" in error and "quorum" in error and "`min_replicas`=3" in error, error
        assert "['0', '2']" in error, error


def test_spares_policy_a_spare_steps_in_when_a_member_dies(cluster: Cluster) -> None:
    # `SparesPolicy(2)` over 3 replicas: 0 and 1 step, 2 waits as a spare inside its first
    # `step()`, leading the next round while the members step. Their step 2 lasts longer than
    # `quorum_timeout` (3 s): the spare's round waits for them. Replica 1 is killed inside step 3:
    # the spare steps in, healed by 0, and every step's average has 2 terms.
    cluster.start_all({"0": "collective:2", "1": "collective:2,collective:3", "2": ""}, env={"FT_SPARES": "2"})
    for rid in ("0", "1"):
        cluster.wait(rid, "paused", 2)
    time.sleep(4.5)  # the members' long step
    for rid in ("0", "1"):
        cluster.release(rid, "collective", 2)
    cluster.wait("1", "paused", 3)
    assert not [e for e in cluster.events(cluster.current("2")[0]) if e["event"] in ("collective", "commit")]
    cluster.signal("1", signal.SIGKILL)
    cluster.finish({"0": 0, "2": 0})
    schedule = cluster.check_training(["0", "2"])
    assert schedule[1] == schedule[2] == ["0", "1"], schedule
    assert _members_after(schedule, 3) == {("0", "2")}, schedule
    healed = cluster.wait("2", "healed")
    first = next(e for e in cluster.events(cluster.current("2")[0]) if e["event"] == "commit")
    assert healed["behind"] == 0 and first["step"] == 3 and healed["t"] <= first["t"]


def test_store_dies_every_replica_raises(cluster: Cluster) -> None:
    cluster.start_all({"0": "enter:3", "1": "enter:3", "2": "enter:3"})
    for rid in ("0", "1", "2"):
        cluster.wait(rid, "paused", 3)
    cluster.store.kill()
    cluster.store.wait()
    for rid in ("0", "1", "2"):
        cluster.release(rid, "enter", 3)
    cluster.finish({"0": 3, "1": 3, "2": 3})
    for rid in ("0", "1", "2"):
        error = cluster.wait(rid, "error")["error"]
        assert "coordination store" in error and f"replica '{rid}'" in error, error


def test_multi_process_replicas_one_process_killed(cluster: Cluster) -> None:
    # Three replicas of 2 processes (one torchrun each, a tensor-parallel gang inside). Local
    # rank 1 of replica 1 is killed mid-step: torchrun ends its replica, which is dropped whole.
    cluster.start_all({"0": "", "1": "collective:3", "2": ""}, nproc=2, pause_rank=1)
    cluster.wait("1", "paused", 3, rank=1)
    cluster.signal("1", signal.SIGKILL, rank=1)
    cluster.finish({"0": 0, "2": 0})
    schedule = cluster.check_training(["0", "2"])
    assert schedule[2] == ["0", "1", "2"]
    assert _members_after(schedule, 3) == {("0", "2")}


def test_closed_replica_leaves_the_quorum_at_once(cluster: Cluster) -> None:
    # The gang timeout is 10 minutes here: had `close()` not left the quorum, the others would
    # wait that long for replica 2 before going on, and the harness would give up first.
    cluster.start_all({"0": "", "1": "", "2": ""}, steps={"2": 4}, timeout="600")
    cluster.finish({"0": 0, "1": 0, "2": 0})
    schedule = cluster.check_training(["0", "1"])
    assert schedule[4] == ["0", "1", "2"]
    assert _members_after(schedule, 5) == {("0", "1")}


def test_init_sync_then_a_job_restored_from_its_checkpoints(cluster: Cluster) -> None:
    # Replicas 1 and 2 start from their own random parameters: at step 1 they adopt replica 0's
    # (`init_sync`; without it, step 1's parameters would differ between replicas). The job stops
    # after step 4 with a checkpoint per replica (parameters and `gang.state_dict()`); a new job
    # restored from them continues at step 5 and, over both jobs, equals the reference replay
    # from replica 0's start. Nothing is killed: the long timeout only keeps a replica slowed
    # down by a loaded machine in every quorum.
    ckpt = cluster.root / "ckpt"
    ckpt.mkdir()
    rids = {"0": "", "1": "", "2": ""}
    options: dict[str, Any] = {"seeded": True, "checkpoint": ckpt, "timeout": "20"}
    cluster.start_all(rids, steps=dict.fromkeys(rids, 4), **options)
    cluster.finish({})
    for rid in rids:
        events = cluster.events(cluster.current(rid)[0])
        assert [e["step"] for e in events if e["event"] == "done"] == [4], events
        healed = [e["behind"] for e in events if e["event"] == "healed"]
        assert 0 not in healed if rid == "0" else healed[:1] == [0], (rid, healed)
    cluster.start_all(rids, first=5, **options)
    cluster.finish(dict.fromkeys(rids, 0))
    schedule = cluster.check_training(list(rids))
    assert schedule[1] == ["0", "1", "2"]
    for rid in rids:
        events = cluster.events(cluster.current(rid)[0])
        assert events[0]["event"] == "joined" and events[0]["step"] == 4, events[0]
        commits = [e["step"] for e in events if e["event"] == "commit"]
        assert commits[0] >= 5 and commits[-1] == 8, commits
        assert all(e["behind"] >= 4 for e in events if e["event"] == "healed"), events


def test_identity_two_node_replica_duplicate_and_a_process_that_never_joins(cluster: Cluster) -> None:
    # Replica 0 is one torchrun of 2 processes; replica 1 is two torchrun agents (`--nnodes 2`,
    # one process each, so both have LOCAL_RANK 0: they must still be replica ranks 0 and 1).
    # While they wait to begin step 1: a duplicate of replica 0's rank 1 is refused (and replica
    # 0 goes on), and replica 2 claims 2 processes but only its rank 0 ever joins: it must not
    # block the others, and is left out until it gives up. Every process joins with the same
    # policy (join refuses a newcomer whose policy differs from a live member's).
    cluster.start("0", nproc=2)
    cluster.start("1", nproc=2, nnodes=2)
    lonely = {"GANG_FT_REPLICA_RANK": "0", "GANG_FT_REPLICA_SIZE": "2"}
    cluster.start("2", env=lonely)
    for rid in ("0", "1", "2"):
        cluster.wait(rid, "paused", 1)
    cluster.start("0", name="dup", env={"GANG_FT_REPLICA_RANK": "1", "GANG_FT_REPLICA_SIZE": "2"})
    refused = cluster.wait("dup", "error")["error"]
    owner = cluster.pid("0", rank=1)
    assert "replica '0' rank 1 is already taken by a live process at" in refused and f":{owner};" in refused, refused
    for rid in ("0", "1", "2"):
        cluster.release(rid, "enter", 1)
    cluster.finish({"0": 0, "1": 0, "2": 3})
    schedule = cluster.check_training(["0", "1"])
    assert set(map(tuple, schedule.values())) == {("0", "1")}, schedule
    # Left out of every quorum while 0 and 1 trained, or alone after they finished: either way it
    # gives up with a GangError instead of waiting for its missing process for ever.
    left_out = cluster.wait("2", "error")["error"]
    assert "replica '2'" in left_out and ("was left out of every quorum" in left_out or "`min_replicas`=1" in left_out)


def test_store_killed_and_restarted_on_the_same_port_training_goes_on(cluster: Cluster) -> None:
    cluster.start_all({"0": "enter:4", "1": "enter:4", "2": "enter:4"}, env={"FT_QUORUM_TIMEOUT": "60"})
    for rid in ("0", "1", "2"):
        cluster.wait(rid, "paused", 4)
    cluster.restart_store()
    for rid in ("0", "1", "2"):
        cluster.release(rid, "enter", 4)
    cluster.finish({"0": 0, "1": 0, "2": 0})
    schedule = cluster.check_training(["0", "1", "2"])
    assert schedule[3] == ["0", "1", "2"]


def _events(cluster: Cluster, rid: str, event: str, rank: int = 0) -> list[dict[str, Any]]:
    return [e for e in cluster.events(cluster.current(rid)[rank]) if e["event"] == event]


def test_partial_heal_is_healed_again(cluster: Cluster) -> None:
    # Replicas of 2 processes. A new replica 2 joins before step 4 and is healed by replica 0
    # (the first up-to-date one). Replica 0's rank 0 sends its shard, but its rank 1 is still in
    # `state_dict()` when it is SIGKILLed (torchrun ends its rank 0): replica 2's rank 0 is at
    # step 3, its rank 1 at step 0. Up to date means every process: replica 2 must be healed
    # again (by replica 1), never taken as up to date with rank 1's stale shard.
    cluster.start_all({"0": "enter:4,heal:4@1", "1": "enter:4"}, nproc=2)
    for rid in ("0", "1"):
        cluster.wait(rid, "paused", 4)
    cluster.start("2", nproc=2)
    cluster.wait("2", "paused", 1)
    cluster.release("2", "enter", 1)
    for rid in ("0", "1"):
        cluster.release(rid, "enter", 4)
    cluster._until(lambda: any(e.get("at") == "heal" for e in _events(cluster, "0", "paused", 1)), "the heal pause")
    cluster.wait("2", "healed", rank=0)
    assert [e["behind"] for e in _events(cluster, "2", "healed", 0)] == [0]
    assert not _events(cluster, "2", "healed", 1)
    cluster.signal("0", signal.SIGKILL, rank=1)
    cluster.finish({"1": 0, "2": 0})
    schedule = cluster.check_training(["1", "2"])
    assert schedule[3] == ["0", "1"]
    assert all(members == ["1", "2"] for s, members in schedule.items() if s >= 4), schedule
    assert [e["behind"] for e in _events(cluster, "2", "healed", 0)] == [0, 3]  # healed again, whole
    assert [e["behind"] for e in _events(cluster, "2", "healed", 1)] == [0]


def test_restart_within_timeouts_is_healed_and_a_stalled_replica_is_waited_for_once(cluster: Cluster) -> None:
    # Replica 2 joins the quorum of step 3 (replica 1 leads it, replica 0 has not joined yet)
    # and is SIGKILLed there; its next incarnation, started beforehand and waiting at `start:0`,
    # joins the gang at once (it takes the identity over when the old heartbeat goes stale,
    # while the round is still open). The dead incarnation's join of that round must not count
    # for the new one: replica 2 must not be admitted at its old step 2 on its old group. Its
    # new incarnation heartbeats but waits at `enter:1`: with `quorum_timeout` 8 s the others wait
    # for it in one quorum (step 3; the one `stalled` event each logs on the `gang.ft` logger), then
    # leave it out (`stalled`) without waiting until it joins
    # again (at step 6, or 7 if the others formed the quorum of step 6 first), healed from its new
    # step 0.
    options: dict[str, Any] = {"env": {"FT_QUORUM_TIMEOUT": "8"}}
    cluster.start_all({"0": "enter:3,enter:6", "1": "enter:3,enter:6", "2": "enter:3"}, **options)
    old = cluster.pid("2")
    cluster.start("2", pause="start:0", **options)
    cluster.wait("2", "paused", 0)
    cluster.wait("1", "paused", 3)  # the round of step 3 opens only now, whatever the start-up took
    cluster.release("1", "enter", 3)
    time.sleep(0.5)  # replica 1 opens (leads) the round of step 3
    Path(f"{cluster.logs['2'][0]}.release.enter.3").touch()  # the old incarnation's pause
    time.sleep(1.0)  # the old replica 2 joins it
    os.kill(old, signal.SIGKILL)
    cluster.release("2", "start", 0)
    cluster.wait("2", "paused", 1)  # the new incarnation holds the identity and heartbeats
    cluster.release("0", "enter", 3)
    for rid in ("0", "1"):
        cluster.wait(rid, "paused", 6)
    cluster.release("2", "enter", 1)
    time.sleep(1.0)  # it joins (and leads) the round of step 6: a left-out replica is not waited for
    for rid in ("0", "1"):
        cluster.release(rid, "enter", 6)
    cluster.finish({"0": 0, "1": 0, "2": 0})
    schedule = cluster.check_training(["0", "1", "2"])
    # A left-out replica is not waited for: it rejoins at the first quorum formed after it joined.
    back = min(s for s, members in schedule.items() if s >= 3 and "2" in members)
    assert back in (6, 7), schedule
    assert schedule[2] == ["0", "1", "2"] and all(schedule[s] == ["0", "1", "2"] for s in range(back, STEPS + 1))
    assert all(schedule[s] == ["0", "1"] for s in range(3, back)), schedule
    for rid in ("0", "1"):
        assert not _events(cluster, rid, "abort"), _events(cluster, rid, "abort")  # no dead group reused
        stalled = {e["step"]: e["stalled"] for e in _events(cluster, rid, "collective")}
        expected = [["2"] if s < back else [] for s in range(3, STEPS + 1)]
        assert [stalled[s] for s in range(3, STEPS + 1)] == expected, stalled
        # Only one round waited out `quorum_timeout` for it (logged on the `gang.ft` logger).
        waited = [e["ft"] for e in _events(cluster, rid, "ft_log") if e["ft"]["event"] == "stalled"]
        assert [e["timed_out"] for e in waited] == [["2"]], waited
    healed = cluster.wait("2", "healed")
    first = _events(cluster, "2", "commit")[0]
    assert healed["behind"] == 0 and first["step"] == back and healed["t"] <= first["t"]
