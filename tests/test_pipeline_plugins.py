"""The pipeline's outputs as plug-ins: the registry, None, failures, one parse for all.

Small synthetic traces, no torch: these pin the plug-in contract, test_pipeline.py pins the
files themselves against real torch.profiler output.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pipeline_paths import process_trace

from profd.pipeline.nsys_report import finish_report
from profd.pipeline.nsys_stats import NsysReport, NsysStats
from profd.pipeline.outputs import NSYS_OUTPUTS, TRACE_OUTPUTS, OutputError, TraceOutput
from profd.pipeline.parsed import ParsedTrace, group_events
from profd.pipeline.process import ProcessedTrace


def x(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


CPU_MEMORY = {"Device Type": 0, "Device Id": -1, "Total Allocated": 64, "Total Reserved": 0}
EVENTS = [
    x("ProfilerStep#4", 0, 100, cat="user_annotation"),
    x("aten::mm", 10, 30),
    x("sgemm", 12, 5, cat="kernel", tid=7),
    {"ph": "i", "name": "[memory]", "ts": 20, "args": CPU_MEMORY},
]


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    path = tmp_path / "spool" / "raw.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"traceEvents": EVENTS}))
    return path


@dataclass
class Recorder:
    """An output that remembers what it was given and returns a fixed result."""

    kind: str
    suffix: str
    result: bytes | str | None
    seen: list[ParsedTrace] = field(default_factory=list)

    def render(self, parsed: ParsedTrace) -> bytes | str | None:
        self.seen.append(parsed)
        return self.result


class Broken:
    kind = "broken"
    suffix = ".broken.txt"

    def render(self, parsed: ParsedTrace) -> str:
        raise ZeroDivisionError("no steps to divide by")


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_registry_holds_the_outputs_with_their_file_names() -> None:
    assert [(o.kind, o.suffix) for o in TRACE_OUTPUTS] == [
        ("summary", ".summary.txt"),
        ("memory_report", ".memory.html"),
    ]
    assert [(o.kind, o.suffix) for o in NSYS_OUTPUTS] == [("summary", ".summary.txt")]


def test_default_registry_writes_every_output(raw: Path, tmp_path: Path) -> None:
    result = process_trace(str(raw), str(tmp_path / "c0"), "main-r2", 2, 4)

    assert [f.kind for f in result.files] == ["trace", "summary", "memory_report"]
    assert names(tmp_path / "c0") == [
        "main-r2.memory.html",
        "main-r2.pt.trace.json.gz",
        "main-r2.summary.txt",
    ]
    assert result.output_errors == ()


def test_every_registered_output_runs_on_one_parse(raw: Path, tmp_path: Path) -> None:
    text = Recorder("text", ".a.txt", "héllo\n")
    blob = Recorder("blob", ".b.bin", b"\x00\x01")
    final = tmp_path / "c0"

    result = process_trace(
        str(raw), str(final), "main-r0", 0, 1, header={"session": "s1"}, outputs=[text, blob]
    )

    assert [(f.kind, os.path.basename(f.path)) for f in result.files] == [
        ("trace", "main-r0.pt.trace.json.gz"),
        ("text", "main-r0.a.txt"),
        ("blob", "main-r0.b.bin"),
    ]
    assert (final / "main-r0.a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (final / "main-r0.b.bin").read_bytes() == b"\x00\x01"
    assert all(os.path.getsize(f.path) == f.bytes for f in result.files)
    # One ParsedTrace for all outputs, so an analysis one of them ran is there for the next.
    assert len(text.seen) == len(blob.seen) == 1
    parsed = text.seen[0]
    assert blob.seen[0] is parsed
    assert parsed.cpu_ops is parsed.cpu_ops
    assert parsed.stem == "main-r0"
    assert parsed.header["session"] == "s1" and parsed.header["rank"] == "0"
    assert parsed.steps.steps == (4,) == result.steps_found
    assert [s.name for s in parsed.gpu_ops] == ["sgemm"]
    assert parsed.memory["cpu"][0].allocated == 64


def test_output_returning_none_writes_no_file(raw: Path, tmp_path: Path) -> None:
    final = tmp_path / "c0"
    nothing = Recorder("nothing", ".none.txt", None)

    result = process_trace(str(raw), str(final), "m", 0, 1, outputs=[nothing])

    assert len(nothing.seen) == 1
    assert [f.kind for f in result.files] == ["trace"]
    assert names(final) == ["m.pt.trace.json.gz"]
    assert result.output_errors == ()


def test_failing_output_costs_only_its_own_file(
    raw: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    final = tmp_path / "c0"
    after = Recorder("after", ".after.txt", "still here")

    with caplog.at_level(logging.ERROR, logger="profd.pipeline"):
        result = process_trace(
            str(raw), str(final), "m", 0, 1, outputs=[Broken(), after, *TRACE_OUTPUTS]
        )

    assert result.output_errors == (
        OutputError("broken", "ZeroDivisionError: no steps to divide by"),
    )
    assert [f.kind for f in result.files] == ["trace", "after", "summary", "memory_report"]
    assert names(final) == [
        "m.after.txt",
        "m.memory.html",
        "m.pt.trace.json.gz",
        "m.summary.txt",
    ]  # and no temp file, no m.broken.txt
    assert not raw.exists()  # the capture is done: a retry would fail the same way
    # Logged with its traceback: the worker has no other way to show where it broke.
    (record,) = caplog.records
    assert "broken output for m failed" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError
    # The result crosses a process boundary (spawn pool) with its errors.
    assert pickle.loads(pickle.dumps(result)) == result


def test_failing_write_still_fails_the_capture(raw: Path, tmp_path: Path) -> None:
    # Unlike a render error, a file that cannot be written may well be written on a retry.
    final = tmp_path / "c0"
    unwritable = Recorder("bad", "/no/such/dir.txt", "x")

    with pytest.raises(OSError):
        process_trace(str(raw), str(final), "m", 0, 1, outputs=[unwritable])

    assert raw.exists()
    assert not [n for n in os.listdir(final) if ".tmp-" in n]


def test_outputs_conform_to_the_interface() -> None:
    # The annotations are the check: mypy on this file rejects an output that does not fit.
    outputs: list[TraceOutput[ParsedTrace]] = [*TRACE_OUTPUTS, Broken(), Recorder("r", ".r", None)]
    nsys_outputs: list[TraceOutput[NsysReport]] = [NsysStats()]
    assert all(isinstance(o.kind, str) and o.suffix.startswith(".") for o in outputs[:3])
    assert nsys_outputs[0].kind == "summary"


def test_group_events_sorts_each_event_once() -> None:
    events: list[Any] = [
        *EVENTS,
        ["not", "an", "event"],
        {"ph": "X", "cat": ["unhashable"], "name": "odd", "ts": 1, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "no_ts", "ts": "1", "dur": 1},
        {"ph": "i", "cat": "cpu_op", "name": "instant", "ts": 1},
        x("cudaLaunchKernel", 11, 1, cat="cuda_runtime"),
    ]
    groups = group_events(events)
    # Each group keeps only the fields its analysis reads (see EventGroups).
    assert groups.steps == [("ProfilerStep#4", 0.0, 100.0)]
    assert groups.cpu.names == ["ProfilerStep#4", "aten::mm"] and len(groups.cpu) == 2
    assert groups.gpu.calls == {"sgemm": 1}
    assert len(groups.memory) == 1


def fake_nsys(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nsys"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_nsys_outputs_get_the_report_not_a_trace(tmp_path: Path) -> None:
    report = tmp_path / "run.nsys-rep"
    report.write_bytes(b"rep")
    seen: list[NsysReport] = []

    class Look:
        kind = "look"
        suffix = ".look.txt"

        def render(self, rep: NsysReport) -> str:
            seen.append(rep)
            return rep.path.read_text()

    res = finish_report(
        "nsys", report, tmp_path / "c0", "main-r1", {"session": "s"}, 5, outputs=[Look()]
    )

    (rep,) = seen
    assert rep.path == tmp_path / "c0" / "main-r1.nsys-rep"
    assert dict(rep.header) == {"session": "s", "report": "main-r1.nsys-rep", "bytes": "3"}
    assert [(f.kind, os.path.basename(f.path)) for f in res.files] == [
        ("nsys", "main-r1.nsys-rep"),
        ("look", "main-r1.look.txt"),
    ]
    assert (tmp_path / "c0" / "main-r1.look.txt").read_text() == "rep"


def test_failing_nsys_output_keeps_the_report(tmp_path: Path) -> None:
    report = tmp_path / "run.nsys-rep"
    report.write_bytes(b"rep")

    class Boom:
        kind = "summary"
        suffix = ".summary.txt"

        def render(self, rep: NsysReport) -> str:
            raise RuntimeError("boom")

    res = finish_report("nsys", report, tmp_path / "c0", "m", {}, 5, outputs=[Boom()])

    assert [f.kind for f in res.files] == ["nsys"]
    assert names(tmp_path / "c0") == ["m.nsys-rep"]
    assert res.output_errors == (OutputError("summary", "RuntimeError: boom"),)


def test_nsys_stats_output(tmp_path: Path) -> None:
    ok = fake_nsys(
        tmp_path, 'echo "table for $*"\nfor r; do :; done\ntouch "${r%.nsys-rep}.sqlite"\n'
    )
    report = tmp_path / "c0" / "m.nsys-rep"
    report.parent.mkdir()
    report.write_bytes(b"rep")

    text = NsysStats().render(NsysReport(report, {"session": "s"}, ok, 5))

    assert text.startswith("# profd nsys report summary\nsession: s\n\ntable for stats ")
    assert text.endswith(f"{report}\n")
    assert names(report.parent) == ["m.nsys-rep"]  # the exported SQLite copy is gone

    failing = fake_nsys(tmp_path, "echo broken >&2\nexit 3\n")
    text = NsysStats().render(NsysReport(report, {}, failing, 5))
    assert "(nsys stats failed: `nsys stats` exited 3: broken)" in text


def test_processed_trace_stays_constructible_without_errors() -> None:
    # The daemon builds and reads ProcessedTrace; the new field must not break it.
    res = ProcessedTrace((), "t", (), None, None, None, 0)
    assert res.output_errors == ()
