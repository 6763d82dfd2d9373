"""gang.ft.reach on real loopback sockets: who answers a connection, and reports dropped once it does;
and a process group built within a bound (gang.ft.group.build_within)."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import pytest
import torch

from gang._torch_groups import PrefixStore, StandaloneGroup, TCPStore, new_standalone_group, serve_store
from gang._torch_ops import TorchCalls
from gang.ft.group import build_within, reaper
from gang.ft.reach import RETRY, Reports, probe
from gang.ops import ReduceOperation


@contextmanager
def silent_listener() -> Iterator[tuple[str, socket.socket]]:
    """A loopback listener whose accept queue is full: the kernel drops the SYNs of a new
    connection, which stays unanswered (as to a host whose link is cut). Yields its address and
    the listening socket; accepting from it makes room."""
    server = socket.create_server(("127.0.0.1", 0), backlog=0)
    address = f"127.0.0.1:{server.getsockname()[1]}"
    fillers: list[socket.socket] = []
    try:
        for _ in range(8):  # the queue holds backlog + 1 connections; the rest wait for a SYN answer
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(server.getsockname())
            fillers.append(s)
        time.sleep(0.2)
        yield address, server
    finally:
        for s in fillers:
            s.close()
        server.close()


def test_probe_reports_only_what_does_not_answer_within_the_time() -> None:
    with socket.create_server(("127.0.0.1", 0)) as open_one:
        listening = f"127.0.0.1:{open_one.getsockname()[1]}"
        with socket.socket() as bound:  # a port nobody listens on: refused, so the host answered
            bound.bind(("127.0.0.1", 0))
            refused = f"127.0.0.1:{bound.getsockname()[1]}"
            with silent_listener() as (silent, _):
                started = time.monotonic()
                lost = probe({"a": listening, "b": refused, "c": silent, "d": "not-an-address"}, 0.5)
                took = time.monotonic() - started
    assert lost == {"c", "d"}
    assert took >= 0.5  # it waited for the silent one, and gave it up


def test_reports_are_probed_again_and_dropped_once_answered() -> None:
    reports = Reports()
    with silent_listener() as (silent, server):
        reports.add({"2": silent})
        assert reports.current() == frozenset({"2"})
        for _ in range(3):
            reports.poll()
            time.sleep(0.1)
        assert reports.current() == frozenset({"2"})  # still unanswered
        # The listener takes its queued connections from now on: a probe is answered, at the
        # latest when it is started anew (`RETRY`), and the report is dropped.
        server.setblocking(False)
        deadline = time.monotonic() + 20 * RETRY
        while reports.current() and time.monotonic() < deadline:
            with suppress(BlockingIOError):
                while True:
                    server.accept()[0].close()
            reports.poll()
            time.sleep(0.05)
        assert reports.current() == frozenset()
    reports.close()


def test_a_group_build_is_given_up_at_its_timeout_or_when_the_watch_raises() -> None:
    # A rendezvous of 2 where the peer never comes: torch's own wait would last its timeout (5 s).
    store = serve_store("127.0.0.1", timeout=timedelta(seconds=60))

    def make(prefix: str, size: int = 2) -> Callable[[], StandaloneGroup]:
        # A connection of its own, as gang.ft's: an abandoned build keeps waiting on its own.
        client = TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        rendezvous = PrefixStore(prefix, client)
        return lambda: new_standalone_group(rendezvous, 0, size, torch.device("cpu"), timedelta(seconds=5))

    started = time.monotonic()
    with pytest.raises(RuntimeError, match=re.escape("not built within the timeout of 0.5 s")):
        build_within(make("a"), 0.5, 0.05, lambda: None)
    assert time.monotonic() - started < 4  # not torch's 5 s

    def watch() -> None:
        raise RuntimeError("a member of the quorum aborted the step")

    with pytest.raises(RuntimeError, match="aborted the step"):
        build_within(make("b"), 30.0, 0.05, watch)
    alone = build_within(make("c", size=1), 30.0, 0.05, lambda: None)  # a group that can be built is returned
    assert alone.size() == 1
    reaper.drop(alone)


@pytest.mark.parametrize("operation", ["all_reduce", "all_gather_to_list", "all_to_all", "broadcast", "barrier"])
def test_a_standalone_collective_ends_at_the_calls_own_timeout(operation: str) -> None:
    # Two members of a standalone group in one process (threads); member 1 never joins the
    # collective. Given a timeout of its own (gang.ft gives a blocking collective what is left of the
    # step attempt's budget), gloo ends it then, not at the group's 30 s.
    store = serve_store("127.0.0.1", timeout=timedelta(seconds=60))
    groups: dict[int, StandaloneGroup] = {}

    def build(rank: int) -> None:
        client = TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        groups[rank] = new_standalone_group(
            PrefixStore("t", client), rank, 2, torch.device("cpu"), timedelta(seconds=30)
        )

    builders = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    for thread in builders:
        thread.start()
    for thread in builders:
        thread.join()
    calls = TorchCalls(standalone=True)
    x = torch.ones(2)
    start: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: calls.all_reduce(groups[0], x, ReduceOperation.SUM, True),
        "all_gather_to_list": lambda: calls.all_gather_to_list(groups[0], [torch.empty(2), torch.empty(2)], x, True),
        "all_to_all": lambda: calls.all_to_all(groups[0], torch.empty(2), x, [], [], True),
        "broadcast": lambda: calls.broadcast(groups[0], x, 1, True),
        "barrier": lambda: calls.barrier(groups[0]),
    }
    calls.timeout = timedelta(seconds=0.5)
    work = start[operation]()
    calls.timeout = None
    with pytest.raises(RuntimeError, match=r"[Tt]imed out.*\b500 ?ms"):  # gloo names the timeout it kept
        work.wait()
    for group in groups.values():
        reaper.drop(group)
