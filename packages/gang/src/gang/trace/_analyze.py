"""Reading a directory of flight-recorder dumps and naming the likely culprits (``python -m gang.trace``).

Reads gang's dumps (``gang_trace_rank_<rank>``, with gang's own records of every operation) and
torch's own (entries only). Per gang: the last sequence number each rank reached; the ranks that
are behind and the operation they never entered; operations, shapes or dtypes that differ at one
sequence number; point-to-point transfers whose two sides differ or that one side never posted
(each rank's sends to a peer matched with that peer's receives from it, in posting order). A rank
that is behind because it is blocked in an earlier operation of another gang (the order the other
ranks ran those two operations in says which came first) is explained by that other wait; one that
is not is a suspect.
"""

from __future__ import annotations

import ast
import pickle
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gang.trace._recorder import FILE_PREFIX

_RANK_AT_END = re.compile(r"^(.*?)(\d+)$")


@dataclass
class Dump:
    """One rank's dump, as records of gang's own shape."""

    rank: int
    reason: str
    records: list[dict[str, Any]]
    members: dict[str, tuple[int, ...]]  # gang uid -> global ranks
    names: dict[str, str]  # gang uid -> role and position


@dataclass
class Group:
    """One gang across the dumps: its members and each dumped member's records in it."""

    uid: str
    name: str
    members: tuple[int, ...]
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


def load(directory: Path, prefix: str | None = None) -> list[Dump]:
    """Read every dump of ``directory`` (files ``<prefix><rank>``; ``None``: gang's prefix, else the one
    common prefix of the files whose names end in a number).

    :raises ValueError: If no dump is found.
    """
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))
    if prefix is None:
        prefixes = {m.group(1) for p in files if (m := _RANK_AT_END.match(p.name))}
        prefix = FILE_PREFIX if FILE_PREFIX in prefixes or len(prefixes) != 1 else prefixes.pop()
    dumps = []
    for path in files:
        m = _RANK_AT_END.match(path.name)
        if m is None or not m.group(1).endswith(prefix):
            continue
        with path.open("rb") as f:
            data = pickle.load(f)
        dumps.append(_dump_of(int(m.group(2)), data))
    if not dumps:
        raise ValueError(f"`{directory}` holds no flight-recorder dumps named `{prefix}<rank>`.")
    return sorted(dumps, key=lambda d: d.rank)


def _dump_of(rank: int, data: dict[str, Any]) -> Dump:
    own = data.get("gang")
    if own is not None:
        members = {uid: tuple(g["ranks"]) for uid, g in own["gangs"].items()}
        names = {uid: g["name"] for uid, g in own["gangs"].items()}
        return Dump(int(own["rank"]), str(own["reason"]), list(own["records"]), members, names)
    # torch's own dump: its entries, and its table of groups where it has one
    members, names = {}, {}
    for uid, config in data.get("pg_config", {}).items():
        try:
            ranks = ast.literal_eval(config.get("ranks", "[]"))
        except (ValueError, SyntaxError):
            ranks = []
        if ranks:
            members[str(uid)] = tuple(int(r) for r in ranks)
        if config.get("desc"):
            names[str(uid)] = str(config["desc"])
    records = []
    for e in data.get("entries", []):
        uid, desc = e["process_group"]
        names.setdefault(str(uid), str(desc) or str(uid))
        operation = str(e["profiling_name"]).split(":", 1)[-1].split(" ", 1)[0]
        records.append(
            {
                "record_id": e.get("record_id", 0),
                "gang": str(uid),
                "operation": operation,
                "seq": e["collective_seq_id"],
                "p2p_seq": e.get("p2p_seq_id", 0),
                "input_sizes": e.get("input_sizes", []),
                "input_dtypes": e.get("input_dtypes", []),
                "output_sizes": e.get("output_sizes", []),
                "output_dtypes": e.get("output_dtypes", []),
                "peers": [] if e.get("is_p2p") else None,
                "state": "completed" if e.get("state") == "completed" else "started",
                "error": None,
                "time_created_ns": e.get("time_created_ns", 0),
                "frames": e.get("frames", []),
                "context": None,
            }
        )
    return Dump(rank, "torch's flight recorder", records, members, names)


def groups_of(dumps: list[Dump]) -> list[Group]:
    """Every gang seen in the dumps (a gang is its id and its members: sub-gangs of one split share an id)."""
    found: dict[tuple[str, tuple[int, ...]], Group] = {}
    seen_in: dict[str, set[int]] = defaultdict(set)
    for d in dumps:
        for r in d.records:
            seen_in[r["gang"]].add(d.rank)
    for d in dumps:
        for r in d.records:
            uid = r["gang"]
            members = d.members.get(uid) or tuple(sorted(seen_in[uid]))
            key = (uid, members)
            group = found.get(key)
            if group is None:
                group = found[key] = Group(uid, r.get("gang_name") or d.names.get(uid, uid), members)
            group.records.setdefault(d.rank, []).append(r)
    return list(found.values())


def _collectives(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("peers") is None and r["operation"] != "step"]


def _signature(r: dict[str, Any]) -> str:
    return repr((r["operation"], r["input_sizes"], r["input_dtypes"], r["output_sizes"], r["output_dtypes"]))


def _spec(r: dict[str, Any]) -> str:
    def one(sizes: list[list[int]], dtypes: list[str]) -> str:
        return ", ".join(f"{d}{list(s)}" for s, d in zip(sizes, dtypes, strict=False)) or "nothing"

    return (
        f"{r['operation']}({one(r['input_sizes'], r['input_dtypes'])} -> {one(r['output_sizes'], r['output_dtypes'])})"
    )


def where(r: dict[str, Any] | None) -> str:
    """The caller's frame of a record (``file:line in function``), or ``"?"``."""
    frames = [] if r is None else r.get("frames") or []
    if not frames:
        return "?"
    # torch's own dumps start in torch.distributed: show the first frame of the caller's code
    f = next((f for f in frames if "torch/distributed/" not in f["filename"]), frames[0])
    return f"{f['filename']}:{f['line']} in {f['name']}"


def _role(name: str) -> str:
    return name.split(" of ", 1)[0]


def _blocked(dump: Dump) -> dict[str, Any] | None:
    """The operation the rank was in when it dumped: its last record if that did not complete."""
    ops = [r for r in dump.records if r["operation"] != "step"]
    if not ops:
        return None
    last = max(ops, key=lambda r: r["record_id"])
    return None if last["state"] == "completed" else last


def analyze(dumps: list[Dump]) -> dict[str, Any]:
    """The summary ``python -m gang.trace --json`` prints: ``"suspects"`` (most likely culprit first),
    ``"gangs"`` (per gang, each rank's last sequence number and what is wrong), ``"dumps"``."""
    by_rank = {d.rank: d for d in dumps}
    groups = groups_of(dumps)
    names = {(g.uid, g.members): g.name for g in groups}
    suspects: list[dict[str, Any]] = []
    gang_rows = []

    def group_name(record: dict[str, Any], rank: int) -> str:
        uid = record["gang"]
        fallback = record.get("gang_name") or by_rank[rank].names.get(uid, uid)
        return str(names.get((uid, by_rank[rank].members.get(uid, ())), fallback))

    def position(rank: int, role: str, seq: int, p2p: bool = False) -> int | None:
        """Where ``rank`` ran the operation #``seq`` of its gang of ``role`` (``p2p``: its ``seq``-th transfer call)."""
        for r in by_rank[rank].records:
            same = (r.get("peers") is not None) == p2p and r["p2p_seq" if p2p else "seq"] == seq
            if same and r["operation"] != "step" and _role(group_name(r, rank)) == role:
                return int(r["record_id"])
        return None

    def precedes(blocked: dict[str, Any], blocked_rank: int, role: str, seq: int) -> bool:
        """Whether the other ranks ran ``blocked`` (of its role and seq) before ``role`` #``seq``."""
        b_role = _role(group_name(blocked, blocked_rank))
        p2p = blocked.get("peers") is not None
        votes: Counter[bool] = Counter()
        for q in by_rank:
            if q == blocked_rank:
                continue
            a = position(q, b_role, blocked["p2p_seq" if p2p else "seq"], p2p)
            b = position(q, role, seq)
            if a is not None and b is not None and a != b:
                votes[a < b] += 1
        return votes[True] > votes[False]

    for g in sorted(groups, key=lambda g: (g.name, g.members)):
        colls = {rank: _collectives(recs) for rank, recs in g.records.items()}
        last = {rank: max((r["seq"] for r in recs), default=0) for rank, recs in colls.items()}
        row: dict[str, Any] = {
            "gang": g.name,
            "id": g.uid,
            "ranks": list(g.members),
            "last_seq": {str(rank): last.get(rank) for rank in g.members},
            "behind": [],
            "mismatches": [],
            "no_dump": [rank for rank in g.members if rank not in by_rank],
        }
        top = max(last.values(), default=0)
        # mismatched calls at one sequence number (the first only: later ones follow from it)
        by_seq: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        for rank, recs in colls.items():
            for r in recs:
                by_seq[r["seq"]][rank] = r
        for seq in sorted(by_seq):
            calls = by_seq[seq]
            sigs = Counter(_signature(r) for r in calls.values())
            if len(sigs) < 2:
                continue
            culprits = _odd_ones(g, calls, sigs)
            for rank in culprits:
                mine = calls[rank]
                others = {q: r for q, r in calls.items() if _signature(r) != _signature(mine)}
                their = next(iter(others.values()))
                reason = (
                    f"called {_spec(mine)} as #{seq} of {g.name} at {where(mine)}, while rank(s) "
                    f"{sorted(others)} called {_spec(their)} at {where(their)}"
                )
                suspects.append(_suspect(rank, g.name, seq, mine["operation"], reason, 0, mine))
            row["mismatches"].append({"seq": seq, "calls": {str(q): _spec(r) for q, r in sorted(calls.items())}})
            break
        # ranks behind the others in this gang
        if top:
            waiters = [q for q in colls if last[q] == top]
            waiting = by_seq[top][waiters[0]]
            since = min(by_seq[top][q]["time_created_ns"] for q in waiters)
            for rank in g.members:
                if rank not in by_rank:
                    reason = (
                        f"left no dump (dead, or stuck where it could not dump) while rank(s) {sorted(waiters)} "
                        f"wait in {waiting['operation']} #{top} of {g.name} at {where(waiting)}"
                    )
                    if waiting.get("context"):
                        reason += f" (in {waiting['context']})"
                    suspects.append(_suspect(rank, g.name, top, waiting["operation"], reason, 1, None, since))
                    continue
                if last.get(rank, 0) >= top:
                    continue
                seq = last.get(rank, 0) + 1
                missed = next(iter(by_seq[seq].values()))
                blocked = _blocked(by_rank[rank])
                explained = (
                    blocked is not None and blocked["gang"] != g.uid and precedes(blocked, rank, _role(g.name), seq)
                )
                now = (
                    "it is not in any operation (finished, or busy outside the gangs)"
                    if blocked is None
                    else f"it is in {blocked['operation']} #{blocked['seq']} of {group_name(blocked, rank)} "
                    f"at {where(blocked)} ({blocked['state']}{', ' + blocked['error'] if blocked.get('error') else ''})"
                )
                entered = sorted(q for q in by_seq[seq])
                reason = (
                    f"never entered {missed['operation']} #{seq} of {g.name}, which rank(s) {entered} entered at "
                    f"{where(missed)}; {now}"
                )
                if blocked is not None and blocked.get("context"):
                    reason += f" ({blocked['context']})"
                row["behind"].append({"rank": rank, "seq": seq, "operation": missed["operation"]})
                since_seq = min(r["time_created_ns"] for r in by_seq[seq].values())
                suspects.append(
                    _suspect(rank, g.name, seq, missed["operation"], reason, 3 if explained else 2, missed, since_seq)
                )
        row["transfers"] = _unmatched_transfers(g, by_rank, suspects)
        gang_rows.append(row)
    suspects.sort(key=lambda s: (s.pop("_tier"), s.pop("_since")))
    return {
        "dumps": {str(d.rank): d.reason for d in dumps},
        "suspects": suspects,
        "gangs": gang_rows,
    }


def _transfers(g: Group, dump: Dump) -> dict[tuple[str, int], list[tuple[str, dict[str, Any]]]] | None:
    """The point-to-point transfers in ``g`` of the rank that left ``dump``, in the order it posted them, by
    direction and peer (a global rank): each the tensor's spec and its call's record. Empty if its dump
    lists ``g`` without a record of it (it ran nothing there); ``None`` if its records of ``g`` no longer
    start before its first transfer call (the ring dropped older ones) or name no peers (torch's)."""
    records = [r for r in g.records.get(dump.rank, []) if r["operation"] != "step"]
    if not records:
        return {} if dump.members.get(g.uid) == g.members else None
    calls = [r for r in records if r.get("peers") is not None]
    # every record carries the number of transfer calls posted before or with it: 0 before any
    posted_before = [r["p2p_seq"] - (1 if r.get("peers") is not None else 0) for r in records]
    if min(posted_before) != 0 or not all(r["peers"] for r in calls):
        return None
    found: dict[tuple[str, int], list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for r in sorted(calls, key=lambda r: r["p2p_seq"]):
        sides = (
            ("send", r["input_sizes"], r["input_dtypes"], r["peers"][0]),
            ("recv", r["output_sizes"], r["output_dtypes"], r["peers"][1]),
        )
        for kind, sizes, dtypes, peers in sides:
            for size, dtype, peer in zip(sizes, dtypes, peers, strict=False):
                if 0 <= peer < len(g.members):
                    found[kind, g.members[peer]].append((f"{dtype}{list(size)}", r))
    return found


def _unmatched_transfers(g: Group, by_rank: dict[int, Dump], suspects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Match each rank's sends to a peer with that peer's receives from it, in posting order; add a suspect for
    the first transfer of each pair whose tensors differ, or that the other side never posted."""
    rows: list[dict[str, Any]] = []
    posted = {rank: _transfers(g, by_rank[rank]) for rank in g.members if rank in by_rank}
    pairs = sorted(
        {
            (rank, peer) if kind == "send" else (peer, rank)
            for rank, found in posted.items()
            for kind, peer in found or {}
        }
    )
    for src, dst in pairs:
        if posted.get(src) is None or posted.get(dst) is None:
            continue  # a side without a dump, or whose ring no longer holds its first transfers
        sends = (posted[src] or {}).get(("send", dst), [])
        recvs = (posted[dst] or {}).get(("recv", src), [])
        for k in range(max(len(sends), len(recvs))):
            send = sends[k] if k < len(sends) else None
            recv = recvs[k] if k < len(recvs) else None
            if send is not None and recv is not None and send[0] == recv[0]:
                continue
            n = k + 1
            if send is not None and recv is not None:
                rank, record = dst, recv[1]
                reason = (
                    f"received {recv[0]} as transfer #{n} from rank {src} at {where(recv[1])}, while rank "
                    f"{src} sent {send[0]} to it at {where(send[1])}"
                )
            elif send is not None:
                rank, record = dst, send[1]
                reason = (
                    f"never posted the receive for transfer #{n} from rank {src} ({send[0]}), which rank "
                    f"{src} sent at {where(send[1])}"
                )
            else:
                assert recv is not None
                rank, record = src, recv[1]
                reason = (
                    f"never posted the send for transfer #{n} to rank {dst} ({recv[0]}), which rank {dst} "
                    f"waits to receive at {where(recv[1])}"
                )
            # A side that never posted its part while it waits in another operation is explained by
            # that wait (listed after every other suspect, like a rank behind for the same reason).
            blocked = _blocked(by_rank[rank])
            elsewhere = blocked is not None and not (blocked["gang"] == g.uid and blocked.get("peers") is not None)
            tier = 0 if send is not None and recv is not None else 4 if elsewhere else 2
            op = record["operation"]
            suspects.append(_suspect(rank, g.name, record["p2p_seq"], op, reason, tier, record))
            rows.append({"from": src, "to": dst, "transfer": n, "sent": send and send[0], "received": recv and recv[0]})
            break
    return rows


def _suspect(
    rank: int,
    gang: str,
    seq: int,
    operation: str,
    reason: str,
    tier: int,
    record: dict[str, Any] | None,
    since: int = 0,
) -> dict[str, Any]:
    return {
        "rank": rank,
        "gang": gang,
        "seq": seq,
        "operation": operation,
        "reason": reason,
        "frames": [] if record is None else record.get("frames") or [],
        "_tier": tier,
        "_since": since,
    }


def _odd_ones(g: Group, calls: dict[int, dict[str, Any]], sigs: Counter[str]) -> list[int]:
    """The ranks whose call differs: the minority; on a tie, those whose call differs from their own last call
    of the same operation from the same place (they changed; the others did not)."""
    counts = sorted(sigs.values())
    if counts[-1] > counts[-2]:
        common = sigs.most_common(1)[0][0]
        return sorted(q for q, r in calls.items() if _signature(r) != common)
    changed = []
    for q, r in calls.items():
        before = [
            p
            for p in _collectives(g.records[q])
            if p["seq"] < r["seq"] and p["operation"] == r["operation"] and where(p) == where(r)
        ]
        if before and _signature(before[-1]) != _signature(r):
            changed.append(q)
    return sorted(changed) or sorted(calls)


def render(summary: dict[str, Any], directory: Path) -> str:
    """The summary as a person reads it."""
    lines = [f"gang.trace: {len(summary['dumps'])} dump(s) in {directory}"]
    reasons = Counter(summary["dumps"].values())
    for reason, n in reasons.most_common(3):
        lines.append(f"  {n} dumped on: {reason[:160]}")
    lines.append("")
    if summary["suspects"]:
        lines.append("Suspects, most likely first:")
        for i, s in enumerate(summary["suspects"][:10], 1):
            lines.append(f"  {i}. rank {s['rank']}, {s['operation']} #{s['seq']} of {s['gang']}: {s['reason']}")
    else:
        lines.append("No suspect: every gang's ranks reached the same operation with the same shapes.")
    lines.append("")
    lines.append("Gangs (last sequence number of each rank):")
    quiet = 0
    for row in summary["gangs"]:
        if not (row["behind"] or row["mismatches"] or row["no_dump"] or row["transfers"]):
            quiet += 1
            continue
        seqs = ", ".join(f"{r}: {s if s is not None else '-'}" for r, s in row["last_seq"].items())
        lines.append(f"  {row['gang']} (ranks {row['ranks']}): {seqs}")
        for b in row["behind"]:
            lines.append(f"    behind: rank {b['rank']} never entered {b['operation']} #{b['seq']}")
        for t in row["transfers"]:
            lines.append(
                f"    transfer #{t['transfer']} from rank {t['from']} to rank {t['to']}: "
                f"sent {t['sent'] or 'nothing'}, received {t['received'] or 'nothing'}"
            )
        for m in row["mismatches"]:
            lines.append(f"    mismatch at #{m['seq']}: " + "; ".join(f"rank {r}: {c}" for r, c in m["calls"].items()))
        if row["no_dump"]:
            lines.append(f"    no dump from rank(s) {row['no_dump']}")
    if quiet:
        lines.append(f"  ({quiet} other gang(s) in step on every rank)")
    return "\n".join(lines)
