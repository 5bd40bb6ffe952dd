"""Turn one raw kineto Chrome trace into the files profd keeps and uploads.

Runs inside a daemon worker process (``ProcessPoolExecutor``, spawn context), never on the
training thread, so it may spend some seconds of CPU on a large trace. Its memory grows with
the trace only by the analyses' compact columns (about 20 bytes per CPU operator and 24 per
``[memory]`` sample): the raw trace is read one event at a time (:mod:`.stream`), and each event
is gzipped and fed to the analyses' collectors (:class:`.parsed.EventGroups`) as it is read. It
must not import torch: the daemon never does.

For one raw trace it writes, into ``final_dir``:

* ``{stem}.pt.trace.json.gz``: the trace with ``distributedInfo.rank`` guaranteed, gzipped;
* one file per registered output (:data:`.outputs.TRACE_OUTPUTS`), all from the same read of
  the trace: ``{stem}.summary.txt`` (step times, top operators by self time) and, when the trace
  has ``[memory]`` events, ``{stem}.memory.html`` (see :mod:`.memory_report`);

moves the caller's extra files (memory snapshots...) next to them, and only then deletes the
raw trace, so a failure at any point leaves the raw trace in place to retry or inspect.

Errors: :class:`PipelineError` means the input itself is unusable (retrying will not help);
``OSError`` means the environment failed (disk full, permissions) and a retry may succeed. An
output that fails costs only its own file (see :mod:`.outputs`).
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO

from profd.pipeline.files import Batch, FilePerms, ProcessedFile
from profd.pipeline.outputs import (
    TRACE_OUTPUTS,
    TRACE_RESULTS,
    OutputError,
    TraceOutput,
    TraceResult,
    compute_results,
    render_outputs,
)
from profd.pipeline.parsed import EventGroups, ParsedTrace
from profd.pipeline.spans import no_step_note
from profd.pipeline.stream import CHUNK_BYTES, TraceFormatError, TraceReader
from profd_client import protocol as P

GZIP_LEVEL = 6
DEFAULT_TOP_N = 30
TRACE_SUFFIX = ".pt.trace.json.gz"
#: How much of the raw file's end is searched for a distributedInfo after traceEvents.
TAIL_PROBE_BYTES = 64 << 10
#: Characters of compact JSON gathered before each write to the gzip stream.
WRITE_CHARS = 1 << 20
# What json.dumps(..., separators=(",", ":")) encodes with, made once rather than per event.
_COMPACT = json.JSONEncoder(separators=(",", ":"))


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
    #: The result plug-ins' records by key (``stats``: see :mod:`.rankstats`).
    records: Mapping[str, Any] = field(default_factory=dict)
    #: What the capture's result should say about the trace (values it left out).
    notes: tuple[str, ...] = ()


def inject_rank(doc: dict[str, Any], rank: int, world_size: int) -> bool:
    """Make sure ``doc`` carries ``distributedInfo.rank``; return whether anything was added.

    HTA refuses to tell ranks apart without it, and a non-distributed (or single-process)
    kineto trace has no distributedInfo at all. An existing rank is trusted over ours: kineto
    took it from the live process group; unless it is no rank the protocol knows (the file is
    the client's to write).
    """
    info = doc.get("distributedInfo")
    if isinstance(info, dict) and _is_rank(info.get("rank")):
        return False
    if not isinstance(info, dict):
        info = {}
    info.setdefault("world_size", world_size)
    info["rank"] = rank
    doc["distributedInfo"] = info
    return True


def _is_rank(value: Any) -> bool:
    return type(value) is int and P.RANK.lo <= value <= P.RANK.hi


def _trace_chunks(
    info: Mapping[str, Any],
    items: Iterable[tuple[str, Any]],
    events: Iterable[Any],
    on_event: Callable[[Any], None] | None = None,
) -> Iterator[str]:
    """Compact JSON for a trace, with distributedInfo alone on the first line.

    HTA maps files to ranks with ``re.search(r'"rank":\\s+(\\d+)')`` over the file's lines, up
    to the first line that matches: plain compact JSON (``"rank":3``) does not match at all and
    HTA silently files every trace under rank 0, and a one-line file would make it search the
    whole trace. So distributedInfo goes first, with rank as its first key and ": " separators,
    and a newline follows it; the rest stays compact.

    ``items`` are the other top-level keys with their values, in file order (a
    ``distributedInfo`` among them is skipped); the value of ``traceEvents`` is ``events``,
    encoded one at a time as they are read, each handed to ``on_event`` first. The rest comes
    out as ``json.dumps(doc, separators=(",", ":"))`` would write it.
    """
    encode = _COMPACT.encode
    ordered = {"rank": info["rank"], **info} if "rank" in info else info
    yield '{"distributedInfo": ' + json.dumps(ordered, separators=(", ", ": ")) + "\n"
    for key, value in items:
        if key == "distributedInfo":
            continue
        if key != "traceEvents":
            yield "," + encode(key) + ":" + encode(value)
            continue
        yield ',"traceEvents":['
        sep = ""
        for ev in events:
            if on_event is not None:
                on_event(ev)
            yield sep + encode(ev)
            sep = ","
        yield "]"
    yield "}"


def _gzip(fh: IO[bytes], stem: str, chunks: Iterable[str]) -> None:
    with gzip.GzipFile(
        # filename: gzip headers record the original name; the temp name would mislead.
        filename=stem + ".pt.trace.json",
        mode="wb",
        fileobj=fh,
        compresslevel=GZIP_LEVEL,
    ) as gz:
        parts: list[str] = []
        size = 0
        for chunk in chunks:
            parts.append(chunk)
            size += len(chunk)
            if size >= WRITE_CHARS:
                gz.write("".join(parts).encode("utf-8"))
                parts.clear()
                size = 0
        gz.write("".join(parts).encode("utf-8"))


def _write_trace(
    fh: IO[bytes],
    raw: BinaryIO,
    name: str,
    stem: str,
    rank: int,
    world_size: int,
    on_event: Callable[[Any], None],
) -> int:
    """Gzip the trace read from ``raw`` into ``fh``, each event through ``on_event``.

    The top-level values are kept in memory, the events are not: they go from the reader to
    the gzip stream one at a time. distributedInfo comes first in the output but may come
    after traceEvents in the raw file, where it is seen only once the events are written. So
    the one read writes what it knows by then (the raw file's distributedInfo from before
    traceEvents, or the one :func:`inject_rank` makes when there is none); in the rare case
    that the end of the file changes that (or repeats a key), the trace is written again from
    a second read of the file (``raw`` must be seekable), now knowing every top-level value.
    When the file's last bytes name distributedInfo, the first read only feeds ``on_event``
    and the second one writes. ``on_event`` sees the events of the first read only. Returns
    the number of elements of traceEvents.
    """
    start = raw.tell()
    reader = TraceReader(raw, name, CHUNK_BYTES)
    head = reader.head()
    tail: dict[str, Any] = {}
    written: Any = None  # the distributedInfo written first by the first read, if it wrote
    if "distributedInfo" in head or not _named_near_end(raw, b'"distributedInfo"'):
        guess = {"distributedInfo": head["distributedInfo"]} if "distributedInfo" in head else {}
        inject_rank(guess, rank, world_size)
        written = guess["distributedInfo"]

        def tail_items() -> Iterator[tuple[str, Any]]:
            tail.update(reader.tail())
            yield from tail.items()

        items = itertools.chain(head.items(), [("traceEvents", None)], tail_items())
        _gzip(fh, stem, _trace_chunks(written, items, reader.events(), on_event))
    else:
        for ev in reader.events():
            on_event(ev)
        tail.update(reader.tail())

    # The document json.loads would make of the file: a repeated key keeps its first place
    # and its last value.
    doc = {**head, "traceEvents": None}
    doc.update(tail)
    inject_rank(doc, rank, world_size)
    if (
        written is None
        or head.keys() & tail.keys()
        or _info_json(doc["distributedInfo"]) != _info_json(written)
    ):
        raw.seek(start)
        fh.seek(0)
        fh.truncate()
        again = TraceReader(raw, name, CHUNK_BYTES)
        again.head()
        _gzip(fh, stem, _trace_chunks(doc["distributedInfo"], doc.items(), again.events()))
    return reader.events_read


def _named_near_end(raw: BinaryIO, needle: bytes) -> bool:
    """Whether ``needle`` occurs in the last :data:`TAIL_PROBE_BYTES` of the file.

    Leaves the file where it was. A miss only costs the second write, a false hit the first.
    """
    here = raw.tell()
    try:
        end = raw.seek(0, os.SEEK_END)
        raw.seek(max(here, end - TAIL_PROBE_BYTES))
        return needle in raw.read(TAIL_PROBE_BYTES)
    finally:
        raw.seek(here)


def _info_json(info: Any) -> str:
    return json.dumps(info, separators=(", ", ": "))


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
    results: Sequence[TraceResult[ParsedTrace]] = TRACE_RESULTS,
) -> ProcessedTrace:
    """Write the outputs of the raw trace read from ``raw`` into ``final_dir``.

    Reads only from the open file: it neither moves nor deletes anything of the caller's.
    ``perms`` sets the outputs' mode and owner (the daemon hands a user's traces to that user).
    """
    if not stem or os.sep in stem or stem.startswith("."):
        raise ValueError(f"bad stem {stem!r}")
    final_dir = os.path.abspath(final_dir)
    made_dir = not os.path.isdir(final_dir)
    os.makedirs(final_dir, exist_ok=True)
    groups = EventGroups()
    try:
        with Batch(final_dir, stem, perms) as batch:
            # One read of the raw trace writes the gzipped copy and feeds the analyses.
            with batch.open("trace", TRACE_SUFFIX) as fh:
                n_events = _write_trace(fh, raw, name, stem, rank, world_size, groups.add)
            head: dict[str, str] = dict(header or {})
            head.setdefault("rank", str(rank))
            head.setdefault("world_size", str(world_size))
            head.setdefault("trace", stem + TRACE_SUFFIX)
            head.setdefault("raw_bytes", str(raw_bytes))
            head.setdefault("events", str(n_events))
            parsed = ParsedTrace(stem, head, top_n, groups)
            # The step statistics belong to the result, not to an output, so they fail the
            # capture.
            steps = parsed.steps
            notes = (no_step_note(groups.no_steps),) if groups.no_steps else ()
            rendered, output_errors = render_outputs(outputs, parsed, stem)
            records, record_errors = compute_results(results, parsed, stem)
            output_errors += record_errors
            del parsed, groups
            for out in rendered:
                batch.write(out.kind, out.suffix, out.data)
    except TraceFormatError as exc:
        if made_dir:
            with contextlib.suppress(OSError):
                os.rmdir(final_dir)  # only if it is still empty
        raise PipelineError(str(exc)) from None

    return ProcessedTrace(
        files=tuple(batch.files),
        trace_path=os.path.join(final_dir, stem + TRACE_SUFFIX),
        steps_found=steps.steps,
        step_ms_p50=steps.p50_ms,
        step_ms_p90=steps.p90_ms,
        step_ms_max=steps.max_ms,
        raw_bytes=raw_bytes,
        output_errors=output_errors,
        records=records,
        notes=notes,
    )
