"""The Gangs container: validation, per-thread nestable current gangs, ordered close."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from gang import FakeGang, Gangs, create_fake_gangs, maybe_get_current_gangs

CPU = torch.device("cpu")


def _gangs(rank: int = 0) -> Gangs:
    root = FakeGang(CPU, rank=rank, size=8)
    return Gangs(
        root=root,
        dp=FakeGang(CPU, size=4),
        rdp=FakeGang(CPU, size=2),
        sdp=FakeGang(CPU, size=2),
        tp=FakeGang(CPU, size=2),
        pp=FakeGang(CPU, size=1),
    )


def test_valid_gangs_and_keyword_only() -> None:
    gangs = _gangs()
    assert [name for name, _ in gangs.items()] == ["root", "dp", "rdp", "sdp", "cp", "tp", "pp", "ep", "edp", "etp"]
    # Omitted, cp and ep are size-1 gangs, edp is dp and etp is tp.
    assert (gangs.cp.size, gangs.ep.size, gangs.edp, gangs.etp) == (1, 1, gangs.dp, gangs.tp)
    with pytest.raises(TypeError, match="positional argument"):
        Gangs(gangs.root, gangs.dp, gangs.rdp, gangs.sdp, gangs.tp, gangs.pp)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("field", "replacement", "text"),
    [
        ("dp", FakeGang(CPU, size=3), "`dp.size * cp.size * tp.size * pp.size` must equal `root.size` (8)"),
        ("cp", FakeGang(CPU, size=2), "`dp.size * cp.size * tp.size * pp.size` must equal `root.size` (8)"),
        ("ep", FakeGang(CPU, size=3), "`ep.size * edp.size * etp.size` must equal `dp.size * cp.size * tp.size` (8)"),
        ("etp", FakeGang(CPU, size=1), "`ep.size * edp.size * etp.size` must equal `dp.size * cp.size * tp.size` (8)"),
        ("rdp", FakeGang(CPU, size=4), "`rdp.size * sdp.size` must equal `dp.size` (4)"),
        ("tp", FakeGang(torch.device("cuda", 0), size=2), "`tp` must be on the root gang's device"),
    ],
)
def test_validation(field: str, replacement: FakeGang, text: str) -> None:
    import dataclasses

    with pytest.raises(ValueError, match=re.escape(text)):
        dataclasses.replace(_gangs(), **{field: replacement})  # type: ignore[arg-type]


def test_expert_tensor_parallel_lets_experts_span_the_tensor_parallel_ranks() -> None:
    import dataclasses

    gangs = _gangs()  # dp 4 x tp 2: ep 2 x etp 1 leaves edp 4, ep 8 x etp 1 leaves edp 1
    wide = dataclasses.replace(gangs, ep=FakeGang(CPU, size=2), edp=FakeGang(CPU, size=4), etp=FakeGang(CPU, size=1))
    assert (wide.ep.size, wide.edp.size, wide.etp.size) == (2, 4, 1)
    every = dataclasses.replace(gangs, ep=FakeGang(CPU, size=8), edp=FakeGang(CPU, size=1), etp=FakeGang(CPU, size=1))
    assert every.ep.size == 8


def test_non_gang_field_is_a_type_error() -> None:
    import dataclasses

    with pytest.raises(TypeError, match="`pp` must be a `Gang`"):
        dataclasses.replace(_gangs(), pp=None)  # type: ignore[arg-type]


def test_current_gangs_nest_and_are_per_thread() -> None:
    outer, inner = _gangs(), create_fake_gangs(CPU)
    assert maybe_get_current_gangs() is None
    seen_in_thread: list[object] = []
    with outer as entered:
        assert entered is outer and maybe_get_current_gangs() is outer
        with inner:
            assert maybe_get_current_gangs() is inner

            def other_thread() -> None:
                seen_in_thread.append(maybe_get_current_gangs())
                with outer:
                    seen_in_thread.append(maybe_get_current_gangs())
                seen_in_thread.append(maybe_get_current_gangs())

            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
            assert maybe_get_current_gangs() is inner
        assert maybe_get_current_gangs() is outer
    assert maybe_get_current_gangs() is None
    assert seen_in_thread == [None, outer, None]


def test_close_closes_distinct_gangs_sub_gangs_before_root() -> None:
    order: list[str] = []
    root = FakeGang(CPU, size=4)
    dp = FakeGang(CPU, size=2)
    tp = FakeGang(CPU, size=2)
    pp = FakeGang(CPU, size=1)
    for name, g in [("root", root), ("dp", dp), ("tp", tp), ("pp", pp)]:
        original = g._close

        def record(name: str = name, original: object = original) -> None:
            order.append(name)
            original()  # type: ignore[operator]

        g._close = record  # type: ignore[method-assign]
    gangs = Gangs(root=root, dp=dp, rdp=dp, sdp=pp, tp=tp, pp=pp)
    gangs.close()
    gangs.close()
    assert order[-1] == "root"
    assert sorted(order) == ["dp", "pp", "root", "tp"]  # each distinct gang once
    assert all(g.closed for _, g in gangs.items())
