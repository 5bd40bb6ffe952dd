"""The pipeline's per-rank statistics (profd/pipeline/rankstats.py) on synthetic traces."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from kineto_synth import single_rank_nccl_events, sync_job_events, trace_bytes
from pipeline_paths import process_trace

from profd.pipeline.parsed import ParsedTrace
from profd.pipeline.rankstats import MAX_STEPS, Intervals, RankStatistics, rank_stats
from profd.store.index import Database, TraceFilter, TraceRepo


def stats_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    return rank_stats(ParsedTrace.from_events(events, "t", {}, 30))


def test_intervals_measure_union_intersection_and_gaps() -> None:
    a = Intervals.of([(0, 10), (5, 15), (20, 30)])
    assert list(a.starts) == [0, 20] and list(a.ends) == [15, 30]
    b = Intervals.of([(12, 22)])
    assert a.measure(0, 100) == 25
    assert a.measure(10, 25) == 10
    both = a.intersection(b)
    assert list(zip(both.starts, both.ends, strict=True)) == [(12, 15), (20, 22)]
    assert a.union(b).measure(0, 100) == 30
    assert a.longest_gap(0, 40) == 10  # 30..40
    assert a.longest_gap(14, 21) == 5  # 15..20


def test_a_rank_that_computes_longer_waits_less_in_the_collective() -> None:
    compute = [[1000.0] * 5, [4000.0] * 5, [1000.0] * 5]
    per_rank = [stats_of(ev) for ev in sync_job_events(compute)]
    for st in per_rank:
        s = st["steps"]
        assert st["mode"] == "cpu"
        assert s["step"] == [1, 2, 3, 4, 5]
        for i in range(5):
            parts = s["compute_ms"][i] + s["collective_ms"][i] + s["idle_ms"][i]
            assert parts == pytest.approx(s["ms"][i], abs=0.003)
    slow, fast = per_rank[1]["steps"], per_rank[0]["steps"]
    assert slow["compute_ms"][0] == 4.0  # the allreduce_ call counts as collective
    assert fast["collective_ms"][0] > slow["collective_ms"][0] + 2.5
    assert per_rank[0]["collectives"][0][0] == "gloo:all_reduce"
    assert per_rank[1]["ops"][0][:2] == ["aten::mm", 5]


def test_gpu_traces_split_device_time() -> None:
    compute = [[1000.0] * 3, [3000.0] * 3]
    fast, slow = (stats_of(ev) for ev in sync_job_events(compute, gpu=True))
    assert fast["mode"] == slow["mode"] == "gpu"
    assert fast["collectives"][0][0].startswith("ncclDevKernel_AllReduce")
    assert fast["steps"]["collective_ms"][0] > slow["steps"]["collective_ms"][0] + 1.5
    assert slow["steps"]["compute_ms"][0] == pytest.approx(2.98, abs=0.001)
    assert slow["gpu_ops"][0][0] == "ampere_sgemm_128x64_nn"


def test_a_memcpy_launched_by_a_collective_is_collective_time_not_compute() -> None:
    # One rank on NCCL: the all-reduce's only GPU work is a device-to-device memcpy.
    st = stats_of(single_rank_nccl_events(steps=3))
    assert st["mode"] == "gpu"
    s = st["steps"]
    # The kernel (200 µs) and the job's own host-to-device copy (50 µs) are compute; the
    # collective's memcpy (100 µs on the device) is collective (its CPU range runs while the
    # kernel does, and compute wins the overlap).
    assert s["compute_ms"] == [0.25, 0.25, 0.25]
    assert s["collective_ms"] == [0.1, 0.1, 0.1]
    names = {row[0]: row[1] for row in st["collectives"]}
    assert names["Memcpy DtoD (Device -> Device)"] == 3 and names["nccl:all_reduce"] == 3
    assert "Memcpy HtoD (Pageable -> Device)" not in names
    # Without correlation ids nothing ties the memcpy to the collective: it stays compute.
    bare = [{k: v for k, v in ev.items() if k != "args"} for ev in single_rank_nccl_events(steps=1)]
    assert stats_of(bare)["steps"]["compute_ms"] == [0.35]


def test_statistics_stay_bounded_and_record_memory() -> None:
    doc = json.loads(trace_bytes(4 << 20))
    # More operators than a rank keeps (the synthetic job has 13 of its own).
    doc["traceEvents"] += [
        {"ph": "X", "cat": "cpu_op", "name": f"extra::op{i}", "pid": 1, "tid": 1, "ts": i, "dur": 1}
        for i in range(30)
    ]
    st = stats_of(doc["traceEvents"])
    assert len(st["ops"]) == 20 and len(st["gpu_ops"]) <= 20
    assert st["memory"]["cuda:0"]["peak_allocated"] > 1 << 30
    many = sync_job_events([[10.0] * (MAX_STEPS + 10)])[0]
    st = stats_of(many)
    assert len(st["steps"]["step"]) == MAX_STEPS and st["steps_total"] == MAX_STEPS + 10
    assert len(json.dumps(st)) < 64 << 10


class Broken:
    key = "broken"

    def compute(self, parsed: ParsedTrace) -> dict[str, Any]:
        raise RuntimeError("boom")


def test_process_trace_returns_the_statistics_and_a_broken_record_costs_only_itself(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "raw.json"
    events = sync_job_events([[1000.0] * 3, [2000.0] * 3])[1]
    raw.write_text(json.dumps({"traceEvents": events}))
    res = process_trace(
        str(raw), str(tmp_path / "out"), "trainer-r1", 1, 2, results=(RankStatistics(), Broken())
    )
    assert res.records["stats"]["steps"]["step"] == [1, 2, 3]
    assert [e.kind for e in res.output_errors] == ["broken"]
    assert {f.kind for f in res.files} == {"trace", "summary"}
    # No JSON file beside the trace: HTA would read it as a trace.
    assert not list((tmp_path / "out").glob("*.json"))


def test_index_keeps_statistics_and_migrates_an_older_index(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    db = Database(path)
    # An index of schema 3: no statistics column, and the version that says so.
    db.conn.execute("ALTER TABLE traces DROP COLUMN stats")
    db.conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    db.close()
    db = Database(path)
    idx = TraceRepo(db)
    row = {
        "session": "s",
        "job": "j",
        "host": "h",
        "pid": 1,
        "role": "trainer",
        "rank": 0,
        "cycle": 0,
        "region": None,
        "steps": [1],
        "path": str(tmp_path / "t.gz"),
        "bytes": 1,
        "state": "ok",
        "stall_ms": None,
        "step_ms_p50": None,
        "step_ms_max": None,
        "torch": None,
        "device": None,
        "created_at": 1.0,
        "stats": {"v": 1},
    }
    idx.add_trace(row, [])
    assert idx.traces(TraceFilter(session="s"))[0]["stats"] == {"v": 1}
    cols = {r[1] for r in sqlite3.connect(path).execute("PRAGMA table_info(traces)")}
    assert "stats" in cols
