"""How a :class:`~.model.Report` is written out, as plug-ins (pyinstrument's renderers).

A renderer is any object with ``name``, ``suffix`` and ``render(report) -> str``;
:data:`RENDERERS` names those ``profctl report`` knows. Every renderer is a pure function of
the report: the same statistics give the same bytes (no clock, no random ids), which is what
the tests compare.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from profd.report.html import HtmlRenderer
from profd.report.model import OPS_NOTE, Report, over_step_note, spotlight, verdict_text
from profd.textfmt import printable


class Renderer(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def suffix(self) -> str: ...

    def render(self, report: Report, /) -> str: ...


def _who(report: Report, i: int) -> dict[str, Any]:
    r = report.ranks[i]
    return {"host": r.host, "role": r.role, "rank": r.rank}


def report_doc(report: Report) -> dict[str, Any]:
    """The ``--json`` document; docs/design.md's "Reports" lists its keys."""
    return {
        "session": report.session,
        "job": report.job,
        "mode": report.mode,
        "steps": report.steps,
        "ranks": [
            {
                "host": r.host,
                "role": r.role,
                "rank": r.rank,
                "step_ms": s.step_ms,
                "compute_ms": s.compute_ms,
                "collective_ms": s.collective_ms,
                "idle_ms": s.idle_ms,
                **({"peak_allocated": max(r.memory.values())} if r.memory else {}),
            }
            for r, s in zip(report.ranks, report.summaries, strict=True)
        ],
        "stragglers": [
            {**_who(report, s.index), "why": s.why, "wait_ms": s.wait_ms, "lead_ms": s.lead_ms}
            for s in report.stragglers
        ],
        "verdict": verdict_text(report),
        "threshold_ms": round(report.verdict.threshold_ms, 3),
        "need_steps": report.verdict.need_steps,
        "ops": [
            {
                "name": o.name,
                "median_ms": o.median_ms,
                "min_ms": o.min_ms,
                "max_ms": o.max_ms,
                "max_rank": _who(report, o.max_index),
                "outliers": [_who(report, i) for i in o.outliers[:10]],
                "outlier_count": len(o.outliers),
            }
            for o in report.ops
        ],
        "skipped_targets": report.skipped,
    }


class JsonRenderer:
    name = "json"
    suffix = ".json"

    def render(self, report: Report) -> str:
        return json.dumps(report_doc(report), indent=2, sort_keys=True) + "\n"


#: Up to this many ranks, the text report lists each; beyond, percentiles and outliers.
TEXT_RANK_ROWS = 32


class TextRenderer:
    name = "text"
    suffix = ".txt"

    def render(self, report: Report) -> str:
        lines = [
            f"session {report.session}  job {report.job}  ranks {len(report.ranks)}"
            f"  steps {len(report.steps)}  ({report.mode})",
            verdict_text(report),
            "",
            f"{'rank':<40} {'step_ms':>9} {'compute':>9} {'collect':>9} {'idle':>9}",
        ]
        rows: list[tuple[str, int]]
        if len(report.ranks) <= TEXT_RANK_ROWS:
            rows = [("", i) for i in range(len(report.ranks))]
        else:
            rows = spotlight(report)
        strag = {s.index for s in report.stragglers}
        for tag, i in rows:
            s = report.summaries[i]
            mark = "*" if i in strag else " "
            label = (f"{tag}: " if tag else "") + report.ranks[i].label
            lines.append(
                f"{mark}{label[:39]:<39} {s.step_ms:>9.2f} {s.compute_ms:>9.2f}"
                f" {s.collective_ms:>9.2f} {s.idle_ms:>9.2f}"
            )
        if report.ops:
            lines += ["", f"{'operator (ms/step)':<50} {'median':>8} {'max':>8}  max rank"]
            for o in report.ops:
                flag = f"  {len(o.outliers)} outlier(s)" if o.outliers else ""
                lines.append(
                    f"{o.name[:50]:<50} {o.median_ms:>8.2f} {o.max_ms:>8.2f}"
                    f"  {report.ranks[o.max_index].label}{flag}"
                )
            lines += [n for n in (OPS_NOTE, over_step_note(report)) if n]
        if report.skipped:
            lines += ["", f"{report.skipped} target(s) without statistics left out"]
        # Operator, rank and job names come from the traces and the peers: a newline or an
        # escape sequence in one must not make a line of its own on a terminal.
        return "\n".join(printable(x) for x in lines) + "\n"


def renderers() -> dict[str, Renderer]:
    """Every renderer by name."""
    return {r.name: r for r in (HtmlRenderer(), JsonRenderer(), TextRenderer())}
