"""The pipeline in bounded memory: the streaming reader, compact analyses, the gz it writes.

profd.pipeline reads a raw trace one event at a time (:mod:`profd.pipeline.stream`) and keeps
only compact columns of it (:class:`profd.pipeline.parsed.EventGroups`). These tests pin that
it gives what the whole-file version gave (``json.loads`` of everything, every event a dict,
as of commit 4b65d70): the reader against ``json.loads`` on tricky input read a few bytes at a
time, the analyses against that version's code (kept below as the reference), and the gzipped
trace byte for byte against its encoder. No timing or memory thresholds: bench_pipeline.py
measures those.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import subprocess
import sys
from array import array
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from kineto_synth import write_trace
from pipeline_paths import process_trace

from profd.pipeline import columns, process, stream
from profd.pipeline.memory import MEMORY_EVENT, MemoryReading, device_name
from profd.pipeline.memory_report import render_memory_html
from profd.pipeline.ops import CPU_OP_CATS, GPU_OP_CATS, OpStat
from profd.pipeline.parsed import ParsedTrace
from profd.pipeline.process import PipelineError, inject_rank
from profd.pipeline.spans import STEP_PREFIX, StepSpan, step_stats
from profd.pipeline.stream import TraceFormatError, TraceReader
from profd.pipeline.summary import render_summary

ROOT = Path(__file__).resolve().parent.parent
CHUNKS = [1, 2, 3, 5, 7, 64, 4093]


def read_all(data: bytes, chunk: int) -> dict[str, Any]:
    """The document as the reader puts it together (json.loads's key order and values)."""
    r = TraceReader(io.BytesIO(data), "t", chunk)
    head = r.head()
    events = list(r.events())
    assert r.events_read == len(events)
    tail = r.tail()
    doc = {**head, "traceEvents": events}
    doc.update(tail)
    return doc


def loads(data: bytes) -> Any:
    return json.loads(data.decode("utf-8", errors="replace"))


# --- the reader -------------------------------------------------------------------------------
TRICKY = (
    '\ufeff{\n  "schemaVersion": 1,\n  "deviceProperties": [ {"name": "H100", "n": [1, 2.5e-3,'
    ' -0.0, 1E+10, 12345678901234567890]} ],\n  "esc": "a\\"b\\\\c\\/d\\n\\u00e9\\ud83d\\ude00",'
    '\n  "traceEvents": [\n  {\n    "ph": "X", "cat": "cpu_op", "name": "aten::mm \\u2713 é ✓ 😀",'
    '\n    "ts": 1.5, "dur": 2\n    ,\n    "args": {\n      "Input Dims": [[32, 64], []],'
    ' "x": null, "y": true, "z": false, "e": "", "q": "\\"}]"\n    }\n  }  ,\n'
    '  {"ph":"i","name":"[memory]","ts":3,"args":{}},[],"str",-7,\n  1e5 , {}\n  ],'
    '\n  "traceName": "t ✓.json", "baseTimeNanoseconds": 1790857026000000000,'
    ' "after": {"k": [1, {"traceEvents": []}]}\n}\n'
).encode("utf-8")


@pytest.mark.parametrize("chunk", CHUNKS)
def test_reader_matches_json_loads_at_any_chunk_size(chunk: int) -> None:
    # Every boundary falls somewhere: inside escapes, surrogate pairs, multi-byte characters
    # (split between chunks as bytes), numbers ("1e5" cut to "1"), literals and whitespace.
    doc = read_all(TRICKY, chunk)
    want = loads(TRICKY[3:])  # json.loads rejects the BOM, the reader skips it
    assert doc == want and list(doc) == list(want)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4096])
def test_reader_replaces_undecodable_bytes_like_bytes_decode(chunk: int) -> None:
    # An invalid byte, a truncated sequence, and a valid 4-byte one that the chunks split.
    name = b"op \xff x \xe2\x9c y \xf0\x9f\x98\x80 z \xc3"
    data = b'{"traceEvents": [{"name": "' + name + b'"}], "n": "\xe9t\xc3\xa9"}'
    assert read_all(data, chunk) == loads(data)


@pytest.mark.parametrize("chunk", [1, 3, 4096])
@pytest.mark.parametrize(
    "text",
    [
        '{"traceEvents": []}',
        '{"traceEvents": [\n  \n  ]}',
        '{"traceEvents":[],"traceName":"x"}',
        ' \n {"a": 1, "traceEvents": [ 1 ] , "b" : [2] } \n ',
        '{"traceEvents": [0.5]}',
        '{"traceEvents": [{"a": "}]"}, "],\\""]}',
    ],
)
def test_reader_small_documents(text: str, chunk: int) -> None:
    data = text.encode()
    assert read_all(data, chunk) == json.loads(data)


BAD = [
    ("", "the file is empty"),
    ("   ", "the file is empty"),
    ("[]", "no JSON object at the top"),
    ("{}", "no traceEvents list"),
    ('{"a": 1}', "no traceEvents list"),
    ('{"traceEvents": {}}', "traceEvents is not a list"),
    ('{"traceEvents": null}', "traceEvents is not a list"),
    ('{"traceEvents": [', "truncated"),
    ('{"traceEvents": [{"a": 1}', "truncated"),
    ('{"traceEvents": [{"a": "b', "truncated"),
    ('{"traceEvents": [1,]}', "expecting a value"),
    ('{"traceEvents": [1 2]}', "expecting ',' or ']'"),
    ('{"traceEvents": [{"a": tru}]}', "expecting a value"),
    ('{"traceEvents": [{"a": 1,}]}', "not valid JSON"),
    ('{"traceEvents": [{"a": "x\ny"}]}', "Invalid control character"),
    ('{"traceEvents": []} x', "extra data"),
    ('{"traceEvents": [], }', "expecting a property name"),
    ('{"a" 1, "traceEvents": []}', "expecting ':'"),
    ('{"a": 1 "traceEvents": []}', "expecting ',' or '}'"),
    ('{"traceEvents": [], "traceEvents": []}', "traceEvents appears twice"),
    ('{"traceEvents": [], "x": 1e}', "not valid JSON"),
    ('{"traceEvents": [' + "[" * 100_000 + "]" * 100_000 + "]}", "nested too deeply"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + ', "traceEvents": []}', "nested too deeply"),
]


@pytest.mark.parametrize("chunk", [1, 4096])
@pytest.mark.parametrize(("text", "why"), BAD, ids=[f"{i}-{why}" for i, (_, why) in enumerate(BAD)])
def test_reader_rejects_what_is_no_chrome_trace(text: str, why: str, chunk: int) -> None:
    with pytest.raises(TraceFormatError, match=r"^t: .*" + why.replace("(", r"\(")) as info:
        read_all(text.encode(), chunk)
    assert "\n" not in str(info.value) and " at character " in str(info.value)


@pytest.mark.parametrize("chunk", [1, 7])
def test_every_truncation_is_an_error(chunk: int) -> None:
    data = TRICKY[3:].rstrip()
    for cut in range(len(data)):
        with pytest.raises(TraceFormatError):
            read_all(data[:cut], chunk)


def test_corrupted_traces_fail_exactly_where_json_loads_does() -> None:
    rng = random.Random(7)
    base = TRICKY[3:]
    for _ in range(400):
        data = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                del data[i]
            elif op == 1:
                data.insert(i, rng.choice(b'{}[]",:0e-. \\x'))
            else:
                data[i] = rng.choice(b'{}[]",:0e-. \\x')
        try:
            want = loads(bytes(data))
            ok = isinstance(want, dict) and isinstance(want.get("traceEvents"), list)
        except json.JSONDecodeError:
            ok = False
        for chunk in (3, 4096):
            if ok:
                assert read_all(bytes(data), chunk) == want, bytes(data)
            else:
                with pytest.raises(TraceFormatError):
                    read_all(bytes(data), chunk)


def test_a_value_without_end_stops_the_reader_early(monkeypatch: pytest.MonkeyPatch) -> None:
    # A string that never closes must not make the reader hold the rest of the file.
    monkeypatch.setattr(stream, "MAX_VALUE_CHARS", 10_000)
    data = b'{"traceEvents": [{"name": "' + b"x" * 1_000_000

    class Counting(io.BytesIO):
        read_bytes = 0

        def read(self, n: int | None = -1) -> bytes:
            out = super().read(n)
            self.read_bytes += len(out)
            return out

    fh = Counting(data)
    r = TraceReader(fh, "t", 1000)
    r.head()
    with pytest.raises(TraceFormatError, match="longer than 10,000 characters"):
        list(r.events())
    assert fh.read_bytes < 50_000


# --- sorting compact columns --------------------------------------------------------------------
@pytest.mark.parametrize("runs", ["one", "few", "many"])
def test_sorted_order_is_a_stable_sort(runs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    if runs == "many":
        monkeypatch.setattr(columns, "MAX_MERGE_RUNS", 2)  # the packed sort
    for _ in range(50):
        n = rng.randint(0, 300)
        ts = [rng.choice([0.0, -0.0, 1.0, 2.5, -3.0, rng.random() * 10]) for _ in range(n)]
        dur = [rng.choice([0.0, -0.0, 1.0, 2.0, rng.random()]) for _ in range(n)]
        if runs == "one":
            pairs = sorted(zip(ts, dur, strict=True), key=lambda p: (p[0], -p[1]))
            ts, dur = [p[0] for p in pairs], [p[1] for p in pairs]
        elif runs == "few" and n:
            cut = sorted(rng.sample(range(n), min(3, n)))
            for lo, hi in zip([0, *cut], [*cut, n], strict=True):
                part = sorted(zip(ts[lo:hi], dur[lo:hi], strict=True), key=lambda p: p[0])
                ts[lo:hi], dur[lo:hi] = [p[0] for p in part], [p[1] for p in part]
        want = sorted(range(n), key=lambda i: (ts[i], -dur[i]))
        got = columns.sorted_order(array("d", ts), array("d", dur))
        assert list(got) == want
        if runs == "one":
            assert isinstance(got, range)
        assert list(columns.sorted_order(array("d", ts))) == sorted(range(n), key=ts.__getitem__)


# --- the analyses against the whole-file version (4b65d70), kept here as the reference ----------
def ref_groups(events: list[Any]) -> dict[str, list[Any]]:
    g: dict[str, list[Any]] = {"steps": [], "cpu": [], "gpu": [], "memory": []}
    for ev in events:
        if not isinstance(ev, dict):
            continue
        name = ev.get("name")
        if name == MEMORY_EVENT:
            g["memory"].append(ev)
        if not (
            ev.get("ph") == "X"
            and isinstance(ev.get("ts"), int | float)
            and isinstance(ev.get("dur"), int | float)
        ):
            continue
        cat = ev.get("cat")
        if isinstance(cat, str):
            if cat in CPU_OP_CATS:
                g["cpu"].append(ev)
            elif cat in GPU_OP_CATS:
                g["gpu"].append(ev)
        if isinstance(name, str) and name.startswith(STEP_PREFIX):
            g["steps"].append(ev)
    return g


def ref_cpu(events: list[Mapping[str, Any]]) -> list[OpStat]:
    """The operators as ``docs/reports.md`` defines them, computed plainly (see ref_tables)."""
    return ref_tables(events)[0]


def _ref_parents(intervals: list[tuple[float, float, str]], member: list[bool]) -> dict[int, int]:
    """Each member's parent among the members: the innermost one still open at its start."""
    parents: dict[int, int] = {}
    stack: list[int] = []
    for i, (ts, _, _) in enumerate(intervals):
        if not member[i]:
            continue
        while stack and intervals[stack[-1]][0] + intervals[stack[-1]][1] <= ts:
            stack.pop()
        if stack:
            parents[i] = stack[-1]
        stack.append(i)
    return parents


def _ref_union(pairs: list[tuple[float, float]]) -> float:
    merged: list[list[float]] = []
    for s, e in sorted(pairs):
        if e <= s:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(e - s for s, e in merged)


def ref_tables(events: list[Mapping[str, Any]]) -> tuple[list[OpStat], list[OpStat]]:
    """(operators, call sites): cpu_op/user_annotation vs python_function by the category a
    name is first seen with; an operator's children are the operators and annotations inside
    it, a frame's the frames and cpu_ops inside it; profd's frames, what is inside them, and a
    thread with nothing else are left out; names differ by more than addresses; a name on
    several threads whose calls overlap in time is measured as the union of its calls'
    self-time segments (and intervals) across threads, any name's total as the union of its
    calls."""
    addr = re.compile(r" at 0x[0-9a-fA-F]+\b|\b0x[0-9a-fA-F]{6,}\b")

    def norm(name: str) -> str:
        return addr.sub(lambda m: "" if m.group().startswith(" at") else "0x…", name)

    cat_of: dict[str, str] = {}
    by_thread: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for ev in events:
        name = norm(str(ev.get("name", "")))
        cat_of.setdefault(name, str(ev.get("cat")))
        key = (ev.get("pid"), ev.get("tid"))
        by_thread.setdefault(key, []).append((float(ev["ts"]), float(ev["dur"]), name))

    def kind(name: str) -> str:
        if name.startswith(STEP_PREFIX) or cat_of[name] == "user_annotation":
            return "annotation"
        return "frame" if cat_of[name] == "python_function" else "op"

    def profd(name: str) -> bool:
        return (
            kind(name) == "frame"
            and re.search(r"(^|/)profd_client/[^/()]+\.py\(", name) is not None
        )

    threads_of: dict[str, set[Any]] = {}
    for key, intervals in by_thread.items():
        for _, _, name in intervals:
            threads_of.setdefault(name, set()).add(key)
    calls: dict[str, int] = {}
    self_us: dict[str, float] = {}
    total_us: dict[str, float] = {}
    segments: dict[str, list[tuple[float, float]]] = {}
    merged: dict[str, list[list[float]]] = {}  # each name's calls merged per thread
    for intervals in by_thread.values():
        intervals.sort(key=lambda iv: (iv[0], -iv[1]))
        kinds = [kind(name) for _, _, name in intervals]
        op_parent = _ref_parents(intervals, [k != "frame" for k in kinds])
        frame_parent = _ref_parents(intervals, [k != "annotation" for k in kinds])
        children: dict[int, list[int]] = {}
        for i in range(len(intervals)):
            if kinds[i] != "frame" and i in op_parent:
                children.setdefault(op_parent[i], []).append(i)
            p = frame_parent.get(i)
            if kinds[i] != "annotation" and p is not None and kinds[p] == "frame":
                children.setdefault(p, []).append(i)
        skip: set[int] = set()
        profd_frames = [i for i, (_, _, n) in enumerate(intervals) if profd(n)]
        for i, (ts, dur, _) in enumerate(intervals):
            for f in profd_frames:
                fs, fd, _ = intervals[f]
                if f == i or (f < i and fs <= ts and ts + dur <= fs + fd + 1e-3):
                    skip.add(i)
        if profd_frames:
            first = profd_frames[0]
            around = [
                i for i in range(first)
                if kinds[i] == "frame" and intervals[i][0] + intervals[i][1] > intervals[first][0]
            ]  # fmt: skip
            if len(skip) + len(around) == len(intervals):
                continue  # profd's agent thread
        runs: dict[str, list[list[float]]] = {}
        for i, (ts, dur, name) in enumerate(intervals):
            if name.startswith(STEP_PREFIX) or i in skip:
                continue
            child = 0.0
            at = ts
            for c in children.get(i, []):
                cs, cd, _ = intervals[c]
                child += cd
                if cs > at:
                    segments.setdefault(name, []).append((at, cs))
                at = max(at, cs + cd)
            if ts + dur > at:
                segments.setdefault(name, []).append((at, ts + dur))
            calls[name] = calls.get(name, 0) + 1
            self_us[name] = self_us.get(name, 0.0) + max(dur - child, 0.0)
            run = runs.setdefault(name, [])
            total_us.setdefault(name, 0.0)
            if not run or ts >= run[-1][1]:
                total_us[name] += dur
                run.append([ts, ts + dur])
            elif ts + dur > run[-1][1]:
                total_us[name] += ts + dur - run[-1][1]
                run[-1][1] = ts + dur
        for name, run in runs.items():
            merged.setdefault(name, []).extend(run)
    for name, run in merged.items():
        starts, ends = sorted(s for s, _ in run), sorted(e for _, e in run)
        if len(threads_of[name]) > 1 and any(
            e > s for e, s in zip(ends[:-1], starts[1:], strict=True)
        ):
            # Calls on several threads at once: the time any of them runs, counted once.
            total_us[name] = _ref_union([(s, e) for s, e in run])
            self_us[name] = _ref_union(segments.get(name, []))
    ops = {n for n in calls if kind(n) != "frame"}
    return (
        ref_sorted({n: calls[n] for n in ops}, self_us, total_us),
        ref_sorted({n: calls[n] for n in calls if n not in ops}, self_us, total_us),
    )


def ref_gpu(events: list[Mapping[str, Any]]) -> list[OpStat]:
    calls: dict[str, int] = {}
    dur_us: dict[str, float] = {}
    for ev in events:
        name = str(ev.get("name", ""))
        calls[name] = calls.get(name, 0) + 1
        dur_us[name] = dur_us.get(name, 0.0) + float(ev["dur"])
    return ref_sorted(calls, dur_us, dur_us)


def ref_sorted(
    calls: Mapping[str, int], self_us: Mapping[str, float], total_us: Mapping[str, float]
) -> list[OpStat]:
    stats = [OpStat(name, calls[name], self_us[name], total_us[name]) for name in calls]
    stats.sort(key=lambda s: (-s.self_us, s.name))
    return stats


def ref_memory(events: list[Mapping[str, Any]]) -> dict[str, list[MemoryReading]]:
    out: dict[str, list[MemoryReading]] = {}
    for ev in events:
        args, ts = ev.get("args"), ev.get("ts")
        if not isinstance(args, dict) or not isinstance(ts, int | float):
            continue
        alloc, reserved = args.get("Total Allocated"), args.get("Total Reserved")
        if not isinstance(alloc, int) or not isinstance(reserved, int):
            continue
        out.setdefault(device_name(args), []).append(MemoryReading(float(ts), alloc, reserved))
    for samples in out.values():
        samples.sort(key=lambda s: s.ts_us)
    return out


def ref_spans(events: list[Mapping[str, Any]]) -> list[StepSpan]:
    out = []
    for ev in events:
        try:
            step = int(ev["name"][len(STEP_PREFIX) :])
        except ValueError:
            continue
        out.append(StepSpan(step, float(ev["ts"]), float(ev["dur"])))
    return sorted(out, key=lambda s: s.start_us)


def ref_trace_chunks(doc: Mapping[str, Any]) -> Iterator[str]:
    """4b65d70's encoder of the gzipped trace, for a document loaded whole."""
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


def expected_gz_text(raw: bytes, rank: int, world_size: int) -> str:
    doc = loads(raw)
    inject_rank(doc, rank, world_size)
    return "".join(ref_trace_chunks(doc))


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A 4 MB trace laid out like torch.profiler's, with CPU ops, kernels and [memory]."""
    buf = io.BytesIO()
    info = write_trace(buf, 4 << 20, seed=5)
    assert info.steps >= 8 and info.memory_events and info.gpu_events and info.python_events
    return buf.getvalue()


def unsorted_events() -> list[Any]:
    """CPU ops in no order at all, on several threads, with odd and malformed events."""
    rng = random.Random(11)
    events: list[Any] = []
    for i in range(3000):
        ts = float(rng.randrange(0, 100_000)) / 4
        events.append(
            {
                "ph": "X",
                "cat": rng.choice(sorted(CPU_OP_CATS)),
                "name": rng.choice(["a", "b", "c", "ProfilerStep#3", "ProfilerStep#x", 7, None]),
                "pid": 1,
                "tid": rng.randrange(3),
                "ts": ts if i % 5 else int(ts),
                "dur": float(rng.randrange(0, 4000)) / 8,
            }
        )
        if i % 7 == 0:
            del events[-1]["name"]
        if i % 50 == 0:
            events.append({"ph": "X", "cat": "kernel", "name": f"k{i % 3}", "ts": ts, "dur": 1.25})
            events.append(
                {
                    "ph": "i",
                    "name": MEMORY_EVENT,
                    "ts": ts,
                    "args": {
                        "Device Type": i % 2,
                        "Device Id": 0,
                        "Total Allocated": i,
                        "Total Reserved": 2 * i,
                    },
                }
            )
    events += [None, [1], "x", {"ph": "X", "cat": "cpu_op", "ts": True, "dur": 1, "name": "t"}]
    return events


def assert_same_analyses(parsed: ParsedTrace, events: list[Any]) -> None:
    g = ref_groups(events)
    assert list(parsed.cpu_ops) == ref_cpu(g["cpu"])
    assert list(parsed.gpu_ops) == ref_gpu(g["gpu"])
    assert list(parsed.spans) == ref_spans(g["steps"])
    assert parsed.steps == step_stats(ref_spans(g["steps"]))
    mem = ref_memory(g["memory"])
    assert {dev: list(s) for dev, s in parsed.memory.items()} == mem
    # The outputs render from those: the same text, byte for byte.
    want = render_summary(
        parsed.header, parsed.steps, ref_cpu(g["cpu"]), ref_gpu(g["gpu"]), parsed.top_n
    )
    assert (
        render_summary(parsed.header, parsed.steps, parsed.cpu_ops, parsed.gpu_ops, parsed.top_n)
        == want
    )
    assert render_memory_html("t", parsed.memory, parsed.spans) == render_memory_html(
        "t", mem, ref_spans(g["steps"])
    )


def test_analyses_equal_the_whole_file_version_on_unsorted_events() -> None:
    events = unsorted_events()
    assert_same_analyses(ParsedTrace.from_events(events, "t", {}, 30), events)


def test_analyses_equal_the_whole_file_version_with_the_packed_sort(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(columns, "MAX_MERGE_RUNS", 1)
    events = unsorted_events()
    assert_same_analyses(ParsedTrace.from_events(events, "t", {}, 30), events)


def test_malformed_events_never_fail_the_trace() -> None:
    events: list[Any] = [
        {"ph": "X", "cat": "cpu_op", "name": "a", "pid": [1], "tid": {}, "ts": 1, "dur": 2},
        {"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "ts": 10**400, "dur": 2},
        {
            "ph": "i",
            "name": MEMORY_EVENT,
            "ts": 1,
            "args": {"Total Allocated": 1 << 70, "Total Reserved": 0},
        },
        {"ph": "X", "cat": "cpu_op", "name": "b", "pid": 1, "tid": 1, "ts": 1, "dur": 2},
    ]
    parsed = ParsedTrace.from_events(events, "t", {}, 30)
    assert [(s.name, s.calls) for s in parsed.cpu_ops] == [("a", 1), ("b", 1)]
    assert parsed.memory == {}


@pytest.mark.parametrize("chunk", [process.CHUNK_BYTES, 4093])
def test_multi_mb_trace_equals_the_whole_file_version(
    synth: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(process, "CHUNK_BYTES", chunk)
    raw = tmp_path / "raw.json"
    raw.write_bytes(synth)
    seen: list[ParsedTrace] = []

    class Keep:
        kind = "keep"
        suffix = ".keep"

        def render(self, parsed: ParsedTrace) -> None:
            seen.append(parsed)

    outputs = [*process.TRACE_OUTPUTS, Keep()]
    result = process_trace(str(raw), str(tmp_path / "out"), "s", 3, 8, outputs=outputs)

    [parsed] = seen
    events = loads(synth)["traceEvents"]
    assert parsed.header["events"] == str(len(events))
    assert_same_analyses(parsed, events)
    assert result.steps_found == parsed.steps.steps
    with gzip.open(result.trace_path, "rt", encoding="utf-8") as fh:
        assert fh.read() == expected_gz_text(synth, 3, 8)


def layout(data: bytes, where: str) -> bytes:
    """The synthetic trace with its top level rearranged (see the test below)."""
    doc = loads(data)
    info = doc.pop("distributedInfo")
    if where == "tail":
        doc["distributedInfo"] = info
    elif where == "tail-no-rank":
        doc["distributedInfo"] = {"backend": "gloo"}
    elif where == "tail-far":  # too far from the end for profd to see it coming
        doc["distributedInfo"] = info
        doc["zpad"] = "x" * (process.TAIL_PROBE_BYTES + 1000)
    elif where == "tail-same":
        doc["distributedInfo"] = {"world_size": 2, "rank": 1}  # what profd would add
    elif where == "repeated-key":
        return json.dumps(doc, indent=1).encode()[:-2] + b', "schemaVersion": 2}'
    elif where == "named-in-last-event":
        doc["traceEvents"][-1]["args"] = {"note": "distributedInfo"}
    return json.dumps(doc, indent=1, ensure_ascii=False).encode()


@pytest.mark.parametrize(
    "where",
    [
        "none",
        "tail",
        "tail-far",
        "tail-no-rank",
        "tail-same",
        "repeated-key",
        "named-in-last-event",
    ],
)
def test_gz_trace_equals_the_whole_file_version_whatever_the_layout(
    synth: bytes, tmp_path: Path, where: str
) -> None:
    # distributedInfo after traceEvents (or a key repeated there) is known only at the end:
    # profd then writes the trace again from a second read; either way the bytes are those
    # json.loads + json.dumps gave, with distributedInfo (rank first) alone on the first line.
    data = layout(synth[:300_000].rsplit(b"\n  },", 1)[0] + b"\n  }]}", where)
    raw = tmp_path / "raw.json"
    raw.write_bytes(data)
    result = process_trace(str(raw), str(tmp_path / "out"), "s", 1, 2)
    with gzip.open(result.trace_path, "rt", encoding="utf-8") as fh:
        text = fh.read()
    assert text == expected_gz_text(data, 1, 2)
    first = text.split("\n", 1)[0]
    assert first.startswith('{"distributedInfo": {"rank": ')


def test_no_trace_events_fails_and_leaves_nothing(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    raw.write_text('{"schemaVersion": 1, "traceName": "x"}')
    final = tmp_path / "a" / "b"
    with pytest.raises(PipelineError, match=r"raw\.json: not a Chrome trace \(no traceEvents"):
        process_trace(str(raw), str(final), "x", 0, 1)
    assert raw.exists() and not final.exists()


def test_truncated_synthetic_trace_fails_and_leaves_nothing(synth: bytes, tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    raw.write_bytes(synth[: len(synth) * 2 // 3])
    final = tmp_path / "out"
    final.mkdir()
    with pytest.raises(PipelineError, match="truncated"):
        process_trace(str(raw), str(final), "x", 0, 1)
    assert raw.exists() and list(final.iterdir()) == []


# --- the benchmark ------------------------------------------------------------------------------
def test_bench_pipeline_quick(tmp_path: Path) -> None:
    """bench_pipeline.py --quick runs both implementations and finds the same outputs."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_pipeline.py"),
            "--quick",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads((tmp_path / "pipeline.json").read_text())
    assert res["name"] == "pipeline" and res["quick"] is True
    assert [row["metric"] for row in res["rows"]] == [
        "pipeline peak RSS, 20 MB trace",
        "pipeline wall time, 20 MB trace",
    ]
    assert all(row["measured"] is not None for row in res["rows"])
    d = res["details"]["sizes"]["20"]
    assert d["trace_head"]["events"] > 10_000 and d["trace_tail"]["events"] > 10_000
    # The same files whatever the layout (distributedInfo goes first either way).
    assert d["profd"]["digests"] == d["profd_info_after_events"]["digests"]
    assert len(d["profd"]["digests"]) == 3  # trace, summary, memory report
    if res["details"]["baseline_available"]:  # git has the baseline commit (not a shallow clone)
        assert d["outputs_identical"] is True
        assert d["baseline"]["module"].endswith("/base/profd/pipeline/process.py")
