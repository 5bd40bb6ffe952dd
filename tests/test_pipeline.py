"""Tests for profd.pipeline against real torch.profiler output (no mocks)."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pipeline_paths import process_trace

from profd.pipeline.memory import MemoryReading
from profd.pipeline.memory_report import downsample, render_memory_html
from profd.pipeline.parsed import ParsedTrace
from profd.pipeline.process import PipelineError, ProcessedTrace, inject_rank
from profd.textfmt import human_bytes
from profd_client import protocol as P

# torch-tb-profiler's worker/span file-name pattern.
TB_PROFILER_RE = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(?:\.gz)?$")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One kineto trace with ProfilerStep#7 and #8, generated once and copied per test."""
    import torch  # a test dependency: a missing one must fail, not skip
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    path = tmp_path_factory.mktemp("torch") / "raw.pt.trace.json"
    prof = profile(activities=[ProfilerActivity.CPU], schedule=lambda step: ProfilerAction.RECORD)
    prof.step_num = 7
    a = torch.randn(64, 64)
    prof.start()
    for _ in range(3):
        a = torch.mm(a, a).relu_()
    prof.step()
    for _ in range(3):
        a = torch.mm(a, a).relu_()
    prof.stop()  # no step() first: a third, empty ProfilerStep#9 would be opened
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture
def raw(real_trace: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "spool" / "raw.json"
    dest.parent.mkdir()
    shutil.copyfile(real_trace, dest)
    return dest


def load_gz(path: str) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        doc: dict[str, Any] = json.load(fh)
    return doc


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".tmp-" in p.name]


def test_process_real_trace(raw: Path, tmp_path: Path) -> None:
    final = tmp_path / "final" / "session1"  # does not exist yet
    extra = raw.parent / "job_r3.memory.pickle"
    extra.write_bytes(b"\x80\x04snapshot")
    raw_size = raw.stat().st_size

    result = process_trace(
        str(raw),
        str(final),
        "job_r3",
        rank=3,
        world_size=8,
        extra_files=[("memory", str(extra))],
        header={"session": "session1", "job": "job"},
    )

    assert isinstance(result, ProcessedTrace)
    assert result.trace_path == str(final / "job_r3.pt.trace.json.gz")
    assert TB_PROFILER_RE.match(os.path.basename(result.trace_path))
    assert result.steps_found == (7, 8)
    assert result.raw_bytes == raw_size
    assert result.step_ms_p50 is not None and result.step_ms_p50 > 0
    assert result.step_ms_p90 is not None and result.step_ms_max is not None
    assert result.step_ms_p50 <= result.step_ms_p90 <= result.step_ms_max

    kinds = {f.kind: f for f in result.files}
    assert set(kinds) == {"trace", "summary", "memory"}
    for f in result.files:
        assert os.path.isabs(f.path)
        assert os.path.getsize(f.path) == f.bytes
    assert kinds["memory"].path == str(final / "job_r3.memory.pickle")
    assert Path(kinds["memory"].path).read_bytes() == b"\x80\x04snapshot"
    assert not extra.exists()
    assert not raw.exists()
    assert leftovers(final) == []

    doc = load_gz(result.trace_path)
    assert doc["distributedInfo"] == {"rank": 3, "world_size": 8}
    names = {e.get("name") for e in doc["traceEvents"]}
    assert {"ProfilerStep#7", "ProfilerStep#8", "aten::mm"} <= names
    # HTA finds ranks with this regex, line by line; compact JSON ("rank":3) would not match.
    with gzip.open(result.trace_path, "rt") as fh:
        assert re.search(r'"rank":\s+(\d+)', fh.readline()).group(1) == "3"  # type: ignore[union-attr]

    summary = Path(kinds["summary"].path).read_text()
    assert summary.index("session:") < summary.index("job:") < summary.index("step time")
    assert "session1" in summary
    assert "count 2" in summary
    assert re.search(r"^\s+7\s+\d+\.\d{3}$", summary, re.M)
    assert re.search(r"^\s+8\s+\d+\.\d{3}$", summary, re.M)
    assert re.search(r"^aten::mm\s+6\s", summary, re.M)
    assert "ProfilerStep#" not in summary.split("## CPU operators")[1]
    assert "GPU" not in summary  # CPU-only trace: no kernel table


def test_existing_distributed_info_preserved(raw: Path, tmp_path: Path) -> None:
    doc = json.loads(raw.read_text())
    info = {"backend": "nccl", "rank": 5, "world_size": 16, "pg_count": 2}
    raw.write_text(json.dumps({"distributedInfo": info, **doc}))

    result = process_trace(str(raw), str(tmp_path / "out"), "w5", rank=1, world_size=2)

    assert load_gz(result.trace_path)["distributedInfo"] == info


def test_distributed_info_without_rank_gets_rank(raw: Path, tmp_path: Path) -> None:
    doc = json.loads(raw.read_text())
    doc["distributedInfo"] = {"backend": "gloo"}
    raw.write_text(json.dumps(doc))

    result = process_trace(str(raw), str(tmp_path / "out"), "w2", rank=2, world_size=4)

    info = load_gz(result.trace_path)["distributedInfo"]
    assert info == {"backend": "gloo", "rank": 2, "world_size": 4}


def test_inject_rank() -> None:
    doc: dict[str, Any] = {"traceEvents": []}
    assert inject_rank(doc, 1, 2) is True
    assert doc["distributedInfo"] == {"rank": 1, "world_size": 2}
    assert inject_rank(doc, 7, 9) is False
    assert doc["distributedInfo"] == {"rank": 1, "world_size": 2}
    partial: dict[str, Any] = {"distributedInfo": {"backend": "nccl", "world_size": 64}}
    assert inject_rank(partial, 4, 8) is True
    assert partial["distributedInfo"] == {"backend": "nccl", "world_size": 64, "rank": 4}


def test_a_rank_the_protocol_does_not_know_is_replaced(raw: Path, tmp_path: Path) -> None:
    doc = json.loads(raw.read_text())
    for bad in (10**30, -1, "3", True, P.MAX_RANK + 1):
        raw.write_text(json.dumps({"distributedInfo": {"rank": bad, "world_size": 4}, **doc}))
        result = process_trace(str(raw), str(tmp_path / "out"), "w", rank=2, world_size=4)
        assert load_gz(result.trace_path)["distributedInfo"] == {"rank": 2, "world_size": 4}


def test_values_beyond_the_protocol_are_left_out_with_a_note(tmp_path: Path) -> None:
    huge = "9" * 30
    x = {"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 1}
    events = [
        {**x, "name": "ProfilerStep#1", "ts": 0, "dur": 100},
        {**x, "name": "ProfilerStep#" + huge, "ts": 100, "dur": 100},
        {**x, "name": f"ProfilerStep#{P.MAX_STEP + 1}", "ts": 200, "dur": 100},
        {**x, "name": "ProfilerStep#-2", "ts": 300, "dur": 100},
        {**x, "name": f"ProfilerStep#{P.MAX_STEP}", "ts": 400, "dur": 100},  # the last step
        {**x, "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 20},
        # Times beyond the protocol's seconds, NaN and a negative duration: no interval.
        {**x, "cat": "cpu_op", "name": "far", "ts": 1e300, "dur": 1},
        {**x, "cat": "cpu_op", "name": "long", "ts": 1, "dur": P.MAX_SECONDS * 1e6 * 2},
        {**x, "cat": "cpu_op", "name": "nan", "ts": float("nan"), "dur": 1},
        {**x, "cat": "cpu_op", "name": "back", "ts": 1, "dur": -5},
        {
            "ph": "i",
            "name": "[memory]",
            "ts": 1e300,
            "args": {"Total Allocated": 1, "Total Reserved": 2},
        },
    ]
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"traceEvents": events}))
    result = process_trace(str(raw), str(tmp_path / "out"), "t", rank=0, world_size=1)
    assert result.steps_found == (1, P.MAX_STEP)
    assert result.notes == (
        f"3 ProfilerStep# marker(s) ignored: no step number in 0..{P.MAX_STEP} after the '#'",
    )
    stats = result.records["stats"]
    assert stats["steps"]["step"] == [1, P.MAX_STEP] and stats["steps_total"] == 2
    assert [o[0] for o in stats["ops"]] == ["aten::mm"]
    assert "memory" not in stats
    summary = Path(result.trace_path.replace(".pt.trace.json.gz", ".summary.txt")).read_text()
    assert huge not in summary and "far" not in summary


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_truncated_trace_raises_and_keeps_raw(raw: Path, tmp_path: Path, cut: float) -> None:
    data = raw.read_bytes()
    raw.write_bytes(data[: int(len(data) * cut)])
    final = tmp_path / "out"
    extra = raw.parent / "x.memory.pickle"
    extra.write_bytes(b"m")

    with pytest.raises(PipelineError) as info:
        process_trace(str(raw), str(final), "bad", 0, 1, extra_files=[("memory", str(extra))])

    assert "\n" not in str(info.value)
    assert raw.exists() and raw.stat().st_size == int(len(data) * cut)
    assert extra.exists()
    assert not final.exists() or list(final.iterdir()) == []


def test_not_a_trace_raises(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    raw.write_text('{"hello": 1}')
    with pytest.raises(PipelineError):
        process_trace(str(raw), str(tmp_path / "out"), "x", 0, 1)
    assert raw.exists()


def test_missing_extra_file_raises_before_writing(raw: Path, tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(PipelineError, match=r"nope\.pickle"):
        process_trace(
            str(raw), str(final), "x", 0, 1, extra_files=[("memory", str(tmp_path / "nope.pickle"))]
        )
    assert raw.exists()
    assert not final.exists()


def test_retry_after_extra_already_moved(raw: Path, tmp_path: Path) -> None:
    # An earlier attempt may have moved the extra before failing; the retry must not trip on it.
    final = tmp_path / "out"
    final.mkdir()
    (final / "x.memory.pickle").write_bytes(b"m")
    src = raw.parent / "x.memory.pickle"

    result = process_trace(str(raw), str(final), "x", 0, 1, extra_files=[("memory", str(src))])

    assert [f.kind for f in result.files] == ["trace", "summary", "memory"]
    assert leftovers(final) == []


def test_overwrites_previous_output(raw: Path, real_trace: Path, tmp_path: Path) -> None:
    final = tmp_path / "out"
    process_trace(str(raw), str(final), "x", 0, 1)
    shutil.copyfile(real_trace, raw)
    result = process_trace(str(raw), str(final), "x", 1, 2)
    assert load_gz(result.trace_path)["distributedInfo"]["rank"] == 1
    assert sorted(p.name for p in final.iterdir()) == ["x.pt.trace.json.gz", "x.summary.txt"]


def parse(events: list[Any]) -> ParsedTrace:
    return ParsedTrace.from_events(events, "t", {}, 30)


def test_summarize_steps_percentiles() -> None:
    events = [
        {"ph": "X", "name": f"ProfilerStep#{n}", "ts": n * 1000.0, "dur": d, "cat": "x"}
        for n, d in [(3, 10_000.0), (1, 30_000.0), (2, 20_000.0)]
    ]
    events.append({"ph": "i", "name": "ProfilerStep#9", "ts": 0.0})  # not a complete event
    events.append({"ph": "X", "name": "ProfilerStep#oops", "ts": 0.0, "dur": 1.0})
    stats = parse(events).steps
    assert stats.steps == (1, 2, 3)
    assert stats.durations_ms == ((1, 30.0), (2, 20.0), (3, 10.0))
    assert stats.p50_ms == pytest.approx(20.0)
    assert stats.p90_ms == pytest.approx(28.0)
    assert stats.max_ms == pytest.approx(30.0)
    assert parse([]).steps.p50_ms is None


def test_self_time_nesting() -> None:
    def x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    events = [
        x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        x("outer", 10, 50),
        x("inner", 10, 20),  # same start as its parent
        x("inner", 35, 10.0000001),  # overshoots its parent's end by float noise
        x("leaf", 36, 4),  # grandchild: subtracted from inner only
        x("outer", 70, 10),
        x("other_thread", 10, 50, tid=2),
        x("runtime", 12, 1, cat="cuda_runtime"),  # not a CPU op category
    ]
    ops = parse(events).cpu_ops
    stats = {s.name: s for s in ops}
    assert set(stats) == {"outer", "inner", "leaf", "other_thread"}
    assert stats["outer"].calls == 2
    assert stats["outer"].self_us == pytest.approx(50 - 30 + 10)
    assert stats["outer"].total_us == pytest.approx(60)
    assert stats["inner"].self_us == pytest.approx(20 + 10 - 4)
    assert stats["leaf"].self_us == pytest.approx(4)
    assert stats["other_thread"].self_us == pytest.approx(50)
    assert ops[0].name == "other_thread"  # sorted by self time


def test_gpu_kernel_table(raw: Path, tmp_path: Path) -> None:
    doc = json.loads(raw.read_text())
    for i, cat in enumerate(["kernel", "kernel", "gpu_memcpy", "gpu_memset"]):
        name = "sgemm_" + "x" * 80 if cat == "kernel" else f"Memcpy {cat}"
        doc["traceEvents"].append(
            {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": i * 10.0, "dur": 5.0}
        )
    raw.write_text(json.dumps(doc))

    result = process_trace(str(raw), str(tmp_path / "out"), "g", 0, 1, top_n=2)

    summary = Path(result.files[1].path).read_text()
    gpu = summary.split("## GPU kernels")[1]
    assert "GPU ops (top 2 of 3 by self time)" in gpu
    assert re.search(r"^sgemm_x+\.\.\.\s+2\s+0\.010\s", gpu, re.M)
    assert max(len(line.split("  ")[0]) for line in gpu.splitlines()[2:4]) <= 60


def test_no_torch_import_and_runs_in_spawn_worker(raw: Path, tmp_path: Path) -> None:
    code = "import sys, profd.pipeline.process; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        result = pool.submit(process_trace, str(raw), str(tmp_path / "out"), "s", 0, 1).result()
    assert result.steps_found == (7, 8)
    assert not raw.exists()


@pytest.mark.filterwarnings("ignore:The inplace keyword")  # HTA vs newer pandas, not ours
def test_hta_loads_output(raw: Path, tmp_path: Path) -> None:
    from hta.trace_analysis import TraceAnalysis

    final = tmp_path / "hta"
    extra = raw.parent / "w.memory.pickle"
    extra.write_bytes(b"m")
    process_trace(str(raw), str(final), "w", 5, 8, extra_files=[("memory", str(extra))])

    analyzer = TraceAnalysis(trace_dir=str(final))
    # 5, not 0: HTA files any trace whose rank it cannot find under rank 0.
    assert list(analyzer.t.traces.keys()) == [5]


def test_memory_report_from_a_profile_memory_trace(tmp_path: Path) -> None:
    import torch  # a test dependency: a missing one must fail, not skip
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    raw_path = tmp_path / "spool" / "raw.pt.trace.json"
    raw_path.parent.mkdir()
    prof = profile(
        activities=[ProfilerActivity.CPU],
        schedule=lambda step: ProfilerAction.RECORD,
        profile_memory=True,
    )
    prof.step_num = 7
    prof.start()
    small = torch.ones(1 << 10)
    prof.step()
    big = torch.ones(1 << 22)  # 16 MiB while step 8 runs
    del big
    prof.stop()
    del small
    prof.export_chrome_trace(str(raw_path))
    events = json.loads(raw_path.read_text())["traceEvents"]
    peak = max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")
    assert peak >= 16 << 20

    result = process_trace(str(raw_path), str(tmp_path / "c0"), "main-r0", rank=0, world_size=1)
    kinds = {f.kind: f for f in result.files}
    page = Path(kinds["memory_report"].path)
    assert page.name == "main-r0.memory.html"
    assert page.stat().st_size == kinds["memory_report"].bytes
    text = page.read_text()
    assert "<h2>cpu</h2>" in text and "<svg" in text and "<polyline" in text
    assert f"peak allocated {human_bytes(peak, digits=2)}" in text
    rows = dict(re.findall(r"<tr><td>(\d+)</td><td>([^<]+)</td>", text))
    assert set(rows) == {"7", "8"}
    assert rows["8"] == human_bytes(peak, digits=2) and rows["7"] != rows["8"]


def test_memory_report_absent_without_memory_events(raw: Path, tmp_path: Path) -> None:
    result = process_trace(str(raw), str(tmp_path / "c0"), "main-r0", rank=0, world_size=1)
    assert "memory_report" not in {f.kind for f in result.files}
    assert not (tmp_path / "c0" / "main-r0.memory.html").exists()


def test_memory_downsample_keeps_the_peak() -> None:
    samples = [MemoryReading(float(t), 100 + (5000 if t == 4321 else 0), 0) for t in range(10_000)]
    thin = downsample(samples, 100)
    assert len(thin) == 100 and max(s.allocated for s in thin) == 5100
    assert [s.ts_us for s in thin] == sorted(s.ts_us for s in thin)


def test_memory_page_draws_reserved_only_where_it_means_something() -> None:
    cpu = {"cpu": [MemoryReading(float(t), 1000 * t, 0) for t in range(1, 5)]}
    cuda = {"cuda:0": [MemoryReading(float(t), 1000 * t, 4096 * t) for t in range(1, 5)]}
    page = render_memory_html("t", cpu, [])
    assert page is not None and '<polyline class="allocated"' in page
    # CPU has no caching allocator: reserved is 0 all along, no flat line, no legend.
    assert '<polyline class="reserved"' not in page and "peak reserved" not in page
    page = render_memory_html("t", cuda, [])
    assert page is not None and '<polyline class="reserved"' in page and "peak reserved" in page
