"""Closing, re-initialising, wrapping user groups, and peers that die or hang (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from core_workers import (
    adopt_framework_group,
    asymmetric_history,
    close_and_reinit,
    fallback_warnings,
    lifecycle_errors,
    private_torch_api,
    wrap_as_non_member,
    wrap_user_group,
    wrapped_group_timeouts,
)

from gang import NotSupportedError
from gang._torch_groups import as_mesh_subclass
from gang.testing import World, launch


def test_group_names_survive_asymmetric_histories_and_recreation(worlds: Callable[[int], World]) -> None:
    results = worlds(4).run(asymmetric_history)
    assert results[0] == [None, [0, 2], [0, 2]]
    assert results[2] == [[1, 2, 3], [0, 2], [0, 2]]
    assert results[1] == [[1, 2, 3], None, None]


def test_close_and_reinitialise_in_the_same_process_with_an_agent_store() -> None:
    # `launch` hosts the store in the parent and sets TORCHELASTIC_USE_AGENT_STORE, as torchrun does.
    assert launch(close_and_reinit, 2, 3) == [[4.0, 4.0, 4.0]] * 2


def test_close_and_reinitialise_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "reinit.py"
    script.write_text(
        textwrap.dedent(
            """
            from core_workers import close_and_reinit
            sums = close_and_reinit(3)
            assert sums == [4.0, 4.0, 4.0], sums
            print("REINIT-OK")
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        # torchrun's processes import the helper module by name, as this process does.
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("REINIT-OK") == 2


def test_lifecycle_errors() -> None:
    results = launch(lifecycle_errors, 2)
    assert results == [["InvalidOperationError", "ValueError", "TypeError", "TypeError", "InvalidOperationError"]] * 2


def test_create_default_gang_adopts_a_group_a_framework_initialised() -> None:
    # As under Ray Train's TorchTrainer (proven there by `nox -s ray`): the group exists before user code runs.
    for result in launch(adopt_framework_group, 2):
        explicit = result.pop("explicit")
        assert explicit.startswith("The default process group is already initialised"), explicit
        assert "`create_default_gang()` adopts it" in explicit and "from_process_group" in explicit, explicit
        assert result == {
            "adopted": True,
            "sum": 3.0,
            "dp": 2,
            "pair": 2.0,
            "pair_closed": True,
            "still_initialised": True,
            "after": 2.0,
        }


def test_from_process_group_wraps_without_owning(worlds: Callable[[int], World]) -> None:
    results = worlds(4).run(wrap_user_group)
    for rank, (total, sub, after, _) in enumerate(results):
        assert total == 6.0
        assert sub == ([2, 3] if rank >= 2 else None)
        assert after == 4.0


# Dead, killed and hung peers, sub-gang timeouts and rendezvous failures: see tests/reliability.


def test_sub_gangs_of_a_wrapped_group_inherit_its_timeout(worlds: Callable[[int], World]) -> None:
    for result in worlds(4).run(wrapped_group_timeouts):
        assert result == {
            "wrapped": timedelta(seconds=17),
            "sub": timedelta(seconds=17),
            "sub_backend": timedelta(seconds=17),
        }


def test_wrapping_a_group_this_process_is_not_in_is_a_value_error(worlds: Callable[[int], World]) -> None:
    results = worlds(4).run(wrap_as_non_member)
    assert results[:2] == ["member", "member"]
    for text in results[2:]:
        assert text.startswith("ValueError: `pg` must be a process group this process is a member of"), text


def test_private_torch_api_is_used_not_its_fallback(worlds: Callable[[int], World]) -> None:
    # The rest of gang._torch_groups' private uses are checked where they matter: the FSDP2 hooks'
    # once-per-backward average (tests/ft), replicate_ddp's buckets, dry runs on the `fake` backend.
    expected = {
        "warnings": [],
        "named": True,
        "timeout": True,
        "alone": True,
        "splitting": True,
        "nccl_timeout": True,
    }
    assert worlds(2).run(private_torch_api) == [expected] * 2


def test_a_mesh_that_refuses_its_subclass_is_named_not_passed_on() -> None:
    # gang_mesh's GangDeviceMesh is applied by assigning `__class__` to the meshes torch builds
    # (tests/mesh checks real meshes); where an object's layout refuses it, the error says so.
    class Mesh:
        pass

    class Sub(Mesh):
        pass

    mesh = Mesh()
    assert as_mesh_subclass(mesh, Sub) is mesh and type(mesh) is Sub
    with pytest.raises(NotSupportedError, match=r"A `int` cannot be made a `Sub` on torch "):
        as_mesh_subclass(1, Sub)


def test_the_unsafe_public_fallback_warns_once() -> None:
    # A fresh world: the fallback names groups from each process's group history, which the shared
    # worlds' earlier tests made different on different ranks (the very deadlock it warns about).
    with World(2) as world:
        caught_by_rank = world.run(fallback_warnings)
    for caught in caught_by_rank:
        assert len(caught) == 1 and "can then wait for each other forever" in caught[0], caught
