"""Turn one raw kineto Chrome trace into the files profd keeps and uploads.

Runs inside a daemon worker process (``ProcessPoolExecutor``, spawn context), never on the
training thread, so it may spend a few seconds of CPU and a few hundred MB of memory on a large
trace. It must not import torch: the daemon never does.

For one raw trace it writes, into ``final_dir``:

* ``{stem}.pt.trace.json.gz``: the trace with ``distributedInfo.rank`` guaranteed, gzipped;
* one file per registered output (:data:`.outputs.TRACE_OUTPUTS`), all from one parse of the
  trace: ``{stem}.summary.txt`` (step times, top operators by self time) and, when the trace
  has ``[memory]`` events, ``{stem}.memory.html`` (see :mod:`.memory_report`);

moves the caller's extra files (memory snapshots...) next to them, and only then deletes the
raw trace, so a failure at any point leaves the raw trace in place to retry or inspect.

Errors: :class:`PipelineError` means the input itself is unusable (retrying will not help);
``OSError`` means the environment failed (disk full, permissions) and a retry may succeed. An
output that fails costs only its own file (see :mod:`.outputs`).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

from .files import Batch, FilePerms, ProcessedFile, move_into
from .outputs import TRACE_OUTPUTS, OutputError, TraceOutput, render_outputs
from .parsed import ParsedTrace

GZIP_LEVEL = 6
DEFAULT_TOP_N = 30
TRACE_SUFFIX = ".pt.trace.json.gz"


class PipelineError(Exception):
    pass


@dataclass(frozen=True)
class ProcessedTrace:
    files: tuple[ProcessedFile, ...]
    trace_path: str
    steps_found: tuple[int, ...]
    step_ms_p50: float | None
    step_ms_p90: float | None
    step_ms_max: float | None
    raw_bytes: int  # size of the raw (uncompressed, kineto-indented) trace file
    output_errors: tuple[OutputError, ...] = ()  # outputs that raised and wrote no file


def inject_rank(doc: dict[str, Any], rank: int, world_size: int) -> bool:
    """Make sure ``doc`` carries ``distributedInfo.rank``; return whether anything was added.

    HTA refuses to tell ranks apart without it, and a non-distributed (or single-process)
    kineto trace has no distributedInfo at all. An existing rank is trusted over ours: kineto
    took it from the live process group.
    """
    info = doc.get("distributedInfo")
    if isinstance(info, dict) and "rank" in info:
        return False
    if not isinstance(info, dict):
        info = {}
    info.setdefault("world_size", world_size)
    info["rank"] = rank
    doc["distributedInfo"] = info
    return True


def _trace_chunks(doc: Mapping[str, Any]) -> Iterator[str]:
    """Compact JSON for ``doc``, with distributedInfo alone on the first line.

    HTA maps files to ranks with ``re.search(r'"rank":\\s+(\\d+)')`` over the file's lines, up
    to the first line that matches: plain compact JSON (``"rank":3``) does not match at all and
    HTA silently files every trace under rank 0, and a one-line file would make it search the
    whole trace. So distributedInfo goes first, with rank as its first key and ": " separators,
    and a newline follows it; the rest stays compact.
    """
    compact = (",", ":")
    info = doc.get("distributedInfo")
    first = True
    yield "{"
    if isinstance(info, dict):
        ordered = {"rank": info["rank"], **info} if "rank" in info else info
        yield '"distributedInfo": ' + json.dumps(ordered, separators=(", ", ": ")) + "\n"
        first = False
    for key, value in doc.items():
        if key == "distributedInfo" and isinstance(info, dict):
            continue
        yield ("" if first else ",") + json.dumps(key) + ":" + json.dumps(value, separators=compact)
        first = False
    yield "}"


def _load(raw: BinaryIO, name: str) -> dict[str, Any]:
    # errors="replace": one undecodable byte in some op name must not cost the whole trace.
    text = raw.read().decode("utf-8", errors="replace")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PipelineError(f"{name}: not valid JSON ({exc})") from None
    del text
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise PipelineError(f"{name}: not a Chrome trace (no traceEvents list)")
    return doc


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
) -> ProcessedTrace:
    """Finalize a raw trace file the caller owns (paths trusted); the raw file goes last.

    The daemon never calls this with a client's paths: it opens client files itself (see
    :mod:`profd.daemon.clientfiles`) and calls :func:`process_open`.
    """
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
        )
    files = list(res.files)
    for kind, path in extra_files:
        dest = move_into(path, final_dir)
        files.append(ProcessedFile(kind, dest, os.path.getsize(dest)))
    os.unlink(raw_trace)
    return replace(res, files=tuple(files))


def process_open(
    raw: BinaryIO,
    raw_bytes: int,
    final_dir: str,
    stem: str,
    rank: int,
    world_size: int,
    top_n: int = DEFAULT_TOP_N,
    header: Mapping[str, str] | None = None,
    outputs: Sequence[TraceOutput[ParsedTrace]] = TRACE_OUTPUTS,
    perms: FilePerms | None = None,
    name: str = "raw trace",
) -> ProcessedTrace:
    """Write the outputs of the raw trace read from ``raw`` into ``final_dir``.

    Reads only from the open file: it neither moves nor deletes anything of the caller's.
    ``perms`` sets the outputs' mode and owner (the daemon hands a user's traces to that user).
    """
    if not stem or os.sep in stem or stem.startswith("."):
        raise ValueError(f"bad stem {stem!r}")
    doc = _load(raw, name)
    inject_rank(doc, rank, world_size)
    events: list[Any] = doc["traceEvents"]

    final_dir = os.path.abspath(final_dir)
    os.makedirs(final_dir, exist_ok=True)
    head: dict[str, str] = dict(header or {})
    head.setdefault("rank", str(rank))
    head.setdefault("world_size", str(world_size))
    head.setdefault("trace", stem + TRACE_SUFFIX)
    head.setdefault("raw_bytes", str(raw_bytes))
    head.setdefault("events", str(len(events)))
    parsed = ParsedTrace.from_events(events, stem, head, top_n)
    # The step statistics belong to the result, not to an output, so they fail the capture.
    steps = parsed.steps
    # Outputs render before the trace is encoded: the other way round made the whole call
    # 10-20% slower on a 500k-event trace. Dropping parsed lets `del doc` below free the
    # events at once.
    rendered, output_errors = render_outputs(outputs, parsed, stem)
    del parsed

    with Batch(final_dir, stem, perms) as batch:
        with (
            batch.open("trace", TRACE_SUFFIX) as fh,
            gzip.GzipFile(
                # filename: gzip headers record the original name; the temp name would mislead.
                filename=stem + ".pt.trace.json",
                mode="wb",
                fileobj=fh,
                compresslevel=GZIP_LEVEL,
            ) as gz,
        ):
            for chunk in _trace_chunks(doc):
                gz.write(chunk.encode("utf-8"))
        del doc, events
        for out in rendered:
            batch.write(out.kind, out.suffix, out.data)

    return ProcessedTrace(
        files=tuple(batch.files),
        trace_path=os.path.join(final_dir, stem + TRACE_SUFFIX),
        steps_found=steps.steps,
        step_ms_p50=steps.p50_ms,
        step_ms_p90=steps.p90_ms,
        step_ms_max=steps.max_ms,
        raw_bytes=raw_bytes,
        output_errors=output_errors,
    )
