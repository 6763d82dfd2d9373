"""``gang.ft`` across test hosts: three replicas on three hosts and the store on a fourth
(``python -m gang.ft.store --host 0.0.0.0``, the multi-host way), no variable naming an interface.

The cluster of ``tests/ft/test_ft.py`` (its replicas, logs and checks: after every committed step
bit-identical parameters on every member, equal to a replay of the logged membership), with its
processes started on the test hosts instead of loopback.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hosts_workers import assert_contained, env
from test_ft import Cluster

from gang.ft.quorum import _key
from gang.testing import HostProcess, TestHosts

REPLICAS = {"a": 0, "b": 1, "c": 2}  # replica id -> host
STORE_HOST = 3
LIVENESS = {"c": "route"}  # GANG_FT_LIVENESS_ADDRESS by replica: "a" and "b" use the default choice


class HostsCluster(Cluster):
    """:class:`test_ft.Cluster` with the store on host 3 and replica ``r`` on host ``REPLICAS[r]``
    (its death signal's address chosen as ``liveness`` says for ``r``, else by default)."""

    def __init__(self, root: Path, hosts: TestHosts, liveness: dict[str, str]) -> None:
        self.hosts = hosts
        self.liveness = liveness
        super().__init__(root)
        self.address = f"{hosts[STORE_HOST].name}:{self.address.rpartition(':')[2]}"

    def _serve(self, port: str) -> Any:
        self._port_file = self.root / f"store.{len(self.procs)}.port"
        cmd = [sys.executable, "-m", "gang.ft.store", "--port", port, "--host", "0.0.0.0"]
        proc = self.hosts[STORE_HOST].popen([*cmd, "--port-file", str(self._port_file)], env=env())
        self.procs.append(proc)  # type: ignore[arg-type]  # a Popen[str]: the cluster only waits and kills
        self._until(lambda: self._port_file.exists(), "the store to listen")
        return proc

    def _popen(self, cmd: list[str], environment: dict[str, str]) -> Any:
        rid = environment["GANG_FT_REPLICA_ID"]
        extra = {"GANG_FT_LIVENESS_ADDRESS": self.liveness[rid]} if rid in self.liveness else {}
        keep = {k: v for k, v in environment.items() if k.startswith(("GANG_FT_", "FT_"))}
        proc: HostProcess = self.hosts[REPLICAS[rid]].popen(cmd, env=env(**keep, **extra))
        self.procs.append(proc)  # type: ignore[arg-type]  # a Popen[str]: the cluster only waits and kills
        return proc

    def published(self, rid: str) -> str:
        """The address replica ``rid``'s death signal published in the store (read on the store's host)."""
        host, _, port = self.address.rpartition(":")
        read = (
            "import sys; from datetime import timedelta; from gang._torch_groups import TCPStore; "
            f"s = TCPStore({host!r}, {port}, is_master=False, timeout=timedelta(seconds=30)); "
            f"print(s.get({_key('id', rid, 0)!r}).decode())"
        )
        out = self.hosts[STORE_HOST].run([sys.executable, "-c", read], env=env(), timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()[3].rpartition(":")[0]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[HostsCluster]:
    with TestHosts(4, own_name="loopback") as hosts:
        c = HostsCluster(tmp_path, hosts, LIVENESS)
        try:
            yield c
            assert_contained(hosts)
        finally:
            c.close()


def test_three_replicas_on_three_hosts_a_kill_and_a_restart(cluster: HostsCluster) -> None:
    ids = list(REPLICAS)
    # The members wait up to `quorum_timeout` for a live replica that has not joined the round yet:
    # the restarted "b" must join step 6 even when its first entry takes longer than the 3 s
    # timeout on a loaded machine (a dead replica is not waited for: its death signal says so).
    waits = {"FT_QUORUM_TIMEOUT": "30"}
    cluster.start_all({"a": "enter:6", "b": "collective:3", "c": "enter:6"}, env=waits)
    # Each death signal publishes its host's own address, with the default choice ("a", "b") and
    # with "route" ("c").
    for rid, host in REPLICAS.items():
        assert cluster.published(rid) == cluster.hosts[host].address
    cluster.wait("b", "paused", 3)
    cluster.signal("b", signal.SIGKILL)
    for rid in ("a", "c"):
        cluster.wait(rid, "paused", 6)
    cluster.start("b", env=waits)  # a fresh process at step 0, on the same host
    cluster.wait("b", "paused", 1)
    cluster.release("b", "enter", 1)
    for rid in ("a", "c"):
        cluster.release(rid, "enter", 6)
    cluster.finish(dict.fromkeys(ids, 0))
    schedule = cluster.check_training(ids)
    assert schedule[1] == schedule[2] == ids  # steady training across the hosts
    assert schedule[5] == ["a", "c"] and schedule[6] == ids
    healed = cluster.wait("b", "healed")
    first = next(e for e in cluster.events(cluster.current("b")[0]) if e["event"] == "commit")
    assert first["step"] == 6 and healed["t"] <= first["t"]
