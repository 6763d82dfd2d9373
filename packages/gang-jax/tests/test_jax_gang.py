"""Unit tests of JaxGang and gang_jax.functional on real local processes (nothing is mocked)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import jax_workers as jw
import numpy as np
import pytest
import torch

from gang.testing import World
from gang_jax import JaxGang


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with World(3, init_gang=False) as w:
        yield w


def test_properties(world: World) -> None:
    results = world.run(jw.properties)
    for rank, r in enumerate(results):
        assert r["rank"] == r["env_rank"] == r["jax_process"] == r["jax_device_process"] == rank
        assert r["size"] == 3
        assert r["device"] == torch.device("cpu")
        assert r["supports_pg"] is False
        assert r["members"] == (0, 1, 2)
        assert r["outside_loopback"] == []  # a local run stays on loopback


def test_as_process_group_raises(world: World) -> None:
    assert all("JaxGang" in m for m in world.run(jw.as_process_group_raises))


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_numpy_arrays_are_updated_in_place(world: World, dtype: str) -> None:
    for a in world.run(jw.numpy_in_place, dtype):
        assert a.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, np.full(3, 6, dtype=dtype))


def test_64_bit_without_enabling_x64(world: World) -> None:
    for enabled, t in world.run(jw.x64_sum):
        assert enabled is False
        assert t.tolist() == [3 * 2**40 + 3, -3 * 2**50]


def test_compiled_collectives_are_cached(world: World) -> None:
    for before, after_loop, after_new_shape in world.run(jw.compile_cache):
        assert after_loop == before + 1
        assert after_new_shape == after_loop + 1


def test_functional(world: World) -> None:
    results = world.run(jw.functional_ops)
    x = [np.arange(4, dtype=np.float32) + r for r in range(3)]
    rows = [np.arange(6, dtype=np.int32).reshape(3, 2) + 100 * r for r in range(3)]
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["sum"], sum(x))
        np.testing.assert_array_equal(r["mean"], sum(x) / 3)
        np.testing.assert_array_equal(r["gather"], np.stack(x))
        np.testing.assert_array_equal(r["rs"], np.max([rw[rank] for rw in rows], axis=0))
        np.testing.assert_array_equal(r["a2a"], np.stack([rw[rank] for rw in rows]))
        np.testing.assert_array_equal(r["bcast"], x[2] * 3)
        np.testing.assert_array_equal(r["bcast_bool"], [False, True])
        assert r["rs"].dtype == np.int32


def test_large_float_broadcast_is_bit_for_bit(world: World) -> None:
    # The program sums raw bits; a float sum would turn -0.0 into 0.0 and could quiet NaNs or
    # flush subnormals (388 of 65536 elements came back changed when it summed the floats).
    for results in world.run(jw.large_float_broadcast):
        assert [dtype for _, _, dtype, _ in results] == ["float32", "float16", "bfloat16"]
        for source, got, _, on_device in results:
            np.testing.assert_array_equal(got, source)
            assert on_device


def test_all_gather_copies_nothing_after_the_gather(world: World) -> None:
    # Gathering along the block's second axis made XLA gather in a transposed layout and then copy
    # the whole result into the row-major one (in both the functional and the torch programs).
    for texts in world.run(jw.all_gather_programs):
        assert len(texts) == 2
        for text in texts:
            assert "all-gather(" in text
            assert " copy(" not in text, text


def test_functional_shapes(world: World) -> None:
    # 0-d arrays, arrays without rows and 0-d results take another path than the others; a loop compiles nothing.
    for rank, r in enumerate(world.run(jw.functional_shapes)):
        assert r["compiled"] == 0
        assert r["scalar"] == (np.float32(6), ())
        assert r["rs_scalar"] == (np.int32(3 * rank + 3), ())
        np.testing.assert_array_equal(r["no_rows"][0], np.zeros((0, 2)))
        np.testing.assert_array_equal(r["gather_2d"][0], np.stack([np.full((2, 3), k, np.int8) for k in range(3)]))
        np.testing.assert_array_equal(r["bcast_complex"][0], np.array([1 + 2j, -0.0], np.complex64))
        assert np.signbit(r["bcast_complex"][0][1].real)
        assert r["bcast_scalar"] == (np.int32(2), ())


def test_functional_errors(world: World) -> None:
    for errors in world.run(jw.functional_errors):
        assert len(errors) == 5
        assert errors[0].startswith("TypeError: `x` must be a `jax.Array`")
        assert "MEAN" in errors[1]
        assert "must have shape [3, ...]" in errors[2]
        assert "`source_rank` must be in the range [0, 3)" in errors[3]
        assert errors[4].startswith("TypeError: `gang` must be a `JaxGang`")


def test_functional_is_checked_by_debug_mode(world: World) -> None:
    # gang_jax.functional goes through the gang's queue and debug mode like the torch-tensor methods.
    for r in world.run(jw.functional_in_debug_mode):
        np.testing.assert_array_equal(r["same"], [3.0, 3.0])
        assert r["mismatch"].startswith("Debug mode: the ranks of a gang of size 3 made different calls"), r
        assert (
            "rank 0: functional.all_reduce(float32[2], op=SUM); rank 1: functional.all_reduce(float32[3]"
            in (r["mismatch"])
        )


def test_argument_checks_precede_communication(world: World) -> None:
    for errors in world.run(jw.checks_before_communication):
        assert len(errors) == 3
        assert all("instead" in e for e in errors)


def test_subgang_only_members_take_part(world: World) -> None:
    results = world.run(jw.subgang_and_close)
    assert results[1] == {"member": False}
    for rank in (0, 2):
        r = results[rank]
        assert r["member"] is True
        assert r["size"] == 2
        assert r["rank"] == (0 if rank == 0 else 1)
        assert r["sum"] == 2.0
        assert r["members"] == (0, 2)
        assert r["closed_raises"] is True


def test_bool_float16_complex(world: World) -> None:
    for r in world.run(jw.bool_and_float16):
        assert r["flags"].tolist() == [True, True, False]
        assert r["half"].tolist() == [3.0, 3.0]
        assert r["complex"].tolist() == [1 + 4j]


@pytest.mark.parametrize("op", ["SUM", "MIN", "PRODUCT"])
def test_large_reduce_scatter(world: World, op: str) -> None:
    results = world.run(jw.large_reduce_scatter, op)
    chunk = 1 << 20
    base = torch.arange(3 * chunk, dtype=torch.float32) % 97
    inputs = [(base + r).reshape(3, chunk) for r in range(3)]
    for rank, out in enumerate(results):
        rows = torch.stack([inp[rank] for inp in inputs])
        if op == "SUM":
            expected = rows.sum(0)
        elif op == "MIN":
            expected = rows.min(0).values
        else:
            expected = rows.prod(0)
        assert torch.equal(out, expected)


def test_large_calls_alias_their_input(world: World) -> None:
    # Inputs of 2 MiB or more reach JAX through DLPack instead of a copy: the results and the inputs stay right.
    assert world.run(jw.large_calls_twice) == [[], [], []]


def test_create_default_checks_arguments() -> None:
    with pytest.raises(TypeError, match="`num_processes` must be an `int`"):
        JaxGang.create_default(num_processes="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`process_id` must be in the range \[0, 2\), but is 2 instead."):
        JaxGang.create_default(num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="`timeout` must be positive"):
        JaxGang.create_default(timeout=timedelta(0))
    with pytest.raises(TypeError, match="`coordinator_address` must be a `str`"):
        JaxGang.create_default(coordinator_address=1234)  # type: ignore[arg-type]


def test_close_shuts_down_and_create_works_again() -> None:
    with World(2, init_gang=False) as w:
        assert w.run(jw.create_close_create) == [(2, 0), (2, 0)]
        assert w.run(jw.create_close_create) == [(2, 0), (2, 0)]


def test_create_from_arguments_and_jax_variables() -> None:
    from gang.testing import free_port

    first, second = f"127.0.0.1:{free_port('127.0.0.1')}", f"127.0.0.1:{free_port('127.0.0.1')}"
    with World(2, init_gang=False) as w:
        for seen in w.run(jw.create_other_ways, first, second):
            assert seen == [3, 2, "already initialised", True, False]


def test_rank_is_mesh_position_not_device_id() -> None:
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    with World(2, init_gang=False, env=env) as w:
        results = w.run(jw.several_local_devices)
    for r in results:
        assert r["local_devices"] == 2
        assert r["uses_first_local"] is True
        assert r["sum"] == 3.0
        assert r["rows"] == [[0, 2**40], [1, 2**40]]
    # Device ids are not dense across processes, and the gang never assumes they are.
    assert results[0]["mesh_ids"] == results[1]["mesh_ids"]
    assert results[0]["mesh_ids"] != [0, 1]


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "isolated"])
def test_num_compiled_stays_flat_in_a_loop(world: World, isolated: bool) -> None:
    # One compiled program per (collective, reduction, shape, dtype), counted by JAX: repeating the
    # same calls (64-bit reductions and barriers included) must never trace or compile again.
    for counts in world.run(jw.compile_stays_flat, isolated):
        assert counts[0] >= 6
        assert counts == [counts[0]] * 6, counts


def test_bounded_wait_gives_up_and_the_receive_goes_on(world: World, tmp_path: Path) -> None:
    # wait(timeout=...) on a receive whose sender has not sent yet raises GangError (the transfer stays in
    # flight); once the sender sends, a second wait() returns the data.
    outcome, received, completed = world.run(jw.bounded_wait, str(tmp_path / "sent"))[0]
    assert outcome.startswith("GangError: `recv` did not complete within the `wait` timeout of 0.2 s"), outcome
    assert received == [0.0, 1.0, 2.0] and completed


def test_isolated_gang(world: World) -> None:
    results = world.run(jw.isolated_properties)
    for rank, r in enumerate(results):
        assert r["same"] and r["isolated"] == (True, False)
        assert "isolated" in r["communicator"] and "isolated" in r["functional"]
        if rank in (0, 2):
            assert r["sub"] == ((0 if rank == 0 else 1), 2, (0, 2), 2.0)
        else:
            assert "sub" not in r
