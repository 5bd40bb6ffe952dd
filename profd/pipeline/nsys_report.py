"""Finish one nsys report: move it into its cycle dir and run the nsys outputs on it.

Runs on an nsys worker thread of the daemon (the work is a rename and a subprocess), never on
the training thread and never on the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from profd import nsys
from profd.pipeline.files import Batch, ProcessedFile
from profd.pipeline.nsys_stats import NsysReport
from profd.pipeline.outputs import NSYS_OUTPUTS, TraceOutput, render_outputs
from profd.pipeline.process import ProcessedTrace


def finish_report(
    nsys_bin: str,
    report: Path,
    final_dir: Path,
    stem: str,
    header: Mapping[str, str],
    timeout: float,
    outputs: Sequence[TraceOutput[NsysReport]] = NSYS_OUTPUTS,
) -> ProcessedTrace:
    """Move ``report`` to ``final_dir/{stem}.nsys-rep`` and write its outputs beside it
    (``{stem}.summary.txt`` from ``nsys stats``); no output can cost the report.
    """
    final_dir.mkdir(parents=True, exist_ok=True)
    dest = final_dir / f"{stem}{nsys.REPORT_SUFFIX}"
    os.replace(report, dest)
    size = dest.stat().st_size
    moved = NsysReport(dest, {**header, "report": dest.name, "bytes": str(size)}, nsys_bin, timeout)
    rendered, output_errors = render_outputs(outputs, moved, stem)
    with Batch(str(final_dir), stem) as batch:
        for out in rendered:
            batch.write(out.kind, out.suffix, out.data)
    return ProcessedTrace(
        files=(ProcessedFile("nsys", str(dest), size), *batch.files),
        trace_path=str(dest),
        steps_found=(),
        step_ms_p50=None,
        step_ms_p90=None,
        step_ms_max=None,
        raw_bytes=size,
        output_errors=output_errors,
    )
