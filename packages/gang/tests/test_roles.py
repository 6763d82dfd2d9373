"""The one table of roles, the layouts of cp and ep, Gangs.flatten, and dry runs at 131,072 ranks."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from roles_workers import FLATTENED, check_reports, expected_members, flatten_not_a_grid, layout_report

import gang
from gang import FakeGang, Gangs, NotSupportedError, create_fake_gangs, create_fsdp_gangs, create_parallel_gangs
from gang.roles import ALIASES, DENSE_ROLES, EXPERT_ROLES, GRID_AXES, ROLE_TABLE, ROLES, SIZE_RULES, VIEWS
from gang.testing import World, dry_run
from gang.topology import Grid, Layout, check_views, flattened_axes, parallel_layout

CPU = torch.device("cpu")

# -- the table ------------------------------------------------------------------------------------


def test_the_table_is_the_one_source() -> None:
    assert ROLES == ("root", "dp", "rdp", "sdp", "cp", "tp", "pp", "ep", "edp", "etp")
    assert [f.name for f in dataclasses.fields(Gangs) if f.init and f.name != "layout"] == list(ROLES)
    assert [name for name, _ in create_fake_gangs(CPU).items()] == list(ROLES)
    assert set(DENSE_ROLES) | set(EXPERT_ROLES) | {"root"} == set(ROLES)
    assert GRID_AXES == ("pp", "rdp", "sdp", "cp", "tp")  # the SPEC's layout order, slowest first
    assert {row.name: row.axes for row in ROLE_TABLE}["dp"] == ("rdp", "sdp")
    aliases = {a.name: (a.role, a.folds) for a in ALIASES}
    assert aliases["dp_replicate"] == ("rdp", None) and aliases["dp_shard"] == ("sdp", None)
    assert aliases["efsdp"] == ("edp", None) and aliases["batch"] == ("dp", None)
    assert aliases["expert_tensor_parallel"] == ("etp", None)
    for folded in ("fsdp", "dp_shard_cp"):
        assert aliases[folded] == ("sdp", "cp")
    for folded in ("loss", "loss_mesh", "dp_cp"):
        assert aliases[folded] == ("dp", "cp")
    # The views of the one grid: the dense axes, and the experts' re-factoring of one pipeline stage.
    assert [(v.name, v.axes, v.derived) for v in VIEWS] == [
        ("dense", ("pp", "rdp", "sdp", "cp", "tp"), None),
        ("expert", ("pp", "edp", "ep", "etp"), "edp"),
    ]
    assert SIZE_RULES[-1] == (("ep", "edp", "etp"), ("dp", "cp", "tp"))
    assert not hasattr(gang.extend, "ROLES")  # the kit for writing gangs no longer carries the roles


def role_literals(source: str) -> dict[str, int]:
    """The role and axis names that ``source`` spells as string literals, each with its first line."""
    names = set(ROLES) | {axis for view in VIEWS for axis in view.axes}
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.setdefault(node.value, node.lineno)
    return found


def test_library_modules_read_role_names_from_the_table() -> None:
    # One source of truth: a library module that spells three or more role names by hand holds a
    # second copy of the table (a new role would be a change in two places).
    packages = Path(__file__).parents[2]
    modules = sorted(packages.glob("*/src/**/*.py"))
    assert any(path.name == "roles.py" for path in modules) and len(modules) > 20
    spelled = {}
    for path in modules:
        if path.name != "roles.py":
            found = role_literals(path.read_text())
            if len(found) >= 3:
                spelled[str(path.relative_to(packages))] = found
    assert spelled == {}, f"modules that spell role names instead of reading gang.roles: {spelled}"
    assert len(role_literals('x = ("tp", "pp", "cp")\n"""tp"""')) == 3  # the check sees what it looks for


def test_the_docs_glossary_lists_the_table() -> None:

    text = (Path(__file__).parents[3] / "docs" / "what-is-a-gang.rst").read_text()
    start = text.index(".. glossary-of-roles-start")
    block = text[start : text.index(".. glossary-of-roles-end")]
    rows = [line.strip() for line in block.splitlines() if line.strip().startswith("* - ``")]
    assert rows == [f"* - ``{row.name}``" for row in ROLE_TABLE]
    for row in ROLE_TABLE:
        assert row.title in block and row.spans in block, row.name
    for alias in ALIASES:
        assert f"``{alias.name}``" in block, alias.name


# -- the layout in closed form, against the SPEC's formula ----------------------------------------

SMALL_LAYOUTS = [
    dict(tp=2),
    dict(tp=2, pp=2),
    dict(cp=2, tp=2),
    dict(cp=2, tp=2, ep=2),
    dict(cp=2, ep=4),
    dict(cp=2, ep=8),
    dict(tp=2, cp=2, pp=2, ep=2, sdp=2),
    dict(cp=4, ep=2, sdp=2),
    dict(pp=2, cp=2, ep=4, sdp=2),
    dict(tp=2, ep=4, etp=1),  # the experts span the tensor parallel ranks (torchtitan's sparse mesh)
    dict(tp=4, cp=2, ep=2, etp=2),  # experts split in two within a tensor parallel gang of four
    dict(tp=2, cp=2, pp=2, ep=8, etp=1, sdp=2),
    dict(tp=4, ep=4, etp=4),  # etp given as tp: the same gangs as without it
    dict(tp=2, cp=2, ep=2, etp=4),  # etp wider than tp
]


@pytest.mark.parametrize("config", SMALL_LAYOUTS)
def test_layout_members_follow_the_formula(config: dict[str, int]) -> None:
    world = 16
    sizes = {k: v for k, v in config.items() if k != "sdp"}
    layout = parallel_layout(world, **{f"{k}_size": v for k, v in sizes.items()})  # type: ignore[arg-type]
    if "sdp" in config:
        pp, dp, _, cp, tp = layout.shape
        layout = Layout((pp, dp // config["sdp"], config["sdp"], cp, tp), layout.ep, etp=layout.etp)
    for rank in range(world):
        want = expected_members(rank, world, **config)
        for role, members in want.items():
            roles = (role,) if isinstance(role, str) else role
            assert layout.members(rank, *roles) == members, (rank, role)
            assert layout.members(rank, *reversed(roles)) == members  # order-free
            row = [list(g) for g in layout.groups(*roles).tolist() if rank in g]
            assert row == [members]


def _brute_force_groups(world: int, config: dict[str, int]) -> dict[str, list[list[int]]]:
    """Every gang of every role by enumerating the ranks of both views in nested loops (slowest
    outermost) and grouping the ranks that agree on every other coordinate of that view."""
    tp, pp, cp, ep, sdp = (config.get(k, 1) for k in ("tp", "pp", "cp", "ep", "sdp"))
    etp = config.get("etp", tp)
    dp = world // (tp * pp * cp)
    edp = dp * cp * tp // (ep * etp)
    dense = itertools.product(range(pp), range(dp // sdp), range(sdp), range(cp), range(tp))
    expert = itertools.product(range(pp), range(edp), range(ep), range(etp))
    views: dict[tuple[str, ...], list[tuple[int, ...]]] = {
        ("pp", "rdp", "sdp", "cp", "tp"): list(dense),
        ("pp", "edp", "ep", "etp"): list(expert),
    }
    spans = {"dp": ("rdp", "sdp"), **{name: (name,) for name in ("rdp", "sdp", "cp", "tp", "pp", "ep", "edp", "etp")}}
    result = {}
    for role, axes in spans.items():
        names, coords = next((names, coords) for names, coords in views.items() if set(axes) <= set(names))
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, at in enumerate(coords):
            others = tuple(c for name, c in zip(names, at, strict=True) if name not in axes)
            groups.setdefault(others, []).append(rank)
        result[role] = sorted(groups.values())
    return result


@pytest.mark.parametrize("config", SMALL_LAYOUTS)
def test_layout_and_formula_agree_with_brute_force_enumeration(config: dict[str, int]) -> None:
    world = 16
    layout = parallel_layout(world, **{f"{k}_size": v for k, v in config.items() if k != "sdp"})  # type: ignore[arg-type]
    if "sdp" in config:
        layout = layout.resized(rdp=layout.sizes["rdp"] // config["sdp"], sdp=config["sdp"])
    brute = _brute_force_groups(world, config)
    for role, groups in brute.items():
        assert sorted(layout.groups(role).tolist()) == groups, role
        for rank in range(world):
            assert expected_members(rank, world, **config)[role] in groups, (role, rank)
    # Omitted, etp is tp: its gangs are the tp gangs and the expert gangs are those without etp.
    if config.get("etp", config.get("tp", 1)) == config.get("tp", 1):
        assert brute["etp"] == brute["tp"]
        without = {k: v for k, v in config.items() if k != "etp"}
        assert brute["ep"] == _brute_force_groups(world, without)["ep"]


def test_views_agree_and_span_grids_together() -> None:
    layout = parallel_layout(16, tp_size=2, cp_size=2, ep_size=2)
    assert set(layout.views) == {"dense", "expert"}
    assert layout.views["expert"].names == ("pp", "edp", "ep", "etp") and layout.views["expert"].shape == (1, 4, 2, 2)
    assert layout.key("etp") == layout.key("tp")  # one gang: etp is tp
    assert layout.key("ep") == layout.key("cp") != layout.key("edp")  # ep blocks of 2 are the cp gangs
    # With etp = tp the experts' axes meet the tensor parallel axis in one grid.
    assert layout.submesh(5, ["edp", "ep", "tp"]).shape == (4, 2, 2)
    narrow = parallel_layout(16, tp_size=2, cp_size=2, ep_size=4, etp_size=1)
    assert narrow.key("ep") == narrow.key("cp", "tp")
    with pytest.raises(ValueError, match=r"`dims` must name dimensions that form a grid, but 'tp' and 'ep' split"):
        narrow.submesh(5, ["edp", "ep", "tp"])
    with pytest.raises(ValueError, match="the views 'dense' and 'expert' disagree on 'pp'"):
        check_views({"dense": Grid((("pp", 2), ("tp", 4))), "expert": Grid((("ep", 2), ("pp", 2), ("etp", 2)))})


def test_spec_examples_literally() -> None:
    def groups(layout: Layout, role: str) -> list[list[int]]:
        return [list(g) for g in layout.groups(role).tolist()]

    layout = parallel_layout(8, tp_size=2, cp_size=2)
    assert groups(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(layout, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    layout = parallel_layout(8, tp_size=2, cp_size=2, ep_size=2)
    assert sorted(groups(layout, "ep")) == sorted([[0, 2], [4, 6], [1, 3], [5, 7]])
    assert sorted(groups(layout, "edp")) == sorted([[0, 4], [2, 6], [1, 5], [3, 7]])
    assert groups(parallel_layout(8, tp_size=2), "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    layout = parallel_layout(8, tp_size=2, pp_size=2)
    assert groups(layout, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(layout, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_submesh_is_the_gangs_through_a_rank() -> None:
    layout = parallel_layout(16, tp_size=2, cp_size=2, global_ranks=range(100, 116))
    mesh = layout.submesh(13, ["dp", ("cp", "tp")])
    assert mesh.shape == (4, 4)
    assert mesh[:, 1].tolist() == layout.members(13, "dp")  # 13 is position 1 along ("cp", "tp")
    assert mesh[3].tolist() == layout.members(13, "cp", "tp")  # and position 3 along dp


@pytest.mark.parametrize(
    ("roles", "text"),
    [
        ((), "`roles` must name at least one role"),
        (("xp",), "`roles` must name roles of"),
        (("tp", "tp"), "must not repeat a role"),
        (("dp", "sdp"), "must name roles that do not overlap"),
        (("ep", "tp"), "must name `ep` alone"),
        (("root", "tp"), "must name `root` alone"),
        (("cp", "edp"), "must name `edp` alone"),
    ],
)
def test_flatten_errors(roles: tuple[str, ...], text: str) -> None:
    gangs = create_parallel_gangs(FakeGang(CPU, rank=5, size=8), cp_size=2, tp_size=2)
    with pytest.raises(ValueError, match="`roles`") as info:
        gangs.flatten(*roles)
    assert text in str(info.value)
    with pytest.raises(ValueError, match="`roles`") as again:
        flattened_axes(roles)
    assert str(again.value) == str(info.value)


def test_factory_errors() -> None:
    root = FakeGang(CPU, size=8)
    with pytest.raises(ValueError, match=r"`ep_size` must be a factor of `dp_size \* cp_size` \(8\), but is 3"):
        create_parallel_gangs(root, cp_size=2, ep_size=3)
    with pytest.raises(ValueError, match="`cp_size` must be a factor of the root gang size"):
        create_parallel_gangs(root, cp_size=3)
    with pytest.raises(ValueError, match=r"`tp_size \* cp_size \* pp_size` must be a factor"):
        create_parallel_gangs(root, cp_size=4, tp_size=4)
    with pytest.raises(TypeError, match="`ep_size` must be an `int`"):
        create_parallel_gangs(root, ep_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"`ep_size \* etp_size` must be a factor of `dp_size \* cp_size \* tp_size` \(8\), "
        r"but is 2 \* 3 = 6",
    ):
        create_parallel_gangs(root, tp_size=2, ep_size=2, etp_size=3)
    with pytest.raises(ValueError, match="`etp_size` must be at least 1, but is 0"):
        create_parallel_gangs(root, etp_size=0)
    with pytest.raises(TypeError, match="`etp_size` must be an `int`"):
        create_parallel_gangs(root, etp_size=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`root` must be a `Gang`"):
        create_parallel_gangs("root")  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [0, 5, 14])
def test_factories_on_a_fake_gang_root(rank: int) -> None:
    config = dict(tp=2, cp=2, ep=2, pp=2)
    gangs = create_parallel_gangs(FakeGang(CPU, rank=rank, size=16), **{f"{k}_size": v for k, v in config.items()})
    gangs = create_fsdp_gangs(gangs, 2)
    want = expected_members(rank, 16, sdp=2, **config)
    for name, sub in gangs.items():
        if name != "root":
            assert (sub.rank, sub.size) == (want[name].index(rank), len(want[name])), name
    for roles in FLATTENED:
        flat = gangs.flatten(*roles)
        assert (flat.rank, flat.size) == (want[roles].index(rank), len(want[roles])), roles
    assert gangs.layout is not None and gangs.layout.shape == (2, 1, 2, 2, 2)


# -- eight real gloo processes --------------------------------------------------------------------

GLOO_CONFIGS: list[dict[str, Any]] = [
    dict(tp=2, pp=1, cp=1, ep=1),
    dict(tp=2, pp=2, cp=1, ep=1),
    dict(tp=2, pp=1, cp=2, ep=1),
    dict(tp=2, pp=1, cp=2, ep=2),
    dict(tp=1, pp=1, cp=2, ep=4, intra=2),
    dict(tp=2, pp=1, cp=2, ep=2, intra=None),
    dict(tp=2, pp=1, cp=1, ep=4, etp=1),  # the experts span the tensor parallel ranks
    dict(tp=4, pp=1, cp=1, ep=2, etp=2, intra=2),  # two experts' halves within each tp gang of four
]


def test_every_layout_on_eight_gloo_ranks(world8: World) -> None:
    reports = world8.run(layout_report, GLOO_CONFIGS)
    check_reports(reports, GLOO_CONFIGS)
    # The SPEC's example with cp_size=2, tp_size=2, ep_size=2, as every rank's ep and edp gangs.
    ep = {tuple(reports[r][3]["ep"]["members"]) for r in range(8)}
    edp = {tuple(reports[r][3]["edp"]["members"]) for r in range(8)}
    assert ep == {(0, 2), (4, 6), (1, 3), (5, 7)} and edp == {(0, 4), (2, 6), (1, 5), (3, 7)}


def test_flatten_without_a_layout_refuses_gangs_that_are_not_a_grid(world8: World) -> None:
    messages = world8.run(flatten_not_a_grid)
    assert messages == [messages[0]] * 8
    assert messages[0] == (
        "`roles` must span gangs of 8 ranks, but the gangs of ('rdp', 'sdp', 'tp') do not form a grid "
        "(two processes have the same coordinates [0, 0, 0, 0, 0] along ['pp', 'rdp', 'sdp', 'cp', 'tp']) instead."
    )


# -- dry runs at cluster scale --------------------------------------------------------------------

BIG = 131_072
DRY_LAYOUTS = [
    dict(tp=8, pp=8, cp=2, ep=8, sdp=64),
    dict(tp=4, pp=4, cp=4, ep=32, sdp=8),
    dict(tp=8, pp=1, cp=1, ep=1, sdp=1),
    dict(tp=8, pp=4, cp=2, ep=32, etp=1, sdp=8),
    dict(tp=8, pp=8, cp=2, ep=16, etp=2, sdp=64),
]


@pytest.mark.parametrize("config", DRY_LAYOUTS)
def test_dry_run_at_131072_ranks_gives_each_rank_its_members(config: dict[str, int]) -> None:
    sizes = {f"{k}_size": v for k, v in config.items() if k != "sdp"}
    for rank in (0, 12_345, 70_001, BIG - 1):
        with dry_run(BIG, rank=rank) as root:
            assert (root.rank, root.size, root.dry_run) == (rank, BIG, True)
            gangs = create_parallel_gangs(root, **sizes)
            if config["sdp"] > 1:
                gangs = create_fsdp_gangs(gangs, config["sdp"])
            want = expected_members(rank, BIG, **config)
            found: dict[str | tuple[str, ...], gang.Gang] = {name: sub for name, sub in gangs.items()}
            found.update({roles: gangs.flatten(*roles) for roles in FLATTENED})
            for role, members in want.items():
                sub = found[role]
                got = getattr(sub, "global_ranks", [rank])
                assert list(got) == members, (config, rank, role)
                assert (sub.rank, sub.size) == (members.index(rank), len(members)), (config, rank, role)
            assert gangs.root is root


def test_dry_run_refuses_what_needs_peers_values(monkeypatch: pytest.MonkeyPatch) -> None:
    with dry_run(1024, rank=3) as root:
        gangs = create_parallel_gangs(root, tp_size=8)
        tensor = torch.ones(2)
        gangs.tp.all_reduce(tensor, gang.ReduceOperation.SUM)  # completes, computes nothing
        calls: dict[str, Callable[[], object]] = {
            "all_gather_objects": lambda: gang.all_gather_objects(gangs.dp, 1),
            "broadcast_objects": lambda: gangs.tp.broadcast_objects([1]),
            "broadcast_flag": lambda: gang.broadcast_flag(root, True),
            "all_sum": lambda: gang.all_sum(gangs.tp, 1.0),
            "all_reduce_dict": lambda: gang.all_reduce_dict(root, {"a": 1}),
            "flatten (of gangs without a layout)": lambda: dataclasses.replace(gangs, layout=None).flatten("dp", "tp"),
        }
        for name, call in calls.items():
            with pytest.raises(NotSupportedError, match="dry run") as info:
                call()
            assert f"`{name}`" in str(info.value)
    monkeypatch.setenv("GANG_DEBUG", "1")
    with dry_run(64, rank=3) as root, pytest.raises(NotSupportedError, match=r"`debug mode`.*dry run"):
        root.barrier()


def test_dry_run_argument_errors() -> None:
    cases: list[tuple[Callable[[], AbstractContextManager[object]], type[Exception], str]] = [
        (lambda: dry_run(0), ValueError, "`world_size` must be at least 1, but is 0 instead."),
        (lambda: dry_run(8, rank=8), ValueError, "`rank` must be in the range [0, 8), but is 8 instead."),
        (lambda: dry_run(8, device=3), TypeError, "`device` must be a `torch.device` or a `str`, but is 3 instead."),  # type: ignore[arg-type]
    ]
    for call, error, text in cases:
        with pytest.raises(error) as info, call():
            pass
        assert text in str(info.value)


def test_split_own_group_checks_its_arguments() -> None:
    fake = FakeGang(CPU, rank=1, size=4)

    def every() -> list[list[int]]:
        return [[0, 1], [2, 3]]

    with pytest.raises(ValueError, match=r"`members` must hold this process's rank 1, but is \[0, 2\] instead."):
        fake.split_own_group([2, 0], every)
    with pytest.raises(ValueError, match="`members` must be ranks of this gang in the range"):
        fake.split_own_group([1, 4], every)
    with pytest.raises(TypeError, match="`members` must be a sequence of `int`"):
        fake.split_own_group("01", every)  # type: ignore[arg-type]
    sub = fake.split_own_group([0, 1], every)
    assert sub is not None and (sub.rank, sub.size) == (1, 2)
