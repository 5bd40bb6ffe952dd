"""An HTML memory report built from a trace's ``[memory]`` events (see :mod:`.memory`).

From the running totals alone it draws what Modalities' ``profiler_memory_*.html`` shows: per
device, allocated and reserved memory over time, the peak, and the peak of every step. It runs
in the daemon's pipeline worker, so it uses only the standard library (an inline SVG, no
matplotlib, no torch), and it needs nothing from the training process beyond the trace.
"""

from __future__ import annotations

import bisect
import html
from collections.abc import Mapping, Sequence

from profd.pipeline.memory import MemoryReading
from profd.pipeline.parsed import ParsedTrace
from profd.pipeline.spans import StepSpan
from profd.textfmt import human_bytes

MEMORY_SUFFIX = ".memory.html"
#: Points drawn per device; longer series keep each bucket's maximum, so peaks survive.
MAX_POINTS = 2000
_W, _H, _PAD = 960, 260, 50


def downsample(readings: Sequence[MemoryReading], limit: int = MAX_POINTS) -> list[MemoryReading]:
    if len(readings) <= limit:
        return list(readings)
    size = len(readings) / limit
    out = []
    for i in range(limit):
        bucket = readings[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)]
        out.append(max(bucket, key=lambda s: s.allocated))
    return out


def _ts(s: MemoryReading) -> float:
    return s.ts_us


def _size(n: float) -> str:
    return human_bytes(int(n), digits=2)


def has_reserved(readings: Sequence[MemoryReading]) -> bool:
    """Whether the readings' reserved memory means anything: it is the CUDA caching
    allocator's, and 0 all along on CPU."""
    return any(s.reserved for s in readings)


def _svg(readings: Sequence[MemoryReading], t0: float, windows: Sequence[StepSpan]) -> str:
    pts = downsample(readings)
    t_end = max(pts[-1].ts_us, windows[-1].end_us if windows else 0.0)
    span = max(t_end - t0, 1.0)
    top = max(max(s.reserved, s.allocated) for s in pts) or 1
    reserved = has_reserved(readings)

    def x(ts: float) -> float:
        return _PAD + (ts - t0) / span * (_W - 2 * _PAD)

    def y(v: float) -> float:
        return _H - _PAD + 10 - v / top * (_H - _PAD - 20)

    def line(attr: str) -> str:
        # A running total holds its value until the next event: draw steps, not slopes.
        coords, prev = [], None
        for s in pts:
            v = getattr(s, attr)
            if prev is not None:
                coords.append(f"{x(s.ts_us):.1f},{y(prev):.1f}")
            coords.append(f"{x(s.ts_us):.1f},{y(v):.1f}")
            prev = v
        coords.append(f"{x(t_end):.1f},{y(prev or 0):.1f}")
        return f'<polyline class="{attr}" points="{" ".join(coords)}"/>'

    parts = [f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}">']
    for w in windows:
        parts.append(
            f'<rect class="step" x="{x(w.start_us):.1f}" y="10" '
            f'width="{max(x(w.end_us) - x(w.start_us), 0.5):.1f}" height="{_H - _PAD}">'
            f"<title>step {w.step}</title></rect>"
            f'<text x="{x(w.start_us) + 2:.1f}" y="22">{w.step}</text>'
        )
    parts += [
        f'<line class="axis" x1="{_PAD}" y1="{y(0):.1f}" x2="{_W - _PAD}" y2="{y(0):.1f}"/>',
        f'<text x="{_PAD}" y="{_H - 12}">0 ms</text>',
        f'<text x="{_W - _PAD}" y="{_H - 12}" text-anchor="end">{span / 1000:,.1f} ms</text>',
        f'<text x="4" y="{y(top) + 4:.1f}">{html.escape(_size(top))}</text>',
        *([line("reserved")] if reserved else []),
        line("allocated"),
        "</svg>",
    ]
    return "".join(parts)


def _step_rows(readings: Sequence[MemoryReading], windows: Sequence[StepSpan]) -> list[str]:
    """One row per step window; ``readings`` are in time order, so each window is a slice."""
    rows = []
    for w in windows:
        lo = bisect.bisect_left(readings, w.start_us, key=_ts)
        hi = bisect.bisect_right(readings, w.end_us, lo=lo, key=_ts)
        inside = [s.allocated for s in readings[lo:hi]]
        peak = _size(max(inside)) if inside else "-"
        rows.append(f"<tr><td>{w.step}</td><td>{peak}</td><td>{len(inside)}</td></tr>")
    return rows


def render_memory_html(
    title: str, series: Mapping[str, Sequence[MemoryReading]], windows: Sequence[StepSpan]
) -> str | None:
    """The report, or None when the trace has no ``[memory]`` events.

    ``series`` holds each device's readings in time order, as :meth:`.MemoryEvents.series`
    gives them.
    """
    if not series:
        return None
    t0 = min(
        [s[0].ts_us for s in series.values() if s] + [w.start_us for w in windows[:1]],
    )
    body = [f"<h1>{html.escape(title)}</h1>"]
    for dev, readings in sorted(series.items()):
        peak = max(readings, key=lambda s: s.allocated)
        reserved = has_reserved(readings)
        body += [
            f"<h2>{html.escape(dev)}</h2>",
            f"<p>peak allocated {_size(peak.allocated)} at {(peak.ts_us - t0) / 1000:,.1f} ms;"
            + (f" peak reserved {_size(max(s.reserved for s in readings))};" if reserved else "")
            + f" {len(readings)} allocation events."
            ' <span class="allocated">allocated</span>'
            + (', <span class="reserved">reserved</span>' if reserved else "")
            + "; shaded: profiled steps.</p>",
            _svg(readings, t0, windows),
        ]
        if windows:
            body += [
                "<table><tr><th>step</th><th>peak allocated</th><th>events</th></tr>",
                *_step_rows(readings, windows),
                "</table>",
            ]
    style = (
        "body{font-family:sans-serif;margin:2em}svg{border:1px solid #ccc}"
        "polyline{fill:none;stroke-width:1.5}.allocated{stroke:#1f77b4;color:#1f77b4}"
        ".reserved{stroke:#ff7f0e;color:#ff7f0e}.step{fill:#eee}.axis{stroke:#888}"
        "text{font-size:11px}td,th{padding:2px 12px;text-align:right}"
    )
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{style}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )


class MemoryReport:
    """Only for traces taken with ``--profile-memory``; any other trace gets no page."""

    kind = "memory_report"
    suffix = MEMORY_SUFFIX

    def render(self, parsed: ParsedTrace) -> str | None:
        where = ", ".join(
            f"{k} {parsed.header[k]}" for k in ("session", "cycle") if parsed.header.get(k)
        )
        title = f"{parsed.stem} memory" + (f" ({where})" if where else "")
        return render_memory_html(title, parsed.memory, parsed.spans)
