"""``profctl diff A B``: what changed between two sessions, per operator and per step.

Both sides are reduced the same way: an operator's time is its self time per profiled step,
the median over ranks (a straggler moves a median little, and the diff asks what changed for
the job as a whole); a step's time is the mean over ranks. Rows are sorted by the size of the
change, largest first, whichever its sign.

A rank's statistics keep only its top operators (``STATS_TOP_N``), so an operator a rank does
not list took less than its last listed one, not nothing. A side's median is known when the
ranks not listing the operator are fewer than half (they sit below the median, whatever
their times); else the operator was **not recorded** on that side: its time there is
``None``, and so is the change, instead of a drop to 0 that never happened. Such rows sort
by the side that has a time.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from profd.report.model import Report
from profd.textfmt import printable

DIFF_ROWS = 20


def _med(values: list[float]) -> float:
    return median(values) if values else 0.0


def _op_times(r: Report) -> dict[str, float | None]:
    """Per operator, the median over ranks of its time per step; None where not recorded."""
    names = {n for rank in r.ranks for n in rank.ops}
    out: dict[str, float | None] = {}
    for n in names:
        listed = [rank.per_step(rank.ops[n]) for rank in r.ranks if n in rank.ops]
        missing = len(r.ranks) - len(listed)
        # The ranks not listing it are the lowest; the median is among the listed ones
        # while they fill both middle places.
        known = missing <= (len(r.ranks) - 1) // 2
        out[n] = _med([0.0] * missing + listed) if known else None
    return out


def _step_times(r: Report) -> list[tuple[int, float]]:
    steps = r.steps or sorted({s for rank in r.ranks for s in rank.steps})
    out = []
    for s in steps:
        vals = [rank.steps[s][0] for rank in r.ranks if s in rank.steps]
        out.append((s, sum(vals) / len(vals)))
    return out


def _delta(a: float, b: float) -> dict[str, Any]:
    return {
        "a_ms": round(a, 3),
        "b_ms": round(b, 3),
        "delta_ms": round(b - a, 3),
        "pct": round(100.0 * (b - a) / a, 1) if a else None,
    }


def _op_delta(a: float | None, b: float | None) -> dict[str, Any]:
    if a is not None and b is not None:
        return {**_delta(a, b), "not_recorded": None}
    return {
        "a_ms": None if a is None else round(a, 3),
        "b_ms": None if b is None else round(b, 3),
        "delta_ms": None,
        "pct": None,
        "not_recorded": "a" if a is None else "b",
    }


def _op_order(o: dict[str, Any]) -> tuple[float, str]:
    size = o["delta_ms"] if o["delta_ms"] is not None else (o["a_ms"] or o["b_ms"] or 0.0)
    return (-abs(size), o["name"])


def diff_reports(a: Report, b: Report, rows: int = DIFF_ROWS) -> dict[str, Any]:
    oa, ob = _op_times(a), _op_times(b)
    # An operator recorded on neither side has nothing to compare.
    names = {n for n in oa.keys() | ob.keys() if oa.get(n) is not None or ob.get(n) is not None}
    ops = [{"name": n, **_op_delta(oa.get(n), ob.get(n))} for n in names]
    ops.sort(key=_op_order)
    sa, sb = _step_times(a), _step_times(b)
    # The same job's session pairs steps by number; two runs pair them by position.
    same = {s for s, _ in sa} & {s for s, _ in sb}
    if same:
        da, db = dict(sa), dict(sb)
        pairs = [(s, s, da[s], db[s]) for s in sorted(same)]
    else:
        pairs = [(x[0], y[0], x[1], y[1]) for x, y in zip(sa, sb, strict=False)]
    steps = [{"a_step": p, "b_step": q, **_delta(x, y)} for p, q, x, y in pairs]
    steps.sort(key=lambda s: (-abs(s["delta_ms"]), s["a_step"]))
    parts = {}
    for i, part in enumerate(("step", "compute", "collective", "idle")):
        parts[part] = _delta(_med([s[i] for s in a.summaries]), _med([s[i] for s in b.summaries]))
    return {
        "a": a.session,
        "b": b.session,
        "ranks": {"a": len(a.ranks), "b": len(b.ranks)},
        "summary": parts,
        "ops": ops[:rows],
        "steps": steps[:rows],
    }


def _or_dash(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def diff_text(d: dict[str, Any]) -> str:
    s = d["summary"]
    lines = [f"A {d['a']} ({d['ranks']['a']} ranks)  ->  B {d['b']} ({d['ranks']['b']} ranks)"]
    for part in ("step", "compute", "collective", "idle"):
        x = s[part]
        pct = "" if x["pct"] is None else f" ({x['pct']:+.1f}%)"
        lines.append(
            f"{part + ' ms/step':<22} {x['a_ms']:>10.3f} -> {x['b_ms']:>10.3f}"
            f"  {x['delta_ms']:+.3f}{pct}"
        )
    lines += ["", f"{'operator (ms/step, median rank)':<52} {'A':>9} {'B':>9} {'delta':>9}"]
    for o in d["ops"]:
        a, b, dl = (
            _or_dash(o[k], f) for k, f in (("a_ms", ".3f"), ("b_ms", ".3f"), ("delta_ms", "+.3f"))
        )
        note = f"  not recorded in {o['not_recorded'].upper()}" if o["not_recorded"] else ""
        lines.append(f"{o['name'][:52]:<52} {a:>9} {b:>9} {dl:>9}{note}")
    if any(o["not_recorded"] for o in d["ops"]):
        lines.append("(-: not recorded: below the top operators each rank keeps, on most ranks)")
    lines += ["", f"{'step (A/B)':<22} {'A ms':>9} {'B ms':>9} {'delta':>9}"]
    for x in d["steps"]:
        lines.append(
            f"{str(x['a_step']) + '/' + str(x['b_step']):<22} {x['a_ms']:>9.3f} {x['b_ms']:>9.3f}"
            f" {x['delta_ms']:>+9.3f}"
        )
    # Operator names come from the traces: one line each whatever they hold.
    return "\n".join(printable(x) for x in lines) + "\n"
