"""The warehouse export's parts on a real index file: the builders (index rows -> each table's
exact schema), the queue's generations, retention, and the export of one flush to a
directory."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest

from profd.config import load
from profd.store.index import (
    Database,
    IncidentRepo,
    Mark,
    StepMinuteRepo,
    TraceRepo,
    WarehouseQueueRepo,
)
from profd.warehouse.arrow import SCHEMAS, arrow_table
from profd.warehouse.build import Source, build, part_range, reason
from profd.warehouse.export import Exporter
from profd.warehouse.sink import LocalSink

DAY = "2026-03-04"
HOUR = "2026-03-04/10"
T0 = datetime(2026, 3, 4, 10, 30, tzinfo=UTC).timestamp()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    d = Database(tmp_path / "index.db")
    yield d
    d.close()


STATS = {
    "v": 1,
    "mode": "gpu",
    "steps": {
        "step": [5, 6],
        "start_us": [0.0, 10.0],
        "ms": [10.0, 11.0],
        "compute_ms": [6.0, 7.0],
        "collective_ms": [3.0, 3.0],
        "idle_ms": [1.0, 1.0],
        "gap_ms": [0.5, 0.5],
        "wait_ms": [4.0, 4.0],
    },
    "ops": [["aten::mm", 4, 8.0, 9.0]],
    "gpu_ops": [["gemm", 4, 7.5]],
    "collectives": [["nccl:all_reduce", 2, 3.0]],
}


def add_capture(db: Database, s3_uri: str | None) -> None:
    db.conn.execute(
        "INSERT INTO sessions (id, job, state, backend, label, request, cycles, created_at,"
        " updated_at) VALUES ('s1', 'j', 'done', 'torch', 'lbl', '{}', '[]', ?, ?)",
        (T0, T0),
    )
    db.conn.execute(
        "INSERT INTO targets (session, host, pid, job, role, rank, world_size, state,"
        " updated_at) VALUES ('s1', 'h1', 7, 'j', 'trainer', 3, 8, 'done', ?)",
        (T0,),
    )
    row: dict[str, Any] = {
        "session": "s1", "job": "j", "host": "h1", "pid": 7, "role": "trainer", "rank": 3,
        "cycle": 0, "region": None, "steps": [6, 5], "path": "/spool/j/s1/t.json.gz",
        "bytes": 99, "state": "done", "stall_ms": 1.5, "step_ms_p50": None,
        "step_ms_max": None, "torch": None, "device": None, "created_at": T0, "stats": STATS,
    }  # fmt: skip
    f = {"session": "s1", "job": "j", "kind": "trace", "path": row["path"],
         "rel": "j/s1/t.json.gz", "bytes": 99, "upload_state": "pending"}  # fmt: skip
    TraceRepo(db).add_trace(row, [f])
    if s3_uri:
        db.conn.execute("UPDATE files SET s3_uri = ?, upload_state = 'uploaded'", (s3_uri,))


def rows(db: Database, table: str, part: str) -> list[dict[str, Any]]:
    t = arrow_table(table, build(table, part, Source.of(db, "node-a")))
    assert t.schema.equals(SCHEMAS[table])
    out: list[dict[str, Any]] = t.to_pylist()
    return out


def test_a_capture_becomes_its_captures_rank_steps_and_operators_rows(db: Database) -> None:
    add_capture(db, None)
    (cap,) = rows(db, "captures", HOUR)
    assert {k: cap[k] for k in ("job", "node", "host", "rank", "world_size", "backend")} == {
        "job": "j", "node": "node-a", "host": "h1", "rank": 3, "world_size": 8,
        "backend": "torch",
    }  # fmt: skip
    assert (cap["step_first"], cap["step_last"], cap["label"]) == (5, 6, "lbl")
    assert cap["trace_key"] == "j/s1/t.json.gz"  # not uploaded: below the spool
    assert cap["created"].timestamp() == T0
    steps = rows(db, "rank_steps", HOUR)
    assert [(s["step"], s["ms"], s["compute_ms"], s["mode"]) for s in steps] == [
        (5, 10.0, 6.0, "gpu"), (6, 11.0, 7.0, "gpu"),
    ]  # fmt: skip
    ops = {(o["kind"], o["name"]): o for o in rows(db, "operators", HOUR)}
    assert set(ops) == {("cpu", "aten::mm"), ("gpu", "gemm"), ("collective", "nccl:all_reduce")}
    assert (ops[("cpu", "aten::mm")]["total_ms"], ops[("cpu", "aten::mm")]["steps"]) == (9.0, 2)
    assert ops[("gpu", "gemm")]["total_ms"] is None
    assert rows(db, "captures", "2026-03-04/11") == []


def test_an_uploaded_trace_is_keyed_by_its_s3_uri_and_marks_its_day(db: Database) -> None:
    add_capture(db, None)
    q = WarehouseQueueRepo(db)
    before = q.gen("captures", HOUR)
    db.conn.execute("UPDATE files SET s3_uri = 's3://b/p/j/s1/t.json.gz'")
    assert q.gen("captures", HOUR) == (before or 0) + 1
    assert rows(db, "captures", HOUR)[0]["trace_key"] == "s3://b/p/j/s1/t.json.gz"


def minute(rank: int, p50: float, steps: int = 10, **kw: Any) -> dict[str, Any]:
    return {"job": "j", "host": "h", "role": "trainer", "rank": rank, "pid": 1,
            "minute": int(T0) // 60 * 60, "steps": steps, "sum_s": 1.0, "p50_ms": p50,
            "p90_ms": p50 + 10, "max_ms": p50 + 20, **kw}  # fmt: skip


def test_minutes_one_row_per_rank_and_the_nodes_row_per_job_minute(db: Database) -> None:
    StepMinuteRepo(db).add_step_minutes(
        [minute(0, 100.0), minute(1, 300.0), minute(2, 200.0, regions={"fwd": 0.25}),
         minute(0, 100.0, steps=30)]  # rank 0 re-attached within the minute
    )  # fmt: skip
    ranks = {r["rank"]: r for r in rows(db, "rank_minutes", HOUR)}
    assert sorted(ranks) == [0, 1, 2]
    assert (ranks[0]["steps"], ranks[0]["p50_ms"], ranks[0]["p99_ms"]) == (40, 100.0, None)
    assert ranks[2]["regions"] == [("fwd", 250.0)]  # ms, as every duration
    (job,) = rows(db, "job_minutes", HOUR)
    assert {k: job[k] for k in ("ranks", "steps", "p50_ms", "max_ms", "nodes")} == {
        "ranks": 3, "steps": 60, "p50_ms": 200.0, "max_ms": 320.0, "nodes": 1,
    }  # fmt: skip
    assert (job["slowest_rank"], job["slowest_node"], job["vs_baseline"]) == (1, "node-a", None)
    assert rows(db, "rank_minutes", "2026-03-04/11") == []


def test_an_incident_row(db: Database) -> None:
    doc = {"id": "i1", "kind": "straggler", "job": "j", "role": "trainer", "host": "h9",
           "state": "resolved", "detected_at": T0, "resolved_at": T0 + 60, "step": 9,
           "suspects": [{"host": "h2", "role": "trainer", "rank": 4}], "session": "s1",
           "evidence": {"why": "rank 4\n waits"}, "lost_rank_s": 7}  # fmt: skip
    IncidentRepo(db).save_incident(doc)
    (r,) = rows(db, "incidents", DAY)
    assert (r["node"], r["reason"], r["lost_rank_s"], r["step"]) == ("h9", "rank 4 waits", 7.0, 9)
    assert r["suspects"] == [{"node": "h2", "role": "trainer", "rank": 4}]
    assert r["resolved"].timestamp() == T0 + 60
    assert reason({"kind": "regression", "evidence": {"ratio": 1.5}}) == "regression x1.50"
    assert reason({"kind": "hang", "evidence": {}}) is None


def test_a_source_of_one_job_reads_only_that_jobs_rows_of_each_area(db: Database) -> None:
    add_capture(db, None)
    StepMinuteRepo(db).add_step_minutes([minute(0, 100.0)])
    IncidentRepo(db).save_incident({"id": "i1", "kind": "spike", "job": "j", "state": "open",
                                    "detected_at": T0, "suspects": []})  # fmt: skip
    for job, n in (("j", 1), ("other", 0), (None, 1)):
        src = Source.of(db, "node-a", job)
        assert len(src.traces(T0 - 3600, T0 + 3600)) == n, job
        assert len(src.minute_rows.minute_rows(T0 - 3600, T0 + 3600, job)) == n, job
        assert len(src.incident_rows.incident_docs(T0 - 3600, T0 + 3600, job)) == n, job
    # The range's end is not in it.
    assert Source.of(db, "node-a", "j").traces(T0 - 3600, T0) == []


def test_a_mark_goes_only_if_nothing_marked_its_partition_again(db: Database) -> None:
    q = WarehouseQueueRepo(db)
    IncidentRepo(db).save_incident({"id": "a", "kind": "k", "job": "j", "state": "open",
                                    "detected_at": T0})  # fmt: skip
    read = Mark("incidents", DAY, q.gen("incidents", DAY) or 0)
    IncidentRepo(db).save_incident({"id": "b", "kind": "k", "job": "j", "state": "open",
                                    "detected_at": T0})  # fmt: skip
    assert not q.written(read) and q.pending() == 1  # "b" came while "a" was written
    assert q.written(Mark("incidents", DAY, read.gen + 1)) and q.pending() == 0


def test_part_ranges() -> None:
    assert part_range("incidents", DAY) == (T0 - 10.5 * 3600, T0 + 13.5 * 3600)
    assert part_range("rank_minutes", "2026-03-04/10") == (T0 - 1800, T0 + 1800)
    # A sealed day of an hourly table: the whole day.
    assert part_range("captures", DAY) == part_range("incidents", DAY)
    with pytest.raises(ValueError):
        part_range("incidents", "2026-03-04/10")


def exporter(tmp_path: Path, now: float, **wh: Any) -> Exporter:
    cfg = load(env={"PROFD_STATE_DIR": str(tmp_path)})
    cfg = dataclasses.replace(
        cfg, node_name="node-a", warehouse=dataclasses.replace(cfg.warehouse, **wh)
    )
    return Exporter(cfg, clock=lambda: now)


def test_one_flush_writes_each_dirty_partition_and_drops_expired_ones(
    db: Database, tmp_path: Path
) -> None:
    add_capture(db, None)
    StepMinuteRepo(db).add_step_minutes([minute(0, 100.0)])
    # 31 days later: the rank minutes are past keep_rank_days; the capture and the job's
    # minute (keep_days) are not.
    ex = exporter(tmp_path, T0 + 31 * 86400)
    q = WarehouseQueueRepo(db)
    assert ex.flush(q) and q.pending() == 0
    root = tmp_path / "warehouse"
    made = sorted(str(p.relative_to(root)) for p in root.rglob("*.parquet"))
    assert made == [
        f"captures/date={DAY}/{ex.stem}~10.parquet",
        f"job_minutes/date={DAY}/{ex.stem}~10.parquet",
        f"operators/date={DAY}/{ex.stem}~10.parquet",
        f"rank_steps/date={DAY}/{ex.stem}~10.parquet",
    ]
    assert pq.read_table(root / made[0]).num_rows == 1
    assert ex.stem == f"node-a~{ex.instance}"
    assert exporter(tmp_path, T0).instance == ex.instance  # kept in the state dir


def test_pending_partitions_counts_rows_indexed_since_the_last_flush(
    db: Database, tmp_path: Path
) -> None:
    ex = exporter(tmp_path, T0)
    q = WarehouseQueueRepo(db)
    assert ex.flush(q) and ex.status(q)["pending_partitions"] == 0
    StepMinuteRepo(db).add_step_minutes([minute(0, 100.0)])
    # Not the last flush's count (up to flush_every old): what is marked now.
    assert ex.status(q)["pending_partitions"] == 2  # rank_minutes, job_minutes
    assert ex.status()["pending_partitions"] == 0
    assert ex.flush(q) and ex.status(q)["pending_partitions"] == 0


def _kill_child_when_started(pid: int) -> int:
    """SIGKILL ``pid``'s flush process once it is there; its pid. Only that child: a test
    worker may have others (another module's daemon and jobs)."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in proc.children():
            try:
                flush = "profd.warehouse.flush" in child.cmdline()
            except psutil.Error:  # gone meanwhile: not ours to wait for
                continue
            if flush:
                child.kill()
                return int(child.pid)
        time.sleep(0.01)
    raise AssertionError("no flush process started")


def test_a_killed_flush_process_keeps_every_mark_for_the_next_flush(
    db: Database, tmp_path: Path
) -> None:
    add_capture(db, None)
    StepMinuteRepo(db).add_step_minutes([minute(0, 100.0)])
    ex = exporter(tmp_path, T0)
    q = WarehouseQueueRepo(db)
    marked = q.marks()
    killed: list[int] = []
    killer = threading.Thread(target=lambda: killed.append(_kill_child_when_started(os.getpid())))
    # The index locked by this connection: the flush process waits at its open, so it is
    # killed before it writes anything, however slow the machine.
    with db.transaction():
        killer.start()
        assert not ex.flush(q)
    killer.join()
    assert killed
    st = ex.status(q)
    assert st["failing"] and st["last_error"] == "flush process ended with signal 9"
    assert q.marks() == marked and not list(tmp_path.rglob("*.parquet"))
    assert ex.flush(q) and q.pending() == 0
    assert len(list((tmp_path / "warehouse").rglob("*.parquet"))) == len(marked)
    assert not ex.status(q)["failing"]


def test_retention_deletes_whole_dates_of_every_writer(tmp_path: Path) -> None:
    root = tmp_path / "warehouse"
    sink = LocalSink(root)
    for date in ("2026-01-01", "2026-03-01"):
        for stem in ("node-a~1", "node-b~2"):
            sink.put(f"incidents/date={date}/{stem}.parquet", b"x")
            sink.put(f"rank_minutes/date={date}/{stem}~05.parquet", b"x")
    ex = exporter(tmp_path, T0, keep_days=60, keep_rank_days=2)
    ex.retention()
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*.parquet"))
    assert left == [
        "incidents/date=2026-03-01/node-a~1.parquet",
        "incidents/date=2026-03-01/node-b~2.parquet",
    ]
    assert ex.status()["retention_deleted"] == 6
    assert sink.delete_date("incidents", "2026-03-01", "node-a~1") == 1
    assert sink.dates("incidents") == ["2026-03-01"]
