"""The choice of the address (and gloo's interface) other hosts reach this process at, on this
machine's own interfaces (the cases across hosts run on test hosts: ``tests/hosts``)."""

from __future__ import annotations

import socket

import pytest

from gang import address
from gang.address import GLOO_SOCKET_IFNAME, gloo_env, is_loopback_address, outward_address


def test_a_rendezvous_on_loopback_stays_on_loopback() -> None:
    assert outward_address("127.0.0.1") == "127.0.0.1"
    # An IP address in 127.0.0.0/8 or `localhost`: every process is on this machine, even when the
    # launcher says several hosts (nodes simulated on one machine).
    assert is_loopback_address(outward_address("127.0.0.1", several_hosts=True))
    assert is_loopback_address(outward_address("localhost", several_hosts=True))


def test_a_name_that_resolves_to_loopback_here_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host's own name mapped to loopback (Debian's 127.0.1.1): one host, loopback; several
    hosts, the address of the default route's interface (here: 192.0.2.1's route is looked up)."""
    # The route lookups (the interface's address toward a host), as on such a host.
    routes = {"thishost": "127.0.0.1", "192.0.2.1": "10.0.0.5"}
    monkeypatch.setattr(address, "local_address", routes.__getitem__)
    assert outward_address("thishost") == "127.0.0.1"
    assert outward_address("thishost", several_hosts=True) == "10.0.0.5"


def test_gloo_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GLOO_SOCKET_IFNAME, raising=False)
    names = {name for _, name in socket.if_nameindex()}
    expected = {GLOO_SOCKET_IFNAME: "lo"} if "lo" in names else {}
    assert gloo_env("127.0.0.1") == expected
    monkeypatch.setenv(GLOO_SOCKET_IFNAME, "eth7")  # the user's choice is left as it is
    assert gloo_env("127.0.0.1") == {}
    assert address.user_gloo_interface() == "eth7"
