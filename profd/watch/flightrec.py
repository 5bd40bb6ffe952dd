"""Where the ranks' flight recorders part (docs/design.md "Hangs"): given each rank's summary (what
its agent thread dumped, ``profd_client.flight``), per process group the first collective
sequence number the ranks disagree on: some ranks enqueued it and others never did (they
are behind: the ones everyone waits for), or they enqueued different operations or sizes
under the same number (a mismatch: ranks calling collectives in different orders). Pure:
the daemon (one node) and profctl (``--cluster``) use the same function.

The summary comes from another process: nothing in it is trusted beyond its schema (the
protocol checked that); a rank whose summary is missing is listed, not guessed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from profd.watch.stackgroups import label
from profd.watch.stackrows import Member, StackRank

Who = tuple[str, str, int]  # (host, role, rank)


def _who(r: StackRank) -> Who:
    return (r.host, r.role, r.rank)


def _member(w: Who) -> dict[str, Any]:
    return {"host": w[0], "role": w[1], "rank": w[2]}


def divergence(ranks: Iterable[StackRank]) -> dict[str, Any] | None:
    """``{"groups": [per process group where ranks differ], "without": [ranks whose
    recorder is on but gave no summary, with why], "ranks": n}`` or None when no rank sent
    a summary. A group's entry: ``{"pg", "desc", "seq", "kind": "behind" | "mismatch",
    "op", "ahead": [ranks at or past seq], "behind": [{rank..., "last"}], "ops": {op:
    [ranks]}}`` (``ops`` for a mismatch), the lowest such ``seq`` of the group."""
    flights: dict[Who, dict[str, Any]] = {}
    without = []
    for r in ranks:
        if r.flight is not None:
            flights[_who(r)] = r.flight
        elif r.flight_error:
            without.append({**_member(_who(r)), "why": r.flight_error})
    if not flights:
        return None
    pgs: dict[str, dict[Who, int]] = {}
    desc: dict[str, str] = {}
    ops: dict[str, dict[Who, dict[int, tuple[str, str]]]] = {}
    for who, f in flights.items():
        for pg in f.get("pgs") or ():
            pgs.setdefault(pg["pg"], {})[who] = int(pg["enqueued"])
            desc.setdefault(pg["pg"], pg.get("desc") or "")
        for e in f.get("entries") or ():
            if e.get("p2p"):
                continue  # point-to-point numbers are per pair, not per group
            seen = ops.setdefault(e["pg"], {}).setdefault(who, {})
            seen[int(e["seq"])] = (str(e["op"]), repr(e.get("sizes")))
            last = pgs.setdefault(e["pg"], {})
            last[who] = max(last.get(who, -1), int(e["seq"]))
    out = []
    for pg in sorted(pgs):
        found = _first_difference(pgs[pg], ops.get(pg, {}), len(flights))
        if found is not None:
            out.append({"pg": pg, "desc": desc.get(pg, ""), **found})
    out.sort(key=lambda g: (g["seq"], g["pg"]))
    return {"groups": out, "without": without, "ranks": len(flights)}


def _first_difference(
    last: dict[Who, int], ops: dict[Who, dict[int, tuple[str, str]]], n: int
) -> dict[str, Any] | None:
    """One process group: where its ranks (those that reported it) first differ."""
    if len(last) < 2:
        return None
    seqs = sorted({s for per in ops.values() for s in per})
    # A mismatch: two ranks recorded different operations (or sizes) at the same number,
    # both still in their rings.
    for s in seqs:
        at = {w: per[s] for w, per in ops.items() if s in per}
        kinds: dict[tuple[str, str], list[Who]] = {}
        for w, k in at.items():
            kinds.setdefault(k, []).append(w)
        if len(kinds) > 1:
            return {
                "seq": s,
                "kind": "mismatch",
                "op": None,
                "ops": {
                    f"{k[0]} {k[1]}": [_member(w) for w in sorted(ws)] for k, ws in kinds.items()
                },
                "ahead": [],
                "behind": [],
            }
    top = max(last.values())
    low = min(last.values())
    if top == low:
        return None
    seq = low + 1  # the first collective some ranks enqueued and the others never did
    op = next((per[seq][0] for per in ops.values() if seq in per), None)
    return {
        "seq": seq,
        "kind": "behind",
        "op": op,
        "ops": {},
        "ahead": [_member(w) for w in sorted(w for w, s in last.items() if s >= seq)],
        "behind": [{**_member(w), "last": s} for w, s in sorted(last.items()) if s < seq],
    }


#: Entries a hang incident keeps of each rank's summary (the newest): enough to see where
#: the ranks part, small enough for the index.
KEEP_ENTRIES = 8


def kept(flight: dict[str, Any]) -> dict[str, Any]:
    """A rank's summary as an incident keeps it."""
    return {**flight, "entries": list(flight.get("entries") or ())[-KEEP_ENTRIES:]}


def _hosts(doc: dict[str, Any]) -> bool:
    """Whether the ranks compared span several nodes (labels then name them)."""
    seen = {w["host"] for w in doc["without"]}
    for g in doc["groups"]:
        seen.update(m["host"] for m in (*g["ahead"], *g["behind"]))
        seen.update(m["host"] for ms in g["ops"].values() for m in ms)
    return len(seen) > 1


def text(doc: dict[str, Any] | None) -> list[str]:
    """The divergence as lines a human reads: one per process group that differs."""
    if doc is None:
        return []
    hosts = _hosts(doc)

    def _label(members: Sequence[dict[str, Any]]) -> str:
        return label((Member(m["host"], m["role"], m["rank"]) for m in members), hosts)

    lines = []
    for g in doc["groups"]:
        pg = g["pg"] + (f" ({g['desc']})" if g.get("desc") else "")
        if g["kind"] == "behind":
            behind = _label(g["behind"])
            lines.append(
                f"flight recorder: process group {pg}: {behind} never reached collective"
                f" #{g['seq']}"
                + (f" ({g['op']})" if g.get("op") else "")
                + f" that {_label(g['ahead'])} entered"
            )
        else:
            parts = "; ".join(f"{_label(ms)}: {op}" for op, ms in g["ops"].items())
            lines.append(
                f"flight recorder: process group {pg}: ranks disagree on collective"
                f" #{g['seq']}: {parts}"
            )
    if not doc["groups"]:
        lines.append(
            f"flight recorder: the {doc['ranks']} ranks that sent one agree on every collective"
        )
    for w in doc["without"]:
        lines.append(f"flight recorder: none from {_label([w])}: {w['why']}")
    return lines
