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

from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from profd.watch.stackgroups import label
from profd.watch.stackrows import Member, StackRank


class Behind(Member, frozen=True, gc=False):
    """A rank that never enqueued a group's collective, and the last one it did."""

    last: int


class Without(Member, frozen=True, gc=False):
    """A rank whose recorder is on but that gave no summary, and why."""

    why: str


class PgDivergence(msgspec.Struct, frozen=True, kw_only=True):
    """Where one process group's ranks first differ: at collective ``seq``, some ranks never
    enqueued it (``behind``: the ones everyone waits for; ``ahead``: those at or past it;
    ``op``: what it was) or they enqueued different operations or sizes under it
    (``mismatch``: ``ops``, each operation and sizes with its ranks)."""

    pg: str
    desc: str
    seq: int
    kind: Literal["behind", "mismatch"]
    op: str | None
    ahead: tuple[Member, ...]
    behind: tuple[Behind, ...]
    ops: dict[str, tuple[Member, ...]]


class Divergence(msgspec.Struct, frozen=True, kw_only=True):
    """Where the ranks' flight recorders part: the groups that differ (lowest ``seq``
    first), the ranks whose recorder is on but gave no summary, and how many sent one."""

    groups: tuple[PgDivergence, ...]
    without: tuple[Without, ...]
    ranks: int


def divergence(ranks: Iterable[StackRank]) -> Divergence | None:
    """Where the ranks' flight recorders part (:class:`Divergence`), or None when no rank
    sent a summary; each group's lowest ``seq`` where its ranks differ."""
    flights: dict[Member, dict[str, Any]] = {}
    without = []
    for r in ranks:
        if r.flight is not None:
            flights[r.member] = r.flight
        elif r.flight_error:
            without.append(Without(r.host, r.role, r.rank, r.flight_error))
    if not flights:
        return None
    pgs: dict[str, dict[Member, int]] = {}
    desc: dict[str, str] = {}
    ops: dict[str, dict[Member, dict[int, tuple[str, str]]]] = {}
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
    out = [
        found
        for pg in sorted(pgs)
        if (found := _first_difference(pg, desc.get(pg, ""), pgs[pg], ops.get(pg, {}))) is not None
    ]
    out.sort(key=lambda g: (g.seq, g.pg))
    return Divergence(groups=tuple(out), without=tuple(without), ranks=len(flights))


def _first_difference(
    pg: str, desc: str, last: dict[Member, int], ops: dict[Member, dict[int, tuple[str, str]]]
) -> PgDivergence | None:
    """One process group: where its ranks (those that reported it) first differ."""
    if len(last) < 2:
        return None
    seqs = sorted({s for per in ops.values() for s in per})
    # A mismatch: two ranks recorded different operations (or sizes) at the same number,
    # both still in their rings.
    for s in seqs:
        at = {w: per[s] for w, per in ops.items() if s in per}
        kinds: dict[tuple[str, str], list[Member]] = {}
        for w, k in at.items():
            kinds.setdefault(k, []).append(w)
        if len(kinds) > 1:
            return PgDivergence(
                pg=pg,
                desc=desc,
                seq=s,
                kind="mismatch",
                op=None,
                ops={f"{k[0]} {k[1]}": tuple(sorted(ws)) for k, ws in kinds.items()},
                ahead=(),
                behind=(),
            )
    top = max(last.values())
    low = min(last.values())
    if top == low:
        return None
    seq = low + 1  # the first collective some ranks enqueued and the others never did
    op = next((per[seq][0] for per in ops.values() if seq in per), None)
    return PgDivergence(
        pg=pg,
        desc=desc,
        seq=seq,
        kind="behind",
        op=op,
        ops={},
        ahead=tuple(sorted(w for w, s in last.items() if s >= seq)),
        behind=tuple(Behind(w.host, w.role, w.rank, s) for w, s in sorted(last.items()) if s < seq),
    )


#: Entries a hang incident keeps of each rank's summary (the newest): enough to see where
#: the ranks part, small enough for the index.
KEEP_ENTRIES = 8


def kept(flight: dict[str, Any]) -> dict[str, Any]:
    """A rank's summary as an incident keeps it."""
    return {**flight, "entries": list(flight.get("entries") or ())[-KEEP_ENTRIES:]}


def _hosts(doc: Divergence) -> bool:
    """Whether the ranks compared span several nodes (labels then name them)."""
    seen = {w.host for w in doc.without}
    for g in doc.groups:
        seen.update(m.host for m in (*g.ahead, *g.behind))
        seen.update(m.host for ms in g.ops.values() for m in ms)
    return len(seen) > 1


def text(doc: Divergence | None) -> list[str]:
    """The divergence as lines a human reads: one per process group that differs."""
    if doc is None:
        return []
    hosts = _hosts(doc)
    lines = []
    for g in doc.groups:
        pg = g.pg + (f" ({g.desc})" if g.desc else "")
        if g.kind == "behind":
            lines.append(
                f"flight recorder: process group {pg}: {label(g.behind, hosts)} never reached"
                f" collective #{g.seq}"
                + (f" ({g.op})" if g.op else "")
                + f" that {label(g.ahead, hosts)} entered"
            )
        else:
            parts = "; ".join(f"{label(ms, hosts)}: {op}" for op, ms in g.ops.items())
            lines.append(
                f"flight recorder: process group {pg}: ranks disagree on collective"
                f" #{g.seq}: {parts}"
            )
    if not doc.groups:
        lines.append(
            f"flight recorder: the {doc.ranks} ranks that sent one agree on every collective"
        )
    for w in doc.without:
        lines.append(f"flight recorder: none from {label([w], hosts)}: {w.why}")
    return lines
