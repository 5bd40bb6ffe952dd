"""The pipeline over plain paths the caller owns, for tests and benchmarks.

The daemon never hands the pipeline a client's path: it opens client files itself through
directory descriptors (``profd.daemon.spool.clientfiles``) and calls ``process_open``. Tests
and benchmarks own their files, so this wrapper opens, moves and deletes by path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace

from profd.pipeline.files import ProcessedFile, move_into
from profd.pipeline.outputs import TRACE_OUTPUTS, TRACE_RESULTS, TraceOutput, TraceResult
from profd.pipeline.parsed import ParsedTrace
from profd.pipeline.process import DEFAULT_TOP_N, PipelineError, ProcessedTrace, process_open


def process_trace(
    raw_trace: str,
    final_dir: str,
    stem: str,
    rank: int,
    world_size: int,
    extra_files: Sequence[tuple[str, str]] = (),
    top_n: int = DEFAULT_TOP_N,
    header: Mapping[str, str] | None = None,
    outputs: Sequence[TraceOutput[ParsedTrace]] = TRACE_OUTPUTS,
    results: Sequence[TraceResult[ParsedTrace]] = TRACE_RESULTS,
) -> ProcessedTrace:
    """Finalize a raw trace file the caller owns (paths trusted); the raw file goes last."""
    for kind, path in extra_files:
        moved = os.path.join(final_dir, os.path.basename(path))
        if not os.path.exists(path) and not os.path.exists(moved):
            raise PipelineError(f"extra {kind} file {path} does not exist")
    with open(raw_trace, "rb") as fh:
        res = process_open(
            fh,
            os.fstat(fh.fileno()).st_size,
            final_dir,
            stem,
            rank,
            world_size,
            top_n=top_n,
            header=header,
            outputs=outputs,
            name=raw_trace,
            results=results,
        )
    files = list(res.files)
    for kind, path in extra_files:
        dest = move_into(path, final_dir)
        files.append(ProcessedFile(kind, dest, os.path.getsize(dest)))
    os.unlink(raw_trace)
    return replace(res, files=tuple(files))
