"""The layouts of the factories on any kind of root gang, proven through the gangs' own collectives.

Imported by name by the core tests (gloo workers) and the JAX tests (JaxGang workers); the oracle
the tests check against is :func:`expected_members`, the SPEC's layout formula written out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import gang
from gang import Gang, ReduceOperation
from gang.testing import member_ranks

FLATTENED = (("sdp", "cp"), ("dp", "cp"), ("cp", "tp"))
"""The flattened roles every layout report holds (named in an order other than the grid's)."""


def expected_members(
    rank: int, world: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sdp: int = 1, etp: int | None = None
) -> dict[str | tuple[str, ...], list[int]]:
    """The members of each gang of ``rank``, from the SPEC's formula, independent of :mod:`gang.topology`.

    ``rank = ((pp_index * dp_size + dp_index) * cp_size + cp_index) * tp_size + tp_index``; the dp
    index is ``rdp_index * sdp + sdp_index`` (``sdp=1`` for :func:`gang.create_parallel_gangs`
    alone). The experts' grid numbers the ``dp x cp x tp`` ranks of one pipeline stage
    ``j = (edp_index * ep + ep_index) * etp + etp_index`` (``etp`` is ``tp`` when ``None``), so
    without ``etp`` the ep gangs are contiguous blocks of ``ep`` of ``dp_index * cp + cp_index``.
    """
    dp = world // (tp * pp * cp)
    etp = tp if etp is None else etp
    t, c, d, p = rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)
    r, s = divmod(d, sdp)
    stage = dp * cp * tp
    j = rank % stage
    e, x, y = j // (ep * etp), j // etp % ep, j % etp

    def at(p_: int, d_: int, c_: int, t_: int) -> int:
        return ((p_ * dp + d_) * cp + c_) * tp + t_

    def expert(e_: int, x_: int, y_: int) -> int:
        return p * stage + (e_ * ep + x_) * etp + y_

    return {
        "tp": [at(p, d, c, u) for u in range(tp)],
        "cp": [at(p, d, u, t) for u in range(cp)],
        "dp": [at(p, u, c, t) for u in range(dp)],
        "rdp": [at(p, u * sdp + s, c, t) for u in range(dp // sdp)],
        "sdp": [at(p, r * sdp + u, c, t) for u in range(sdp)],
        "pp": [at(u, d, c, t) for u in range(pp)],
        "ep": [expert(e, u, y) for u in range(ep)],
        "edp": [expert(u, x, y) for u in range(stage // (ep * etp))],
        "etp": [expert(e, x, u) for u in range(etp)],
        ("sdp", "cp"): [at(p, r * sdp + u, v, t) for u in range(sdp) for v in range(cp)],
        ("dp", "cp"): [at(p, u, v, t) for u in range(dp) for v in range(cp)],
        ("cp", "tp"): [at(p, d, u, v) for u in range(cp) for v in range(tp)],
    }


def _report(sub: Gang, root: Gang) -> dict[str, Any]:
    """Members (root ranks gathered through ``sub``), rank, size, kind and a sum through ``sub``."""
    members = member_ranks(sub, root.rank)
    total = torch.tensor([root.rank + 1], dtype=torch.int64)
    sub.all_reduce(total, ReduceOperation.SUM)
    return {
        "members": members,
        "rank": sub.rank,
        "size": sub.size,
        "kind": type(sub).__name__,
        "is_root": sub is root,
        "sum": int(total.item()),
    }


def layout_report(root: Gang, configs: list[dict[str, Any]], without_layout: bool = True) -> list[dict[str, Any]]:
    """For each config (``tp``, ``pp``, ``cp``, ``ep``, ``etp`` or none, ``intra`` or none), the report of every
    gang of the factories and of :data:`FLATTENED`, both from the layout and (``nolayout``, when
    ``without_layout``) from gangs without one (which gather to find the members)."""
    reports = []
    for config in configs:
        gangs = gang.create_parallel_gangs(
            root,
            tp_size=config["tp"],
            pp_size=config["pp"],
            cp_size=config["cp"],
            ep_size=config["ep"],
            etp_size=config.get("etp"),
        )
        if "intra" in config:
            gangs = gang.create_fsdp_gangs(gangs, config["intra"])
        made = [sub for _, sub in gangs.items()]
        report: dict[str, Any] = {name: _report(sub, root) for name, sub in gangs.items()}
        bare = dataclasses.replace(gangs, layout=None)
        for roles in FLATTENED:
            flat = gangs.flatten(*roles)
            again = gangs.flatten(*reversed(roles))
            report["_".join(roles)] = {**_report(flat, root), "cached": again is flat}
            made.append(flat)
            if without_layout:
                found = bare.flatten(*roles)
                report["nolayout_" + "_".join(roles)] = _report(found, root)
                made.append(found)
        report["layout_none"] = gangs.layout is None
        reports.append(report)
        for sub in {id(sub): sub for sub in made}.values():
            if sub is not root:
                sub.close()
    return reports


def check_reports(reports: list[list[dict[str, Any]]], configs: list[dict[str, Any]]) -> None:
    """Assert that every rank's :func:`layout_report` (``reports[rank][config]``) matches :func:`expected_members`.

    Size-1 gangs must be :class:`~gang.FakeGang` and a gang of every rank must be the root itself.
    """
    world = len(reports)
    for index, config in enumerate(configs):
        dp = world // (config["tp"] * config["pp"] * config["cp"])
        sdp = 1 if "intra" not in config else config["intra"] or dp
        sizes = {k: config[k] for k in ("tp", "pp", "cp", "ep")}
        for rank in range(world):
            got = reports[rank][index]
            want = expected_members(rank, world, sdp=sdp, etp=config.get("etp"), **sizes)
            assert not got["layout_none"]
            for role, members in [*want.items(), ("root", list(range(world)))]:
                name = role if isinstance(role, str) else "_".join(role)
                for key in [name] + ([] if isinstance(role, str) else ["nolayout_" + name]):
                    if key not in got:  # a report made without `without_layout`
                        continue
                    info = got[key]
                    assert info["members"] == members, (config, rank, key, info["members"], members)
                    assert info["rank"] == members.index(rank) and info["size"] == len(members)
                    assert info["sum"] == sum(m + 1 for m in members), (config, rank, key)
                    assert info["is_root"] == (len(members) == world), (config, rank, key)
                    if len(members) == 1:
                        assert info["kind"] == "FakeGang", (config, rank, key)  # no needless group
                if not isinstance(role, str):
                    assert got[name]["cached"], (config, rank, name)


def flatten_not_a_grid(root: Gang) -> str:
    """``flatten("dp", "tp")`` of gangs without a layout whose ``tp`` gangs (``[0, 2] [1, 3] [4, 6]
    [5, 7]``) pair ranks that the ``dp`` gangs (``[0, 2, 4, 6] [1, 3, 5, 7]``) already tell apart, so
    ranks 0 and 1 sit at the same coordinates: the error, the same on every rank."""
    made = gang.create_parallel_gangs(root, tp_size=2)
    crossed = root.split([[0, 2], [1, 3], [4, 6], [5, 7]])
    assert crossed is not None
    bare = dataclasses.replace(made, tp=crossed, layout=None)
    try:
        bare.flatten("dp", "tp")
        return "no error"
    except ValueError as ex:
        return str(ex)
    finally:
        crossed.close()
        for sub in {id(sub): sub for _, sub in made.items()}.values():
            if sub is not root:  # the root is the shared world's gang: later tests use it
                sub.close()
