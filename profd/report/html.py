"""The HTML report: one self-contained page (inline CSS and SVG, no script, no fetch).

It opens offline, from a mail attachment or an S3 console, and it has to stay readable at
8,192 ranks: up to :data:`ROW_LIMIT` ranks get a row each; beyond, heat map rows are groups of
consecutive ranks (each cell the slowest of its group, which is the one that matters in a
synchronous job), and bar charts show the ranks at fixed percentiles plus the stragglers.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from profd.report.model import OPS_NOTE, Report, over_step_note, spotlight, verdict_text

ROW_LIMIT = 64
HEAT_ROWS = 128
WIDTH = 900
LABEL_W = 210
COLORS = {"compute": "#4c78a8", "collective": "#f58518", "idle": "#bab0ac"}

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
.verdict{padding:10px 14px;border-radius:6px;background:#eef6ee}
.verdict.bad{background:#fdecea}
table{border-collapse:collapse}td,th{padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}tr.out td{background:#fff3e0}
.key span{display:inline-block;width:10px;height:10px;margin:0 4px 0 12px}
svg text{font:11px system-ui,sans-serif}.muted{color:#777}
"""


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def heat_color(frac: float) -> str:
    """Light yellow (fast) to dark red (slow)."""
    f = min(max(frac, 0.0), 1.0)
    r = round(255 - 80 * f)
    g = round(245 - 215 * f)
    b = round(200 - 170 * f)
    return f"rgb({r},{g},{b})"


def heat_map(report: Report, col: int, title: str) -> str:
    """Ranks (or groups of ranks) by steps, the cell colour the step's ``col`` value."""
    ranks, steps = report.ranks, report.steps
    if not steps:
        return "<p class=muted>No step is common to every rank.</p>"
    n = len(ranks)
    size = max(1, -(-n // HEAT_ROWS))
    groups = [list(range(a, min(a + size, n))) for a in range(0, n, size)]
    cell_w = max(3.0, min(40.0, (WIDTH - LABEL_W) / len(steps)))
    cell_h = 14 if len(groups) <= ROW_LIMIT else 5
    values = [[max(ranks[i].steps[s][col] for i in g) for s in steps] for g in groups]
    flat = [v for row in values for v in row]
    lo, hi = min(flat), max(flat)
    span = (hi - lo) or 1.0
    strag = {s.index for s in report.stragglers}
    h = cell_h * len(groups) + 30
    out = [f'<svg class=plot width="{LABEL_W + cell_w * len(steps) + 10:.0f}" height="{h}">']
    for gi, g in enumerate(groups):
        y = 20 + gi * cell_h
        label = ranks[g[0]].label if size == 1 else f"r{ranks[g[0]].rank}-r{ranks[g[-1]].rank}"
        marked = bool(strag & set(g))
        if marked or len(groups) <= ROW_LIMIT or gi % max(1, len(groups) // 16) == 0:
            weight = ' font-weight="bold" fill="#c00"' if marked else ""
            out.append(
                f'<text x="{LABEL_W - 6}" y="{y + cell_h - 2}" text-anchor="end"{weight}>'
                f"{esc(label)}</text>"
            )
        for si, v in enumerate(values[gi]):
            worst = max(g, key=lambda i: ranks[i].steps[steps[si]][col])
            out.append(
                f'<rect x="{LABEL_W + si * cell_w:.1f}" y="{y}" width="{cell_w:.1f}"'
                f' height="{cell_h}" fill="{heat_color((v - lo) / span)}"><title>'
                f"{esc(ranks[worst].label)} step {steps[si]}: {v:.2f} ms</title></rect>"
            )
    for si, s in enumerate(steps):
        if len(steps) <= 20 or si % max(1, len(steps) // 10) == 0:
            x = LABEL_W + si * cell_w + cell_w / 2
            out.append(f'<text x="{x:.1f}" y="12" text-anchor="middle">{s}</text>')
    out.append("</svg>")
    legend = f"<p class=muted>{esc(title)}: {lo:.2f} ms (light) to {hi:.2f} ms (dark)"
    if size > 1:
        legend += f"; each row is {size} consecutive ranks, coloured by the slowest"
    return "".join(out) + legend + "</p>"


def _bar_rows(report: Report, key: int) -> list[tuple[str, int]]:
    if len(report.ranks) <= ROW_LIMIT:
        return [("", i) for i in range(len(report.ranks))]
    seen: set[int] = set()
    rows = []
    for tag, i in spotlight(report, key):
        if i not in seen:
            seen.add(i)
            rows.append((tag, i))
    return rows


def split_bars(report: Report) -> str:
    """Each rank's mean step as compute / collective wait / idle."""
    rows = _bar_rows(report, 2)
    if not rows:
        return ""
    top = max(report.summaries[i].step_ms for _, i in rows) or 1.0
    scale = (WIDTH - LABEL_W - 80) / top
    strag = {s.index for s in report.stragglers}
    out = [f'<svg class=plot width="{WIDTH}" height="{18 * len(rows) + 10}">']
    for k, (tag, i) in enumerate(rows):
        s, y = report.summaries[i], 5 + 18 * k
        label = (f"{tag}: " if tag else "") + report.ranks[i].label
        weight = ' font-weight="bold" fill="#c00"' if i in strag else ""
        out.append(
            f'<text x="{LABEL_W - 6}" y="{y + 11}" text-anchor="end"{weight}>{esc(label)}</text>'
        )
        x = float(LABEL_W)
        for part, v in (
            ("compute", s.compute_ms),
            ("collective", s.collective_ms),
            ("idle", s.idle_ms),
        ):
            w = v * scale
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="14" fill="{COLORS[part]}">'
                f"<title>{esc(report.ranks[i].label)}: {part} {v:.2f} ms/step</title></rect>"
            )
            x += w
        out.append(f'<text x="{x + 4:.1f}" y="{y + 11}">{s.step_ms:.1f} ms</text>')
    out.append("</svg>")
    key = "".join(f'<span style="background:{c}"></span>{p}' for p, c in COLORS.items())
    note = "" if len(report.ranks) <= ROW_LIMIT else " (ranks at percentiles of collective wait)"
    return "".join(out) + f"<p class='key muted'>{key}{note}</p>"


def _range_bar(lo: float, med: float, hi: float, top: float) -> str:
    w = 160 / (top or 1.0)
    return (
        f'<svg class=plot width="170" height="12"><rect x="{lo * w:.1f}" y="4"'
        f' width="{max((hi - lo) * w, 1):.1f}" height="4" fill="#9ecae9"/>'
        f'<rect x="{med * w - 1:.1f}" y="1" width="2" height="10" fill="#333"/></svg>'
    )


def ops_table(report: Report) -> str:
    if not report.ops:
        return "<p class=muted>No operator statistics.</p>"
    top = max(o.max_ms for o in report.ops)
    rows = [
        "<table><tr><th>operator</th><th>median ms/step</th><th>min</th><th>max</th>"
        "<th>range</th><th>slowest rank</th><th>outliers</th></tr>"
    ]
    for o in report.ops:
        named = ", ".join(report.ranks[i].label for i in o.outliers[:3])
        more = f" and {len(o.outliers) - 3} more" if len(o.outliers) > 3 else ""
        rows.append(
            f"<tr{' class=out' if o.outliers else ''}><td>{esc(o.name)}</td>"
            f"<td>{o.median_ms:.3f}</td><td>{o.min_ms:.3f}</td><td>{o.max_ms:.3f}</td>"
            f"<td>{_range_bar(o.min_ms, o.median_ms, o.max_ms, top)}</td>"
            f"<td>{esc(report.ranks[o.max_index].label)}</td><td>{esc(named + more)}</td></tr>"
        )
    rows.append("</table>")
    rows.append(f"<p class=muted>{esc(OPS_NOTE)}</p>")
    over = over_step_note(report)
    if over:
        rows.append(f"<p>{esc(over)}</p>")
    return "".join(rows)


def memory_links(report: Report) -> str:
    """Links to the per-rank memory pages (``--profile-memory``) that this machine has."""
    links = [
        (r, cycle, report.page_links[path])
        for r in report.ranks
        for cycle, path in r.memory_pages
        if path in report.page_links
    ]
    if not links:
        return ""
    shown = [
        f'<a href="{esc(href)}">{esc(r.label)}' + (f" c{cycle}" if cycle else "") + "</a>"
        for r, cycle, href in links[:ROW_LIMIT]
    ]
    more = f" and {len(links) - ROW_LIMIT} more" if len(links) > ROW_LIMIT else ""
    return f"<p>Memory over time, per rank: {', '.join(shown)}{more}.</p>"


def memory_bars(report: Report) -> str:
    if not report.has_memory:
        return "<p class=muted>No memory was recorded (start with --profile-memory).</p>"

    def peak(i: int) -> float:
        return float(max(report.ranks[i].memory.values(), default=0))

    if len(report.ranks) <= ROW_LIMIT:
        rows = [("", i) for i in range(len(report.ranks))]
    else:
        order = sorted(range(len(report.ranks)), key=lambda i: (peak(i), i))
        n = len(order)
        rows = [(t, order[round(q * (n - 1))]) for t, q in (("min", 0), ("p50", 0.5), ("max", 1))]
    top = max(peak(i) for _, i in rows) or 1.0
    out = [f'<svg class=plot width="{WIDTH}" height="{18 * len(rows) + 10}">']
    for k, (tag, i) in enumerate(rows):
        y = 5 + 18 * k
        w = peak(i) / top * (WIDTH - LABEL_W - 90)
        label = (f"{tag}: " if tag else "") + report.ranks[i].label
        out.append(
            f'<text x="{LABEL_W - 6}" y="{y + 11}" text-anchor="end">{esc(label)}</text>'
            f'<rect x="{LABEL_W}" y="{y}" width="{w:.1f}" height="14" fill="#72b7b2"/>'
            f'<text x="{LABEL_W + w + 4:.1f}" y="{y + 11}">{peak(i) / 2**20:.0f} MiB</text>'
        )
    out.append("</svg><p class=muted>Peak allocated memory per rank.</p>")
    return "".join(out) + memory_links(report)


def _diff_table(d: Mapping[str, Any], rows: int = 10) -> str:
    """The largest per-operator and per-step differences of a ``diff`` map, A against B."""
    out = [
        f"<p class=muted>A: {esc(d['a'])}; B: {esc(d['b'])}. ms per step; delta = B - A.</p>",
        "<table><tr><th>operator</th><th>A</th><th>B</th><th>delta</th></tr>",
    ]
    for o in d["ops"][:rows]:
        cells = [_ms(o[k]) for k in ("a_ms", "b_ms")] + [_ms(o["delta_ms"], "+.2f")]
        out.append(f"<tr><td>{esc(o['name'])}</td>" + "".join(f"<td>{c}</td>" for c in cells))
    out.append("</table><table><tr><th>step (A/B)</th><th>A</th><th>B</th><th>delta</th></tr>")
    for x in d["steps"][:rows]:
        out.append(
            f"<tr><td>{x['a_step']}/{x['b_step']}</td><td>{_ms(x['a_ms'])}</td>"
            f"<td>{_ms(x['b_ms'])}</td><td>{_ms(x['delta_ms'], '+.2f')}</td></tr>"
        )
    return "".join(out) + "</table>"


def _ms(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def incident_section(incident: Mapping[str, Any]) -> str:
    """What the incident this session captured is, and what differs (its ``comparison``)."""
    who = ", ".join(f"{s['role']} r{s['rank']}@{s['host']}" for s in incident.get("suspects") or [])
    why = (incident.get("evidence") or {}).get("why") or ""
    out = [
        f"<div class='verdict bad'><b>Incident {esc(incident.get('id'))}</b>:"
        f" {esc(incident.get('kind'))} in job {esc(incident.get('job'))}"
        f" at step {esc(incident.get('step'))}; suspects: {esc(who or 'none')}."
        + (f"<br>{esc(why)}" if why else "")
        + "</div>"
    ]
    c = incident.get("comparison") or {}
    for key, title in (
        ("suspect_vs_peer", "Suspect against peer"),
        ("capture_vs_sample", "This capture against the job's last sample"),
    ):
        if c.get(key):
            out.append(f"<h3>{title}</h3>{_diff_table(c[key])}")
    out += [f"<p class=muted>{esc(n)}</p>" for n in c.get("notes") or []]
    return "".join(out)


def page(report: Report, sections: Sequence[tuple[str, str]]) -> str:
    bad = " bad" if report.stragglers else ""
    # An incident's capture is read for the incident first: it leads the page.
    lead = "" if report.incident is None else incident_section(report.incident)
    body = "".join(f"<h2>{esc(t)}</h2>{content}" for t, content in sections)
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>profd report {esc(report.session)}</title><style>{CSS}</style></head><body>"
        f"<h1>Session {esc(report.session)} <span class=muted>job {esc(report.job)}</span></h1>"
        f"{lead}<p>{len(report.ranks)} ranks, {len(report.steps)} common steps "
        f"({esc(', '.join(map(str, report.steps[:12])))}{'…' if len(report.steps) > 12 else ''}),"
        f" {report.mode.upper()} trace statistics; median step {report.median_step_ms:.2f} ms."
        + (f" {report.skipped} target(s) had no statistics." if report.skipped else "")
        + f"</p><p class='verdict{bad}'>{esc(verdict_text(report))}</p>{body}"
        "</body></html>\n"
    )


class HtmlRenderer:
    name = "html"
    suffix = ".html"

    def render(self, report: Report) -> str:
        return page(
            report,
            [
                ("Step time per rank", heat_map(report, 0, "step time")),
                ("Where each rank's time goes", split_bars(report)),
                ("Collective wait per rank and step", heat_map(report, 2, "collective wait")),
                ("Top operators across ranks", ops_table(report)),
                ("Memory", memory_bars(report)),
            ],
        )
