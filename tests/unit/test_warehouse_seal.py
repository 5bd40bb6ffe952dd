"""A closed day's seal: a writer's hourly objects of a day become one day object, which a
reader reads in their place from the moment it exists, which takes every later change of
that day, and after which the hourly objects are deleted; each row read exactly once
throughout, through DuckDB's reader (local disk) and pyarrow's (what S3 uses)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from profd.config import ConfigError, load
from profd.store.index import Database, StepMinuteRepo, WarehouseQueueRepo
from profd.warehouse import reader as R
from profd.warehouse.arrow import Overlay
from profd.warehouse.export import Exporter
from profd.warehouse.reader import overlays_from_reply
from profd.warehouse.seal import Seals, overlay_part
from profd.warehouse.tables import TABLES, superseded

DAY = "2026-03-04"
T0 = datetime(2026, 3, 4, 10, 30, tzinfo=UTC).timestamp()
#: The day after, once ``seal_after`` (an hour by default) has passed.
NEXT = datetime(2026, 3, 5, 1, 30, tzinfo=UTC).timestamp()
HOURS = ("rank_minutes", "job_minutes")


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    d = Database(tmp_path / "index.db")
    yield d
    d.close()


def minutes(db: Database, hour: int, ranks: int = 2, at: float = T0) -> None:
    start = datetime.fromtimestamp(at, UTC).replace(hour=hour, minute=5).timestamp()
    StepMinuteRepo(db).add_step_minutes(
        [
            {"job": "j", "host": "h", "role": "trainer", "rank": r, "pid": 1,
             "minute": int(start), "steps": 10, "sum_s": 1.0, "p50_ms": 100.0 + r,
             "p90_ms": 110.0, "max_ms": 120.0}
            for r in range(ranks)
        ]
    )  # fmt: skip


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def exporter(tmp_path: Path, clock: Clock, **wh: Any) -> Exporter:
    """The seal on its own: merging (tests/unit/test_warehouse_fleet.py) is off unless asked."""
    wh.setdefault("merge", False)
    cfg = load(env={"PROFD_STATE_DIR": str(tmp_path)})
    cfg = dataclasses.replace(
        cfg, node_name="node-a", warehouse=dataclasses.replace(cfg.warehouse, **wh)
    )
    return Exporter(cfg, clock=clock)


def objects(root: Path, table: str) -> list[str]:
    return sorted(p.name for p in (root / table).rglob("*.parquet"))


def count(root: Path, how: str, overlays: list[Overlay] | None = None) -> dict[str, int]:
    """Rows per table as a reader sees them: through R.query (DuckDB's reader, with its
    check) or pyarrow datasets."""
    loc = R.locate(str(root))
    sql = "SELECT (SELECT count(*) FROM rank_minutes) AS r, (SELECT count(*) FROM job_minutes) AS j"
    if how == "duckdb":
        res = R.query(loc, HOURS, overlays or [], sql)
    else:
        con = R.open_tables(loc, TABLES, overlays or [], native=False)
        res = R.run_sql(con, sql)
    row = res.to_pylist()[0]
    return {"rank_minutes": int(row["r"]), "job_minutes": int(row["j"])}


def hour_written(db: Database, tmp_path: Path) -> tuple[Path, Clock, Exporter, WarehouseQueueRepo]:
    """Two ranks' minutes of 03:00 flushed while the day is open: one hourly object each."""
    minutes(db, 3)
    clock = Clock(T0 + 12 * 3600)
    ex = exporter(tmp_path, clock)
    q = WarehouseQueueRepo(db)
    assert ex.flush(q)
    return tmp_path / "warehouse", clock, ex, q


@pytest.fixture(params=["duckdb", "pyarrow"])
def how(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_day_object_supersedes_its_writers_hourly_objects_only() -> None:
    d = "w/rank_minutes/date=2026-03-04"
    paths = [
        f"{d}/a~1~00.parquet", f"{d}/a~1~07.parquet", f"{d}/a~1.parquet",  # sealed
        f"{d}/b~2~00.parquet",  # another writer, not sealed
        f"{d}/a~9~00.parquet",  # the same node reimaged: another instance
        "w/rank_minutes/date=2026-03-05/a~1~00.parquet",  # the writer's next day
    ]  # fmt: skip
    assert superseded(paths) == {f"{d}/a~1~00.parquet", f"{d}/a~1~07.parquet"}
    assert superseded([f"{d}/a~1~00.parquet"]) == set()


def test_only_closed_days_inside_the_horizon_are_sealed() -> None:
    s = Seals(seal_after=3600.0)
    assert not s.sealable(DAY, T0)  # open
    assert not s.sealable(DAY, datetime(2026, 3, 5, 0, 30, tzinfo=UTC).timestamp())  # too soon
    assert s.sealable(DAY, NEXT)
    assert s.sealable(DAY, NEXT + 2 * 86400)
    assert not s.sealable(DAY, NEXT + 3 * 86400)  # the index may hold part of it no more
    # A node's unflushed rows: whole days where the day is sealed or about to be.
    early = NEXT - 3000  # closed, not sealable yet
    assert overlay_part("rank_minutes", f"{DAY}/10", set(), s, T0) == f"{DAY}/10"
    assert overlay_part("rank_minutes", f"{DAY}/10", set(), s, early) == f"{DAY}/10"
    assert overlay_part("rank_minutes", f"{DAY}/10", {("rank_minutes", DAY)}, s, early) == DAY
    assert overlay_part("rank_minutes", f"{DAY}/10", set(), s, NEXT) == DAY
    assert overlay_part("incidents", DAY, set(), s, NEXT) == DAY


def test_seal_after_has_a_floor(tmp_path: Path) -> None:
    conf = tmp_path / "profd.toml"
    conf.write_text("[warehouse]\nseal_after = 10\n")
    with pytest.raises(ConfigError, match=r"warehouse.seal_after: must be a number >= 300"):
        load(conf, env={"PROFD_STATE_DIR": str(tmp_path)})
    conf.write_text("[warehouse]\nseal_after = 7200\nsweep_after = 0\n")
    wh = load(conf, env={"PROFD_STATE_DIR": str(tmp_path)}).warehouse
    assert (wh.seal_after, wh.sweep_after) == (7200.0, 0.0)


def test_a_closed_day_is_sealed_then_swept_and_read_once_throughout(
    db: Database, tmp_path: Path, how: str
) -> None:
    root = tmp_path / "warehouse"
    for hour in (3, 10, 22):
        minutes(db, hour)
    clock = Clock(T0 + 12 * 3600)  # the day still open
    ex = exporter(tmp_path, clock)
    q = WarehouseQueueRepo(db)
    assert ex.flush(q)
    hourly = [f"{ex.stem}~{h}.parquet" for h in ("03", "10", "22")]
    assert objects(root, "rank_minutes") == hourly
    assert count(root, how) == {"rank_minutes": 6, "job_minutes": 3}
    assert ex.status()["days_sealed"] == 0

    clock.now = NEXT
    assert ex.flush(q)  # nothing dirty: the seal alone starts the flush process
    # One table's day a flush: job_minutes first, rank_minutes still in hours, read once.
    assert objects(root, "job_minutes") == [f"{ex.stem}.parquet", *hourly]
    assert objects(root, "rank_minutes") == hourly
    assert count(root, how) == {"rank_minutes": 6, "job_minutes": 3}
    assert ex.flush(q)
    assert objects(root, "rank_minutes") == [f"{ex.stem}.parquet", *hourly]
    day = pq.read_table(root / "rank_minutes" / f"date={DAY}" / f"{ex.stem}.parquet")
    assert day.num_rows == 6
    assert count(root, how) == {"rank_minutes": 6, "job_minutes": 3}
    assert ex.status()["days_sealed"] == 2 and ex.status()["days_swept"] == 0

    # A row of the sealed day indexed late: the day object takes it, no hourly object.
    minutes(db, 23, ranks=1)
    assert ex.flush(q) and q.pending() == 0
    assert objects(root, "job_minutes") == [f"{ex.stem}.parquet", *hourly]
    assert count(root, how) == {"rank_minutes": 7, "job_minutes": 4}

    clock.now = NEXT + 3600  # sweep_after later: the hourly objects go
    assert ex.flush(q)
    assert objects(root, "rank_minutes") == objects(root, "job_minutes") == [f"{ex.stem}.parquet"]
    assert count(root, how) == {"rank_minutes": 7, "job_minutes": 4}
    assert ex.status()["days_swept"] == 2
    assert q.unswept(clock.now) == [] and q.unsealed_days() == []


def test_a_day_past_the_horizon_keeps_its_hourly_objects(db: Database, tmp_path: Path) -> None:
    minutes(db, 5)
    ex = exporter(tmp_path, Clock(T0 + 5 * 86400))
    q = WarehouseQueueRepo(db)
    assert ex.flush(q) and ex.flush(q)
    assert objects(tmp_path / "warehouse", "rank_minutes") == [f"{ex.stem}~05.parquet"]
    assert ex.status()["days_sealed"] == 0


def test_a_nodes_unflushed_rows_of_a_closed_day_stand_for_the_whole_day(
    db: Database, tmp_path: Path, how: str
) -> None:
    root, clock, ex, q = hour_written(db, tmp_path)
    minutes(db, 4)  # not flushed yet
    clock.now = NEXT
    wire = ex.overlays(q)
    assert sorted((o["table"], o["part"]) for o in wire) == [
        ("job_minutes", DAY), ("rank_minutes", DAY),
    ]  # fmt: skip
    overlays = overlays_from_reply(wire)
    # Before the seal (hourly objects only), and after it (the day object too): once each.
    assert count(root, how, overlays) == {"rank_minutes": 4, "job_minutes": 2}
    assert ex.flush(q) and q.pending() == 0
    assert f"{ex.stem}.parquet" in objects(root, "rank_minutes")
    assert count(root, how, overlays) == {"rank_minutes": 4, "job_minutes": 2}
    assert count(root, how) == {"rank_minutes": 4, "job_minutes": 2}


def test_an_hours_unflushed_rows_from_before_a_seal_are_refused_as_stale(
    db: Database, tmp_path: Path, how: str
) -> None:
    root, clock, ex, q = hour_written(db, tmp_path)
    minutes(db, 4)
    clock.now = NEXT - 3000  # the day closed, not yet sealable: its hour is sent as it is
    old = overlays_from_reply(ex.overlays(q))
    assert sorted(o.part for o in old) == [f"{DAY}/04", f"{DAY}/04"]
    clock.now = NEXT
    assert ex.flush(q) and ex.flush(q) and ex.status()["days_sealed"] == 2  # the seals land
    with pytest.raises(R.StaleOverlay, match=r"sealed \w+_minutes of 2026-03-04 meanwhile"):
        count(root, how, old)
    assert count(root, how, overlays_from_reply(ex.overlays(q))) == {
        "rank_minutes": 4, "job_minutes": 2,
    }  # fmt: skip


def between_listing_and_read(
    monkeypatch: pytest.MonkeyPatch, first: Callable[[], None]
) -> list[str]:
    """``R.run_sql`` with ``first`` run just before its first call (what lands between a
    query's listing and its read); what each call gave: its ``n``, or its error."""
    real = R.run_sql
    calls: list[str] = []

    def run(con: Any, sql: str, params: Any = None) -> Any:
        if not calls:
            first()
        try:
            res = real(con, sql, params)
        except R.WarehouseError as exc:
            calls.append(str(exc))
            raise
        calls.append(str(res.to_pylist()[0]["n"]))
        return res

    monkeypatch.setattr(R, "run_sql", run)
    return calls


def test_a_seal_between_the_listing_and_the_query_changes_nothing_it_reads(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The query reads the objects its own listing named, never a directory again: a seal
    landing between the listing and the query (the day object beside the hourly objects the
    listing read) is read by the next query, and this one counts each row once."""
    root, clock, ex, q = hour_written(db, tmp_path)
    clock.now = NEXT

    def seal() -> None:
        assert ex.flush(q) and ex.flush(q) and ex.status()["days_sealed"] == 2

    calls = between_listing_and_read(monkeypatch, seal)
    sql = "SELECT count(*) AS n FROM rank_minutes"
    res = R.query(R.locate(str(root)), HOURS, [], sql)
    assert calls == ["2"] and res.to_pylist() == [{"n": 2}]  # the hours, listed before the seal
    assert R.query(R.locate(str(root)), HOURS, [], sql).to_pylist() == [{"n": 2}]  # the day
    assert calls == ["2", "2"]


def test_objects_deleted_between_the_listing_and_the_read_make_the_query_list_again(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seal and its sweep both land between the listing and the read: the hours listed
    are gone, the read fails, and the query lists again and reads the day object."""
    root, clock, ex, q = hour_written(db, tmp_path)
    clock.now = NEXT

    def seal_and_sweep() -> None:
        assert ex.flush(q) and ex.flush(q) and ex.status()["days_sealed"] == 2
        clock.now += 3600
        assert ex.flush(q) and ex.status()["days_swept"] == 2

    calls = between_listing_and_read(monkeypatch, seal_and_sweep)
    res = R.query(R.locate(str(root)), HOURS, [], "SELECT count(*) AS n FROM rank_minutes")
    assert len(calls) == 2 and "No files found" in calls[0] and calls[1] == "2"
    assert res.to_pylist() == [{"n": 2}]
