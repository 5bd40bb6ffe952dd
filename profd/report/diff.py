"""``profctl diff A B``: what changed between two sessions, per operator and per step.

Both sides are reduced the same way: an operator's time is its self time per profiled step,
the median over ranks (a straggler moves a median little, and the diff asks what changed for
the job as a whole); a step's time is the mean over ranks. Rows are sorted by the size of the
change, largest first, whichever its sign.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from profd.report.model import Report

DIFF_ROWS = 20


def _med(values: list[float]) -> float:
    return median(values) if values else 0.0


def _op_times(r: Report) -> dict[str, float]:
    names = {n for rank in r.ranks for n in rank.ops}
    return {n: _med([rank.per_step(rank.ops.get(n, 0.0)) for rank in r.ranks]) for n in names}


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


def diff_reports(a: Report, b: Report, rows: int = DIFF_ROWS) -> dict[str, Any]:
    oa, ob = _op_times(a), _op_times(b)
    ops = [{"name": n, **_delta(oa.get(n, 0.0), ob.get(n, 0.0))} for n in oa.keys() | ob.keys()]
    ops.sort(key=lambda o: (-abs(o["delta_ms"]), o["name"]))
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
        lines.append(
            f"{o['name'][:52]:<52} {o['a_ms']:>9.3f} {o['b_ms']:>9.3f} {o['delta_ms']:>+9.3f}"
        )
    lines += ["", f"{'step (A/B)':<22} {'A ms':>9} {'B ms':>9} {'delta':>9}"]
    for x in d["steps"]:
        lines.append(
            f"{str(x['a_step']) + '/' + str(x['b_step']):<22} {x['a_ms']:>9.3f} {x['b_ms']:>9.3f}"
            f" {x['delta_ms']:>+9.3f}"
        )
    return "\n".join(lines) + "\n"
