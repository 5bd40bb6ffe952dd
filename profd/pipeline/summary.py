"""``{stem}.summary.txt``: a trace's step times and top operators, as plain text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from profd.pipeline.ops import OpStat
from profd.pipeline.parsed import ParsedTrace
from profd.pipeline.spans import StepStats

SUMMARY_SUFFIX = ".summary.txt"
NAME_WIDTH = 60


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _clip(name: str) -> str:
    name = " ".join(name.split())  # op names can carry newlines (python_function, annotations)
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def _op_table(title: str, stats: Sequence[OpStat], top_n: int) -> list[str]:
    grand_self = sum(s.self_us for s in stats) or 1.0
    shown = stats[:top_n]
    lines = [
        f"{title} (top {len(shown)} of {len(stats)} by self time)",
        f"{'name':<{NAME_WIDTH}} {'calls':>8} {'self_ms':>12} {'self_avg_us':>12} "
        f"{'total_ms':>12} {'self_%':>7}",
    ]
    for s in shown:
        lines.append(
            f"{_clip(s.name):<{NAME_WIDTH}} {s.calls:>8} {s.self_us / 1000.0:>12.3f} "
            f"{s.self_us / s.calls:>12.1f} {s.total_us / 1000.0:>12.3f} "
            f"{100.0 * s.self_us / grand_self:>7.2f}"
        )
    return lines


def header_lines(title: str, header: Mapping[str, str]) -> list[str]:
    """A summary's title and aligned ``key: value`` lines, then a blank line."""
    lines = [title]
    width = max((len(k) for k in header), default=0)
    for key, value in header.items():
        # A stray newline in a caller's value would otherwise forge extra header lines.
        lines.append(f"{key + ':':<{width + 1}} {' '.join(str(value).splitlines())}")
    lines.append("")
    return lines


def render_summary(
    header: Mapping[str, str],
    steps: StepStats,
    cpu_ops: Sequence[OpStat],
    gpu_ops: Sequence[OpStat],
    top_n: int,
    call_sites: Sequence[OpStat] = (),
) -> str:
    lines = header_lines("# profd trace summary", header)
    lines.append("## step time (ProfilerStep#N)")
    lines.append(
        f"count {len(steps.durations_ms)}  p50 {_fmt_ms(steps.p50_ms)} ms  "
        f"p90 {_fmt_ms(steps.p90_ms)} ms  max {_fmt_ms(steps.max_ms)} ms"
    )
    if steps.durations_ms:
        lines.append(f"{'step':>10} {'duration_ms':>14}")
        lines.extend(f"{step:>10} {ms:>14.3f}" for step, ms in steps.durations_ms)
    lines.append("")
    lines.append("## CPU operators")
    lines.append(
        "(cpu_op and user_annotation events; wall-clock time, overlapping calls counted once;"
        " profd's own work left out)"
    )
    if cpu_ops:
        lines.extend(_op_table("CPU ops", cpu_ops, top_n))
    else:
        lines.append("(no CPU operator events)")
    if call_sites:
        lines.append("")
        lines.append("## Python call sites (--with-stack)")
        lines.extend(_op_table("Python frames", call_sites, top_n))
    if gpu_ops:
        lines.append("")
        lines.append("## GPU kernels, memcpy and memset")
        lines.extend(_op_table("GPU ops", gpu_ops, top_n))
    lines.append("")
    return "\n".join(lines)


class Summary:
    """Written for every trace, even one without steps or operators: it says so."""

    kind = "summary"
    suffix = SUMMARY_SUFFIX

    def render(self, parsed: ParsedTrace) -> str:
        return render_summary(
            parsed.header,
            parsed.steps,
            parsed.cpu_ops,
            parsed.gpu_ops,
            parsed.top_n,
            parsed.call_sites,
        )
