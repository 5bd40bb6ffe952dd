"""What black boxes show, per rank: the steps held and their span, the median step, and the
slowest step with where its time went (regions, collectives, the frames sampled most in it
against the same frames in the rank's other steps)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from profd.blackbox.box import label, steps_of

#: Frames named per slowest step.
TOP_FRAMES = 3


def rank_summary(b: dict[str, Any]) -> dict[str, Any]:
    steps = steps_of(b)
    out: dict[str, Any] = {
        "rank": b.get("rank"),
        "role": b.get("role"),
        "node": b.get("node"),
        "host": b.get("host"),
        "pid": b.get("pid"),
        "name": label(b),
        "steps": len(steps),
        "first_step": steps[0][0] if steps else None,
        "last_step": steps[-1][0] if steps else None,
        "span_s": round(steps[-1][2] - steps[0][1], 6) if steps else 0.0,
        "samples": len(b["samples"]),
        "collectives": None if b.get("collectives") is None else len(b["collectives"]),
    }
    if b.get("collectives_error"):
        out["collectives_error"] = b["collectives_error"]
    if not steps:
        out["median_s"] = None
        out["slowest"] = None
        return out
    out["median_s"] = round(statistics.median(e - s for _, s, e in steps), 6)
    step, start, end = max(steps, key=lambda x: x[2] - x[1])
    out["slowest"] = slowest(b, step, start, end)
    return out


def slowest(b: dict[str, Any], step: int, start: float, end: float) -> dict[str, Any]:
    """Where step ``step`` (``start``..``end``) of box ``b`` spent its time."""
    total = end - start
    regions: dict[str, float] = {}
    for s, idx, _end, seconds in b["records"]:
        if s == step:
            name = b["regions"][idx]
            regions[name] = regions.get(name, 0.0) + seconds
    colls = []
    for c in b.get("collectives") or []:
        begin = c.get("started") or c.get("created")
        done = c.get("completed")
        if begin is None or not start <= begin <= end:
            continue
        wait = (done - begin) if done is not None else c.get("ms", None)
        colls.append({"op": c["op"], "seq": c["seq"], "s": None if wait is None else wait})
    return {
        "step": step,
        "seconds": round(total, 6),
        "regions": {k: round(v, 6) for k, v in sorted(regions.items(), key=lambda kv: -kv[1])},
        "outside_regions_s": round(max(0.0, total - sum(regions.values())), 6),
        "collectives": colls,
        "frames": hot_frames(b, step),
    }


def hot_frames(b: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """The frames sampled most in ``step``, with their share of its samples and of the
    rank's other steps' samples."""
    inside: Counter[str] = Counter()
    outside: Counter[str] = Counter()
    depth: dict[str, int] = {}  # how far from the innermost frame each was seen, at least
    n_in = n_out = 0
    for _t, s, sid in b["samples"]:
        if sid < 0:
            continue
        stack = [b["frames"][f] for f in b["stacks"][sid]]
        texts = set(stack)
        if s == step:
            n_in += 1
            inside.update(texts)
            for d, text in enumerate(stack):
                depth[text] = min(d, depth.get(text, d))
        else:
            n_out += 1
            outside.update(texts)
    if not n_in:
        return []
    # Rank by share in the step, then by how rarely the other steps were there, then the
    # deepest first: a caller is in every sample its callee is, and says less.
    ranked = sorted(inside, key=lambda f: (-inside[f], outside[f] / max(1, n_out), depth[f], f))
    return [
        {
            "frame": f,
            "share": round(inside[f] / n_in, 3),
            "elsewhere": round(outside[f] / n_out, 3) if n_out else None,
        }
        for f in ranked
        if (outside[f] / n_out if n_out else 0.0) < 0.5 or len(ranked) <= TOP_FRAMES
    ][:TOP_FRAMES]


def summarize(
    boxes: Sequence[dict[str, Any]], missing: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """The ``--json`` summary: per rank, and the steps every rank holds (what aligns)."""
    ranks = [rank_summary(b) for b in boxes]
    held = [r for r in ranks if r["steps"]]
    common = None
    if held:
        lo = max(r["first_step"] for r in held)
        hi = min(r["last_step"] for r in held)
        common = [lo, hi] if lo <= hi else None
    return {"ranks": ranks, "common_steps": common, "missing": list(missing)}


def text(doc: dict[str, Any]) -> list[str]:
    """The summary in lines, a rank each."""
    lines = []
    for r in doc["ranks"]:
        if not r["steps"]:
            lines.append(f"{r['name']}: no steps held")
            continue
        head = (
            f"{r['name']}: steps {r['first_step']}..{r['last_step']} ({r['steps']},"
            f" {r['span_s']:.1f}s), median {r['median_s'] * 1e3:.1f} ms"
        )
        s = r["slowest"]
        where = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in s["regions"].items())
        where = where or "no regions"
        head += f"; slowest step {s['step']} {s['seconds'] * 1e3:.1f} ms ({where})"
        if s["frames"]:
            head += f", mostly in {s['frames'][0]['frame']}"
        lines.append(head)
    if doc.get("common_steps"):
        lo, hi = doc["common_steps"]
        lines.append(f"steps {lo}..{hi} are held by every rank")
    for m in doc.get("missing", []):
        lines.append(f"{m.get('node') or m.get('host')}/{m['role']} rank {m['rank']}: {m['why']}")
    return lines
