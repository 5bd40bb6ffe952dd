"""The files the pipeline makes from a capture besides the capture itself, as plug-ins.

In the spirit of pyinstrument's renderers: an output is any object with the small
:class:`TraceOutput` interface, and the pipeline runs those registered here, in order, on
every capture of their input type. Chrome traces (torch.profiler) give their outputs a
:class:`~.parsed.ParsedTrace`, parsed once for all of them; nsys reports, which only nsys can
read, give theirs a :class:`~.nsys_stats.NsysReport`.

The capture itself (``.pt.trace.json.gz``, ``.nsys-rep``) is no output: it is what the pipeline
exists to keep, so no output can cost it. An output that raises loses only its own file: the
error is logged with its traceback and recorded in ``ProcessedTrace.output_errors``, and the
capture and the other outputs are written as usual. Retrying would not help (the same capture
renders the same way), and a bug in a report must not hold the trace back from the index and
S3. Errors writing the files are another matter: they fail the whole capture, as before, so
that it is retried.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from profd.pipeline.memory_report import MemoryReport
from profd.pipeline.nsys_stats import NsysReport, NsysStats
from profd.pipeline.parsed import ParsedTrace
from profd.pipeline.rankstats import RankStatistics
from profd.pipeline.summary import Summary

log = logging.getLogger("profd.pipeline")

In = TypeVar("In", contravariant=True)
T = TypeVar("T")


class TraceOutput(Protocol[In]):
    """One file made from each capture whose input type is ``In``."""

    @property
    def kind(self) -> str:
        """The file's kind in the files table (``ProcessedFile.kind``)."""
        ...

    @property
    def suffix(self) -> str:
        """The file's name is the capture's stem (``{role}-r{rank}``) and this."""
        ...

    def render(self, parsed: In, /) -> bytes | str | None:
        """The file's contents (``str`` is written as UTF-8), or None for no file at all."""
        ...


class TraceResult(Protocol[In]):
    """A small record made from each capture, kept with its result rather than as a file.

    What it returns goes under ``key`` into the capture's result: the index and the session's
    ``session.json`` keep it, so reports read it without the trace (S3 alone suffices). It
    must stay small (a few kilobytes): a session's manifest holds one per rank and cycle. A
    record that raises costs only itself, like an output's file.
    """

    @property
    def key(self) -> str: ...

    def compute(self, parsed: In, /) -> Mapping[str, Any] | None: ...


TRACE_OUTPUTS: tuple[TraceOutput[ParsedTrace], ...] = (Summary(), MemoryReport())
NSYS_OUTPUTS: tuple[TraceOutput[NsysReport], ...] = (NsysStats(),)
TRACE_RESULTS: tuple[TraceResult[ParsedTrace], ...] = (RankStatistics(),)


@dataclass(frozen=True)
class Rendered:
    kind: str
    suffix: str
    data: bytes


@dataclass(frozen=True)
class OutputError:
    kind: str
    error: str  # "ExceptionType: message"


def render_outputs(
    outputs: Iterable[TraceOutput[T]], parsed: T, stem: str
) -> tuple[list[Rendered], tuple[OutputError, ...]]:
    """Each output's file, in order, and the errors of those that raised (see module doc)."""
    rendered, errors = [], []
    for out in outputs:
        try:
            data = out.render(parsed)
        except Exception as exc:
            log.exception("%s output for %s failed", out.kind, stem)
            errors.append(OutputError(out.kind, f"{type(exc).__name__}: {exc}"))
            continue
        if data is not None:
            raw = data.encode("utf-8") if isinstance(data, str) else data
            rendered.append(Rendered(out.kind, out.suffix, raw))
    return rendered, tuple(errors)


def compute_results(
    results: Iterable[TraceResult[T]], parsed: T, stem: str
) -> tuple[dict[str, Any], tuple[OutputError, ...]]:
    """Each record by its key, and the errors of those that raised (as for outputs)."""
    records: dict[str, Any] = {}
    errors = []
    for r in results:
        try:
            value = r.compute(parsed)
        except Exception as exc:
            log.exception("%s record for %s failed", r.key, stem)
            errors.append(OutputError(r.key, f"{type(exc).__name__}: {exc}"))
            continue
        if value is not None:
            records[r.key] = dict(value)
    return records, tuple(errors)
