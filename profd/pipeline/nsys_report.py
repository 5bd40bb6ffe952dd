"""Finish one nsys report: move it into its cycle dir and summarise it with ``nsys stats``.

Runs on an nsys worker thread of the daemon (the work is a rename and a subprocess), never on
the training thread and never on the event loop.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from .. import nsys
from .process import SUMMARY_SUFFIX, ProcessedFile, ProcessedTrace, header_lines


def finish_report(
    nsys_bin: str,
    report: Path,
    final_dir: Path,
    stem: str,
    header: Mapping[str, str],
    timeout: float,
) -> ProcessedTrace:
    """Move ``report`` to ``final_dir/{stem}.nsys-rep`` and write ``{stem}.summary.txt``.

    A failing ``nsys stats`` costs only the summary's tables, never the report.
    """
    final_dir.mkdir(parents=True, exist_ok=True)
    dest = final_dir / f"{stem}{nsys.REPORT_SUFFIX}"
    os.replace(report, dest)
    head = {**header, "report": dest.name, "bytes": str(dest.stat().st_size)}
    lines = header_lines("# profd nsys report summary", head)
    try:
        out = nsys.run(nsys.stats_argv(nsys_bin, dest), timeout).output
        lines.append(out.rstrip())
    except nsys.NsysError as exc:
        lines.append(f"(nsys stats failed: {exc})")
    finally:
        # stats exports a SQLite copy beside the report; it can be as big as the report and
        # `nsys export` recreates it on demand.
        with contextlib.suppress(FileNotFoundError):
            dest.with_suffix(".sqlite").unlink()
    summary = final_dir / f"{stem}{SUMMARY_SUFFIX}"
    tmp = final_dir / f".{stem}.summary.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, summary)
    return ProcessedTrace(
        files=(
            ProcessedFile("nsys", str(dest), dest.stat().st_size),
            ProcessedFile("summary", str(summary), summary.stat().st_size),
        ),
        trace_path=str(dest),
        steps_found=(),
        step_ms_p50=None,
        step_ms_p90=None,
        step_ms_max=None,
        raw_bytes=dest.stat().st_size,
    )
