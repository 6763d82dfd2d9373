"""One body per collective, run on a reference gang and on every gang of a table, in the same processes.

The reference is the torch ProcessGroupGang; the table is :data:`conformance_workers.GANGS` (an
in-process JaxGang, an isolated one with JAX in a child process, a FakeGang on inputs equal on
every rank, as its semantics assume, and a ReplicaGang whose ranks are one-process replicas, each
case in a step that must be committed). A new kind of gang joins by one entry there. Inputs are
chosen so that every reduction is exact whatever order a backend combines values in (see
:func:`conformance_workers.make_input`); results must then be equal bit for bit. The bad-call
catalogue of the core package runs on every entry too: the same error, the same text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import conformance_workers as cw
import pytest
import torch
from bad_call_workers import CATALOGUE

from gang.extend import SUPPORTED_DTYPES
from gang.testing import World

OPS = ["SUM", "MEAN", "PRODUCT", "MIN", "MAX"]
SHAPE = (2, 3)
# How many dtypes each reduction runs on: on 2 processes every supported dtype (bool, the
# integers, the floats float16 included, the complex ones), less what no gang can do (MEAN of
# integers, complex PRODUCT, MIN and MAX): a guard that the suite runs them all. On 4 processes
# (the same code paths with more ranks) the floats and the 32- and 64-bit integers, which keeps
# the JAX entries' compilations, the suite's main cost, in check.
DTYPES_PER_OP = {
    2: {"SUM": 11, "MEAN": 6, "PRODUCT": 9, "MIN": 9, "MAX": 9, None: 11},
    4: {"SUM": 6, "MEAN": 4, "PRODUCT": 6, "MIN": 6, "MAX": 6, None: 6},
}
EVERY_DTYPE_TIMEOUT = 600.0
"""Seconds one run of every dtype may take (World's default, 120, is for one collective on a busy machine)."""
ON_4 = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]


def _every_dtype(world: World, name: str, kind: str, op: str | None) -> None:
    """Run ``kind`` with ``op`` on every dtype of this world's size (one run) and compare them all."""
    only = None if world.world_size == 2 else ON_4
    # One run compiles a JAX entry's collective for each dtype: give it the time of several runs.
    results = world.run(cw.run_every_dtype, name, kind, op, SHAPE, only, timeout=EVERY_DTYPE_TIMEOUT)
    assert len(results[0]["reference"]) == DTYPES_PER_OP[world.world_size][op], sorted(results[0]["reference"])
    for dtype in results[0]["reference"]:
        try:
            _assert_same([{key: r[key][dtype] for key in ("reference", "tested")} for r in results])
        except AssertionError as ex:
            raise AssertionError(f"{dtype}: {ex}") from None


SIZES = (2, 4)
"""The world sizes the suite runs on (one module-scoped world each)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``world`` by size, and with it the ``name`` fixture by the entries that run on that size.

    A test that takes the ``name`` fixture gets one item per (size, entry) pair the table allows (an
    entry's :class:`~conformance_workers.GangKind` ``sizes``), so an entry is never collected on a
    size it does not run on. A test that parametrizes ``name`` itself gets every size. The worlds
    are module-scoped: every item of one size shares one world.
    """
    if "world" not in metafunc.fixturenames:
        return
    marked = [mark.args[0] for mark in metafunc.definition.iter_markers("parametrize")]
    named = any("name" in ([n.strip() for n in a.split(",")] if isinstance(a, str) else a) for a in marked)
    if "name" in metafunc.fixturenames and not named:
        sizes = {name: kind.sizes or SIZES for name, kind in cw.GANGS.items()}
        pairs = [(size, name) for size in SIZES for name in cw.GANGS if size in sizes[name]]
        ids = [f"world{size}-{name}" for size, name in pairs]
        # `name` gets (size, entry): pytest orders the items by every module-scoped parameter, and an
        # entry's name alone, equal across sizes, would interleave the sizes (a new world each time).
        values = [(size, (size, name)) for size, name in pairs]
        metafunc.parametrize(("world", "name"), values, indirect=True, ids=ids, scope="module")
    else:
        metafunc.parametrize("world", SIZES, indirect=True, ids=[f"world{n}" for n in SIZES], scope="module")


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    """The module's world of ``request.param`` processes (see :func:`pytest_generate_tests`)."""
    with World(request.param, env={"OMP_NUM_THREADS": "1"}) as w:
        yield w
        if w.alive:
            w.run(cw.close_gangs)


@pytest.fixture(scope="module")
def name(request: pytest.FixtureRequest) -> str:
    """The entry of the table of gangs under test (its parameter is the pair (world size, entry))."""
    return str(request.param[1])


def _entries(flag: str) -> list[str]:
    """The entries of the table whose :class:`~conformance_workers.GangKind` field ``flag`` is true."""
    return [name for name, kind in cw.GANGS.items() if getattr(kind, flag)]


def _assert_same(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        t, j = r["reference"], r["tested"]
        if isinstance(t, list):
            assert len(t) == len(j)
            for a, b in zip(t, j, strict=True):
                assert a.dtype == b.dtype, f"rank {rank}: {a.dtype} != {b.dtype}"
                assert torch.equal(a, b), f"rank {rank}: {a} != {b}"
        else:
            assert t.dtype == j.dtype, f"rank {rank}: {t.dtype} != {j.dtype}"
            assert torch.equal(t, j), f"rank {rank}: reference {t} != tested {j}"


@pytest.mark.parametrize("op", OPS)
def test_all_reduce(world: World, name: str, op: str) -> None:
    _every_dtype(world, name, "all_reduce", op)


@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter(world: World, name: str, op: str) -> None:
    _every_dtype(world, name, "reduce_scatter", op)


@pytest.mark.parametrize(
    "kind", ["all_gather", "all_gather_to_list", "all_to_all", "broadcast_first", "broadcast_last"]
)
def test_data_movement(world: World, name: str, kind: str) -> None:
    _every_dtype(world, name, kind, None)


@pytest.mark.parametrize("shape", [(), (0,), (1, 1, 5)], ids=["scalar", "empty", "rank3"])
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "broadcast_last"])
def test_odd_shapes(world: World, name: str, kind: str, shape: tuple[int, ...]) -> None:
    _assert_same(world.run(cw.run_collective, name, kind, "SUM", "float32", shape))


@pytest.mark.parametrize("name", _entries("large"))
@pytest.mark.parametrize(("op", "dtype"), [("SUM", "float32"), ("MAX", "int64"), ("SUM", "int32")])
def test_large_reduce_scatter(world: World, name: str, op: str, dtype: str) -> None:
    # 2**20 elements per chunk: a size at which some JAX CPU builds returned wrong reduce-scatter data
    # (a check of the data path, for the entries whose field `large` says they have one at this size).
    results = world.run(cw.run_collective, name, "reduce_scatter", op, dtype, (1 << 20,))
    _assert_same(results)


def test_results_are_not_trivial(world: World, name: str) -> None:
    # Guards the suite itself: a SUM must differ from the input, or equality would prove nothing.
    results = world.run(cw.run_collective, name, "all_reduce", "SUM", "int64", SHAPE)
    ranks = [0] * world.world_size if cw.GANGS[name].same_data else range(world.world_size)
    expected = torch.stack([cw.make_input(r, SHAPE, torch.int64, None) for r in ranks]).sum(0)
    for r in results:
        assert torch.equal(r["tested"], expected)


@pytest.mark.parametrize("name", _entries("subgangs"))
@pytest.mark.parametrize("how", ["create_gang", "split", "three"])
def test_subgangs(world: World, name: str, how: str) -> None:
    results = world.run(cw.run_on_subgangs, name, how)
    members = 0
    for r in results:
        assert (r["reference"] is None) == (r["tested"] is None)
        if r["reference"] is None:
            continue
        members += 1
        for key in ("rank", "size"):
            assert r["reference"][key] == r["tested"][key]
        for key in ("sum", "mean", "gather", "broadcast"):
            assert torch.equal(r["reference"][key], r["tested"][key]), key
    assert members >= 2


@pytest.mark.parametrize("name", _entries("subgangs"))
@pytest.mark.parametrize("tp_size", [1, 2])
def test_parallel_gangs(world: World, name: str, tp_size: int) -> None:
    results = world.run(cw.run_parallel_gangs, name, tp_size)
    for r in results:
        for layout in ("parallel", "fsdp"):
            for axis, (rank, size, value) in r["reference"][layout].items():
                j_rank, j_size, j_value = r["tested"][layout][axis]
                assert (rank, size) == (j_rank, j_size), (layout, axis)
                assert torch.equal(value, j_value), (layout, axis)


@pytest.mark.parametrize("name", _entries("objects"))
def test_broadcast_objects(world: World, name: str) -> None:
    results = world.run(cw.run_broadcast_objects, name)
    for r in results:
        assert r["reference"] == r["tested"] == [{"from": world.world_size - 1}, "x" * 1000]


@pytest.mark.parametrize("kind", [*cw.TRAFFIC_KINDS, "async"])
def test_traffic(world: World, name: str, kind: str) -> None:
    # Point-to-point (a ring listed in any order, blocking pairs), uneven rows (with ranks that send
    # and receive nothing), exchange_rows and every operation with async_op=True, in every dtype of
    # TRAFFIC_DTYPES in one run. An entry without `traffic` must refuse the first four by name.
    results = world.run(cw.run_traffic, name, kind)
    if kind in cw.TRAFFIC_KINDS and not cw.GANGS[name].traffic:
        methods = {"ring": ["send_recv"], "pairs": ["send", "recv"], "exchange_rows": ["exchange_rows"]}
        methods |= {"async_ring_forward": ["send"], "async_sends_first": ["send"]}
        methods |= {"async_ring_backward": ["recv"], "async_recvs_first": ["recv"]}
        for rank, r in enumerate(results):
            method = methods.get(kind, ["all_to_all_uneven"])[rank % 2 if kind == "pairs" else 0]
            assert str(r["tested"]).startswith(f"NotSupportedError: `{method}`"), r["tested"]
        results = [{"reference": r["reference"], "tested": r["reference"]} for r in results]
    elif not cw.GANGS[name].traffic:  # "async": the collectives come first, then the traffic the gang lacks
        results = [
            {
                "reference": [a[: len(b)] for a, b in zip(r["reference"], r["tested"], strict=True)],
                "tested": r["tested"],
            }
            for r in results
        ]
    for r in results:
        for dtype, reference, tested in zip(cw.TRAFFIC_DTYPES, r["reference"], r["tested"], strict=True):
            _assert_same([{"reference": reference, "tested": tested}])
            assert (reference if isinstance(reference, list) else [reference])[0].dtype == dtype


@pytest.mark.parametrize("name", [n for n in _entries("subgangs") if cw.GANGS[n].traffic])
def test_async_p2p_in_a_subgang(world: World, name: str) -> None:
    # Separate send and recv handles in every posting order of the table, inside a sub-gang.
    for r in world.run(cw.run_async_p2p_in_subgang, name):
        assert (r["reference"] is None) == (r["tested"] is None)
        for reference, tested in zip(r["reference"] or [], r["tested"] or [], strict=True):
            _assert_same([{"reference": reference, "tested": tested}])


def test_functional_after_async(world: World, name: str) -> None:
    # A blocking call (gang_jax.functional on an in-process JaxGang) after an async handle runs after
    # it: both results equal the reference's (they were silently wrong when functional skipped the queue).
    _assert_same(world.run(cw.run_functional_after_async, name))


HUNG_TIMEOUT_S = 10.0
"""The gangs' timeout in the hung-peer case."""
HUNG_MARGIN_S = 15.0
"""How long past the timeout a waiting rank may take to get its GangError (the machine is loaded)."""


@pytest.mark.parametrize("name", ["reference", *(n for n, kind in cw.GANGS.items() if kind.hung)])
def test_hung_peer(name: str) -> None:
    # A peer alive but late past the timeout: every rank that waits gets a GangError naming the
    # operation and the gang within the timeout plus a margin, from the handle's wait() or after
    # is_completed() turned true, and again at every later wait(); a JAX gang is then broken (its next
    # call raises); nothing of the gangs runs on once the late peer came (threads, child processes).
    with World(3, gang_timeout=HUNG_TIMEOUT_S, env={"OMP_NUM_THREADS": "1"}) as world:
        results = world.run(cw.run_hung_peer, name, HUNG_TIMEOUT_S, timeout=EVERY_DTYPE_TIMEOUT)
        left = world.run(cw.leftovers)
    for rank, r in enumerate(results[:-1]):
        assert (
            r["first"].startswith("GangError: `all_reduce` failed on ")
            and f"rank {rank} of a gang of size 3" in (r["first"])
        ), (rank, r)
        assert r["elapsed"] < HUNG_TIMEOUT_S + HUNG_MARGIN_S, (rank, r)
        assert r["completed"], (rank, r)
        assert r["again"] == r["first"], (rank, r)
        if name != "reference":
            assert r["next"].startswith("GangError: `all_reduce` failed on "), (rank, r)
    assert left == [[], [], []], left


@pytest.mark.parametrize("name", ["reference", "jax", "jax-isolated"])
def test_receive_nobody_sends(name: str) -> None:
    # A pattern that can never complete (a receive whose sender makes no send) is a GangError on the
    # rank that waits, within the timeout plus a margin, never a hang.
    with World(2, gang_timeout=HUNG_TIMEOUT_S, env={"OMP_NUM_THREADS": "1"}) as world:
        first = world.run(cw.run_unmatched_recv, name, HUNG_TIMEOUT_S, timeout=EVERY_DTYPE_TIMEOUT)[0]
    assert first["recv"].startswith("GangError: `recv` failed on rank 0 of a gang of size 2"), first
    assert first["elapsed"] < HUNG_TIMEOUT_S + HUNG_MARGIN_S, first


def test_traffic_results_are_not_trivial(world: World) -> None:
    # Guards the traffic suite itself: on the reference, a ring receives what the previous rank sent
    # (not the buffer's start, this rank's own) and uneven rows arrive from their senders in rank order.
    size = world.world_size
    for rank, r in enumerate(world.run(cw.run_reference_traffic)):
        assert torch.equal(r["ring"], cw.sent_by((rank - 1) % size, "ring")), rank
        assert not torch.equal(r["ring"], cw.sent_by(rank, "ring")), rank
        assert torch.equal(r["uneven"], cw.expected_uneven(rank, size)), rank


def test_bad_calls_raise_what_the_reference_raises(world: World, name: str) -> None:
    # Every bad call of the catalogue raises the same exception with the same text on the tested gang
    # as on the reference, before any communication (an all_reduce after each proves no rank waits).
    # The row that needs a working sub-gang is left out where the gang makes none.
    names = [call for call in CATALOGUE if cw.GANGS[name].subgangs or call not in cw.NEEDS_SUBGANGS]
    for rank, r in enumerate(world.run(cw.run_bad_calls, name, names)):
        for call in names:
            _, error, text = CATALOGUE[call]
            outcome = r["tested"][call]
            assert outcome.startswith(error.__name__ + ":") and text in outcome, f"rank {rank} {call}: {outcome}"
            assert outcome == r["reference"][call], f"rank {rank} {call}: {outcome} != {r['reference'][call]}"


def test_supported_dtypes_are_what_every_backend_moves(world: World) -> None:
    # Adding a dtype that some backend refuses (float8) or dropping one they all move (int8) fails here.
    for moved in world.run(cw.moved_dtypes):
        assert sorted(str(d) for d in SUPPORTED_DTYPES) == moved
