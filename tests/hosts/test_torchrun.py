"""torchrun as two nodes of two processes on two test hosts, ``MASTER_ADDR`` given as the first
host's name and no variable naming an interface: the default gang, the layouts (tp inside a host,
dp across), JaxGang, and one FSDP2 + tensor-parallel step equal to ``init_device_mesh``'s."""

from __future__ import annotations

from pathlib import Path

from hosts_workers import PY, assert_contained, env, finish, results

from gang.testing import TestHosts

WORKER = str(Path(__file__).with_name("torchrun_worker.py"))
PORT = 29400


def test_torchrun_two_hosts(tmp_path: Path) -> None:
    # Each host resolves its own name to 127.0.1.1 (as many distributions do), the other's to its
    # address: whatever binds to "this host's name" binds to loopback.
    with TestHosts(2, own_name="loopback") as hosts:
        command = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
        rendezvous = ["--master-addr", hosts[0].name, "--master-port", str(PORT), "--max-restarts", "0"]
        agents = [
            h.popen([*command, *rendezvous, "--node-rank", str(h.index), WORKER, str(tmp_path)], env=env())
            for h in hosts
        ]
        finish(agents)
        found = sorted(results(tmp_path, "torchrun-*.json"), key=lambda r: r["helpers"][0])
        assert [r["helpers"][:2] for r in found] == [[rank, 4] for rank in range(4)]
        assert [r["node"] for r in found] == [0, 0, 1, 1]
        assert {r["address"][0] for r in found} == {"host0"}
        for r in found:
            assert r["root_members"] == [[0, 0], [1, 0], [2, 1], [3, 1]]
            assert len({node for _, node in r["tp"]["members"]}) == 1  # tp inside a host
            assert sorted(node for _, node in r["dp"]["members"]) == [0, 1]  # dp across the hosts
            assert sorted(node for _, node in r["rdp"]["members"]) == [0, 1]
            assert r["tp"]["sum"] == 2 and r["rdp"]["sum"] == 2 and r["again"]["sum"] == 4
            assert r["jax"]["size"] == 4 and r["jax"]["members"] == r["root_members"]
        parity = results(tmp_path, "parity-*.json")
        assert len(parity) == 4
        for p in parity:
            assert p["ours"] == p["reference"] and len(p["ours"]) == 1, p
        assert sorted(p["host"] for p in parity) == ["host0", "host0", "host1", "host1"]
        assert_contained(hosts)
