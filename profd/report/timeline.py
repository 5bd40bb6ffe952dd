"""One Chrome trace per cycle holding every rank, for Perfetto (``profctl report --timeline``).

Each rank becomes one process named ``{role} r{rank} @{host}`` (its CPU threads and GPU
streams become that process's threads), and its clock is shifted so that the first step every
rank captured starts at the same instant: hosts' clocks differ, and a synchronous job's ranks
start a step together (within the collective that ends the step before). The shift comes from
the statistics (``start_us`` of each step), so every trace is read once, one event at a time,
and written straight into the merged gzip: memory stays flat however many ranks there are.

The file goes beside the cycle directory (``c3.timeline.json.gz`` next to ``c3/``), never into
it: HTA reads every ``.json``/``.gz`` of a cycle directory as one rank's trace.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from profd.pipeline.stream import CHUNK_BYTES, TraceReader
from profd.report.model import RankData

#: Where the aligned step starts in the merged trace, µs: room for what came before it.
LEAD_US = 1_000_000.0
_ENC = json.JSONEncoder(separators=(",", ":"))


@dataclass(frozen=True)
class RankTrace:
    rank: RankData
    cycle: int
    name: str  # the trace's path or URI, for messages
    open: Callable[[], AbstractContextManager[IO[bytes]]]  # the gzipped trace's bytes


def aligned_step(traces: Sequence[RankTrace]) -> int | None:
    """The first step that every rank of the cycle has statistics for."""
    common: set[int] | None = None
    for t in traces:
        mine = {s for s, (c, _) in t.rank.starts.items() if c == t.cycle}
        common = mine if common is None else common & mine
    return min(common) if common else None


def _events(t: RankTrace, index: int, shift: float) -> Iterator[str]:
    pid = index + 1
    yield _ENC.encode(
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": t.rank.label}}
    )
    yield _ENC.encode(
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
    )
    threads: dict[tuple[str, str], int] = {}
    with t.open() as raw, gzip.GzipFile(fileobj=raw, mode="rb") as fh:
        reader = TraceReader(fh, t.name, CHUNK_BYTES)  # type: ignore[arg-type]
        reader.head()
        for ev in reader.events():
            if not isinstance(ev, dict):
                continue
            key = (repr(ev.get("pid")), repr(ev.get("tid")))
            tid = threads.get(key)
            if tid is None:
                tid = threads[key] = len(threads) + 1
                yield _ENC.encode(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": tid,
                        "args": {"name": f"{ev.get('pid')}/{ev.get('tid')}"},
                    }
                )
            if ev.get("ph") == "M" and ev.get("name") in ("process_name", "process_sort_index"):
                continue
            ev["pid"], ev["tid"] = pid, tid
            ts = ev.get("ts")
            if isinstance(ts, int | float):
                ev["ts"] = round(float(ts) + shift, 3)
            if "id" in ev:  # flow ids are per trace: keep ranks' arrows apart
                ev["id"] = f"r{index}:{ev['id']}"
            yield _ENC.encode(ev)


def write_timeline(traces: Sequence[RankTrace], out: Path) -> int:
    """Merge one cycle's traces into ``out`` (gzipped); returns the ranks written."""
    step = aligned_step(traces)
    if step is None:
        raise ValueError("the ranks of this cycle have no step in common to align on")
    starts = [t.rank.starts[step][1] for t in traces]
    firsts = [min(s for c, s in t.rank.starts.values() if c == t.cycle) for t in traces]
    lead = LEAD_US + max(s - f for s, f in zip(starts, firsts, strict=True))
    tmp = out.with_name(out.name + ".tmp")
    try:
        # gzip headers record the original name: the final one's, not the temporary file's.
        name = out.name.removesuffix(".gz")
        with (
            open(tmp, "wb") as raw,
            gzip.GzipFile(filename=name, mode="wb", compresslevel=6, fileobj=raw) as packed,
            io.TextIOWrapper(packed, encoding="utf-8") as gz,
        ):
            gz.write('{"displayTimeUnit":"ms","otherData":')
            gz.write(_ENC.encode({"aligned_on_step": step, "aligned_at_us": lead}))
            gz.write(',"traceEvents":[')
            sep = ""
            for i, t in enumerate(sorted(traces, key=lambda t: (t.rank.rank, t.rank.role))):
                shift = lead - t.rank.starts[step][1]
                for text in _events(t, i, shift):
                    gz.write(sep + text)
                    sep = ",\n"
            gz.write("]}\n")
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(traces)
