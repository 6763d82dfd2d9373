"""A fault-tolerant job on one machine stays on loopback (127.0.0.0/8): its store, every process's
death signal, and every other TCP socket of every process (gloo's pairs included).

The job is started by the fault-tolerance example's own launch path (``examples/_ft_launch.py``'s
``LocalJob``, as ``python examples/fault_tolerance.py`` runs it), with the example's replicas.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from gang._torch_groups import TCPStore
from gang.ft.identity import check_liveness_address
from gang.ft.liveness import ROUTE, listen_address
from gang.ft.quorum import _key
from gang.testing import LOOPBACK, non_loopback_sockets
from gang.testing import is_loopback as _is_loopback

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from _ft_launch import LocalJob, matching  # noqa: E402

REPLICAS = 3


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def test_a_local_fault_tolerant_job_publishes_and_uses_loopback_addresses_only() -> None:
    with LocalJob(echo=False) as job:
        store = job.start_store()
        assert _is_loopback(_host(store)), store  # the address handed to every replica
        example = [str(EXAMPLES / "fault_tolerance.py"), "--steps", "100000", "--pace", "0.01"]
        for replica in range(REPLICAS):
            job.start(f"replica {replica}", example, {"GANG_FT_STORE": store, "GANG_FT_REPLICA_ID": str(replica)})
        in_full_quorum: set[str] = set()  # every replica is in a quorum of 3: its gloo pairs and watches are up
        while len(in_full_quorum) < REPLICAS:
            in_full_quorum.add(job.expect(matching(rf"quorum .* of {REPLICAS}$"), timeout=180).name)
        outside = [found for name in job.names() for found in non_loopback_sockets(job.pid(name))]
        assert outside == []
        client = TCPStore(_host(store), int(store.rpartition(":")[2]), is_master=False, timeout=timedelta(seconds=30))
        for replica in range(REPLICAS):  # the address each process publishes for its death signal
            claim = client.get(_key("id", replica, 0)).decode().split(" ")
            assert len(claim) == 4 and _is_loopback(_host(claim[3])), claim


def test_the_death_signal_listens_where_it_is_told() -> None:
    assert listen_address(LOOPBACK) == (LOOPBACK, LOOPBACK)
    assert listen_address("localhost") == (LOOPBACK, LOOPBACK)
    name = socket.gethostname()
    if _is_loopback(name):  # a host that maps its own name to loopback (127.0.0.1 or Debian's 127.0.1.1)
        bind, shown = listen_address(name)
        assert bind == shown and _is_loopback(shown)
    bind, shown = listen_address(LOOPBACK, ROUTE)  # the explicit multi-host choice
    assert bind in ("0.0.0.0", "::") and shown
    assert listen_address(LOOPBACK, "127.0.0.2") == ("127.0.0.2", "127.0.0.2")


def test_the_liveness_address_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GANG_FT_LIVENESS_ADDRESS", raising=False)
    assert check_liveness_address(None) is None
    assert check_liveness_address("route") == ROUTE
    assert check_liveness_address("::1") == "::1"
    with pytest.raises(ValueError, match=r"`liveness_address` must be 'route' or an IP address.*, but is 'eth0'"):
        check_liveness_address("eth0")
    with pytest.raises(TypeError, match=r"`liveness_address` must be a `str`, but is 5 instead"):
        check_liveness_address(5)
    monkeypatch.setenv("GANG_FT_LIVENESS_ADDRESS", "nowhere")
    with pytest.raises(ValueError, match=r"`GANG_FT_LIVENESS_ADDRESS` must be 'route' or an IP address"):
        check_liveness_address(None)
    assert os.environ["GANG_FT_LIVENESS_ADDRESS"] == "nowhere"
