"""``{stem}.summary.txt`` for an nsys report: a header and the tables of ``nsys stats``.

An nsys report is a binary file only nsys reads, so its outputs get no parsed trace: they get
:class:`NsysReport`, the finished report in its final place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from profd import nsys
from profd.pipeline.summary import SUMMARY_SUFFIX, header_lines


@dataclass(frozen=True)
class NsysReport:
    path: Path  # already in the cycle dir under its final name
    header: Mapping[str, str]  # what the capture is, for output headers
    nsys_bin: str
    timeout: float  # for each nsys command an output runs


class NsysStats:
    """A failing ``nsys stats`` costs only the tables: the summary says why they are missing."""

    kind = "summary"
    suffix = SUMMARY_SUFFIX

    def render(self, report: NsysReport) -> str:
        lines = header_lines("# profd nsys report summary", report.header)
        try:
            out = nsys.run(nsys.stats_argv(report.nsys_bin, report.path), report.timeout).output
            lines.append(out.rstrip())
        except nsys.NsysError as exc:
            lines.append(f"(nsys stats failed: {exc})")
        finally:
            # stats exports a SQLite copy beside the report; it can be as big as the report and
            # `nsys export` recreates it on demand.
            with contextlib.suppress(FileNotFoundError):
                report.path.with_suffix(".sqlite").unlink()
        return "\n".join(lines) + "\n"
