"""Fleet objects: many writers' closed day of a table merged into one object, each row read
exactly once before, during and after the merge and each writer's hand-over, through
DuckDB's reader (local disk), pyarrow's (what S3 uses) and Polars (a second engine)."""

from __future__ import annotations

import dataclasses
import functools
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3fixtures import BUCKET, REGION, MotoServer, credentials_env, moto_server  # noqa: F401
from test_warehouse_seal import (  # noqa: F401  (db: the fixture)
    Clock,
    between_listing_and_read,
    db,
    minutes,
)

from profd.config import ConfigError, S3Config, load
from profd.store.index import Database, WarehouseQueueRepo
from profd.warehouse import merge as M
from profd.warehouse import reader as R
from profd.warehouse.arrow import SCHEMAS, Overlay, parquet_bytes
from profd.warehouse.export import Exporter
from profd.warehouse.seal import Merging
from profd.warehouse.sink import LocalSink, S3Sink
from profd.warehouse.tables import SOURCE, TABLES, fleet_key, object_key, plan

DAY = "2026-03-01"
#: An hour after DAY ended: its day objects and its last hour's are due (merge_after: an
#: hour), so its first writer may merge them, and only that one.
LATER = datetime(2026, 3, 2, 1, 0, tzinfo=UTC).timestamp()
A, B, C = "gpu-a~1", "gpu-b~2", "gpu-c~3"
FOLDER = f"w/job_minutes/date={DAY}"


def jm(n: int, node: str, ranks: int = 1) -> pa.Table:
    t = datetime(2026, 3, 1, 5, tzinfo=UTC)
    cols: dict[str, list[Any]] = {f.name: [None] * n for f in SCHEMAS["job_minutes"]}
    cols.update(job=["j"] * n, role=["r"] * n, minute=[t] * n, node=[node] * n)
    cols.update(ranks=[ranks] * n)
    return pa.table(cols, schema=SCHEMAS["job_minutes"])


def put(root: Path, part: str, stem: str, rows: pa.Table) -> None:
    LocalSink(root).put(object_key("job_minutes", part, stem), parquet_bytes(rows))


def names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "job_minutes" / f"date={DAY}").glob("*.parquet"))


def seen(root: Path, overlays: list[Overlay] | None = None) -> dict[str, int]:
    """Rows per node of DAY's job minutes, as each reader sees them; all three must agree."""
    sql = "SELECT node, count(*) AS n FROM job_minutes GROUP BY node ORDER BY node"
    loc = R.locate(str(root))
    got = []
    for native in (True, False):
        con = R.open_tables(loc, TABLES, overlays or [], native=native)
        got.append({r["node"]: r["n"] for r in R.run_sql(con, sql).to_pylist()})
    if not overlays:
        import warehouse_polars as WP

        df = WP.scan(str(root), "job_minutes").group_by("node").len().collect()
        got.append({r["node"]: r["len"] for r in df.to_dicts()})
    assert all(g == got[0] for g in got), got
    return got[0]


#: Who may merge DAY of the fixture below, in order: the day objects and C's hour 23 are due
#: at once (ties go by name, so A's day object is the oldest).
FIRST_TURN = M.turn([A, B, C], "job_minutes", DAY, A)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A closed day: A and B sealed it (day objects), C did not (hourly objects only)."""
    r = tmp_path / "wh"
    put(r, DAY, A, jm(5, "a"))
    put(r, DAY, B, jm(3, "b"))
    put(r, f"{DAY}/23", C, jm(2, "c"))
    return r


def test_the_chosen_fleet_object_and_the_sources_it_is_read_in_place_of() -> None:
    paths = [
        f"{FOLDER}/{A}.parquet",  # A's day object: none of A's rows in the fleet are read
        f"{FOLDER}/{C}~04.parquet",  # C's hour 04: its rows of that hour only
        f"{FOLDER}/~fleet~00000001.parquet",  # superseded by serial 2
        f"{FOLDER}/~fleet~00000002.parquet",
        "w/job_minutes/date=2026-03-02/~fleet~00000001.parquet",
    ]
    # D's unflushed rows of the whole (sealed) day, E's of its hour 06, stand for their objects.
    p = plan(paths, [(FOLDER, "gpu-d~4"), (FOLDER, "gpu-e~5~06")])
    assert p.skip == {f"{FOLDER}/~fleet~00000001.parquet"}
    day = {f"{w}~{h:02d}" for w in (A, "gpu-d~4") for h in range(24)} | {A, "gpu-d~4"}
    assert p.fleets == {
        f"{FOLDER}/~fleet~00000002.parquet": day | {f"{C}~04", "gpu-e~5~06"},
        "w/job_minutes/date=2026-03-02/~fleet~00000001.parquet": set(),
    }
    assert p.writers(paths) == [f"{FOLDER}/{A}.parquet", f"{FOLDER}/{C}~04.parquet"]


def test_a_writers_object_the_chosen_fleet_object_holds_is_not_read() -> None:
    """With the listing's tokens and the chosen fleet object's footer, an object whose very
    version the fleet object holds is skipped and its rows read from the fleet object; one
    written again since (another token) is read, and the fleet's rows of it left out."""
    fleet = f"{FOLDER}/~fleet~00000002.parquet"
    paths = {
        f"{FOLDER}/{A}.parquet": "a1",  # held as it is: read from the fleet object
        f"{FOLDER}/{B}.parquet": "b2",  # written again since the fleet object took b1
        f"{FOLDER}/{C}~04.parquet": "c1",  # never merged
        f"{FOLDER}/~fleet~00000001.parquet": "f1",
        fleet: "f2",
        "w/job_minutes/date=2026-03-02/~fleet~00000001.parquet": "f3",  # no writer's object
    }
    asked: list[str] = []

    def held(path: str) -> dict[str, str]:
        asked.append(path)
        return {A: "a1", B: "b1", f"{C}~03": "c0"}

    p = plan(paths, [], paths, held)
    assert asked == [fleet]  # only a date with writers' objects: its footer is read
    assert p.skip == {f"{FOLDER}/~fleet~00000001.parquet", f"{FOLDER}/{A}.parquet"}
    b_day = {B, *(f"{B}~{h:02d}" for h in range(24))}
    assert p.fleets[fleet] == b_day | {f"{C}~04"}
    assert p.writers(paths) == [f"{FOLDER}/{B}.parquet", f"{FOLDER}/{C}~04.parquet"]
    # A node's unflushed rows of A's day still stand for A's rows in the fleet object.
    p = plan(paths, [(FOLDER, A)], paths, held)
    assert f"{FOLDER}/{A}.parquet" in p.skip and A in p.fleets[fleet]


def test_each_merge_of_a_date_falls_to_a_node_of_its_own_turn() -> None:
    """The order of a date's mergers turns with the table, date and hour of the oldest
    object due, the same on every node: over a day's hours of 64 nodes' tables the first
    merger is spread over many nodes, not the first by name each time."""
    writers = sorted(f"gpu-{i:03d}~{i}" for i in range(64))
    firsts = [
        M.turn(writers, t, DAY, f"{writers[0]}~{h:02d}")[0]
        for t in ("job_minutes", "rank_minutes")
        for h in range(24)
    ]
    assert len(set(firsts)) >= 24  # 48 draws among 64: about 34 distinct; by name, 1
    order = M.turn(writers, "job_minutes", DAY, writers[5])  # a day object: "day"
    assert sorted(order) == writers and order == M.turn(writers, "job_minutes", DAY, writers[9])
    assert M.turn([A], "incidents", DAY, A) == [A]


def test_who_may_merge_grows_with_the_delay() -> None:
    m = Merging(merge_after=3600.0)
    end = datetime(2026, 3, 2, tzinfo=UTC).timestamp()
    assert m.due_at(DAY) == end + 3600  # a day object: an hour after its date ends
    assert m.due_at(DAY, 4) == datetime(2026, 3, 1, 6, tzinfo=UTC).timestamp()  # hour 04
    assert m.mergers(end + 3600, end + 60) == 0  # not due yet
    assert m.mergers(end + 3600, end + 3600) == 1  # its first writer
    assert m.mergers(end + 3600, end + 3 * 3600 + 1) == 3  # two hours more: the next two too
    assert m.cutoff(end + 3600) == "2026-03-02"


def test_a_merge_then_each_writers_hand_over_read_once_throughout(root: Path) -> None:
    sink, m = LocalSink(root), Merging(merge_after=3600.0, grace=3600.0)
    truth = {"a": 5, "b": 3, "c": 2}
    assert seen(root) == truth
    # Only the first writer of the turn merges at once; the others wait.
    first, *others = FIRST_TURN
    for w in others:
        assert M.step(sink, "job_minutes", DAY, w, m, LATER) == "waiting"
    assert M.step(sink, "job_minutes", DAY, first, m, LATER) == "merged"
    assert names(root) == [
        f"{A}.parquet",
        f"{B}.parquet",
        f"{C}~23.parquet",
        "~fleet~00000001.parquet",
    ]
    fleet = pq.read_table(root / fleet_key("job_minutes", DAY, 1))
    # C never sealed the day: its hour went in as that hour.
    assert sorted(fleet[SOURCE].to_pylist()) == [A] * 5 + [B] * 3 + [f"{C}~23"] * 2
    assert seen(root) == truth  # the writers' own objects still count, the fleet's copy not
    # Inside the grace period nobody hands over; nothing new to merge either.
    assert M.step(sink, "job_minutes", DAY, A, m, LATER + 60) == "waiting"
    assert M.step(sink, "job_minutes", DAY, B, m, LATER + 60) == "waiting"
    assert M.step(sink, "job_minutes", DAY, B, m, LATER + 3700) == "handed"
    assert names(root) == [
        f"{A}.parquet",
        f"{C}~23.parquet",
        "~fleet~00000001.parquet",
    ]
    assert seen(root) == truth  # B's rows now from the fleet
    assert M.step(sink, "job_minutes", DAY, C, m, LATER + 3700) == "hours"
    assert M.step(sink, "job_minutes", DAY, A, m, LATER + 3700) == "handed"
    assert seen(root) == truth
    assert M.step(sink, "job_minutes", DAY, A, m, LATER + 3800) == "gone"

    # B changes its merged day (a row indexed late): its new day object takes over at once.
    put(root, DAY, B, jm(4, "b"))
    truth["b"] = 4
    assert seen(root) == truth
    # B is now the only writer with an object there: it merges, then hands over.
    assert M.step(sink, "job_minutes", DAY, B, m, LATER + 7200) == "merged"
    assert names(root)[-2:] == ["~fleet~00000001.parquet", "~fleet~00000002.parquet"]
    assert seen(root) == truth
    assert M.step(sink, "job_minutes", DAY, B, m, LATER + 7200 + 3601) == "handed"
    assert names(root) == ["~fleet~00000002.parquet"]  # serial 1 gone too
    assert seen(root) == truth
    # A node's unflushed rows of the day stand for its rows in the fleet object.
    over = [Overlay("job_minutes", DAY, A, jm(6, "a"))]
    assert seen(root, over) == {**truth, "a": 6}


def test_an_open_days_hours_are_merged_hour_by_hour_then_its_day_replaces_them(
    tmp_path: Path,
) -> None:
    """Hours go into a fleet object while their day goes on; each writer hands its hours
    over; an hour written again, the writer's day object, a node's unflushed hour each take
    over exactly their own rows."""
    root = tmp_path / "wh"
    sink, m = LocalSink(root), Merging(merge_after=3600.0, grace=600.0)
    put(root, f"{DAY}/03", A, jm(1, "a"))
    put(root, f"{DAY}/04", A, jm(2, "a"))
    put(root, f"{DAY}/05", A, jm(4, "a"))  # not due at 06:30: ends 06:00, merged from 07:00
    put(root, f"{DAY}/03", B, jm(8, "b"))
    at = datetime(2026, 3, 1, 6, 30, tzinfo=UTC).timestamp()
    truth = {"a": 7, "b": 8}
    assert M.step(sink, "job_minutes", DAY, A, m, at) == "merged"
    fleet = pq.read_table(root / fleet_key("job_minutes", DAY, 1))
    assert sorted(fleet[SOURCE].to_pylist()) == [f"{A}~03", f"{A}~04", f"{A}~04"] + [f"{B}~03"] * 8
    assert seen(root) == truth
    assert M.step(sink, "job_minutes", DAY, A, m, at + 660) == "hours"
    assert names(root) == [f"{A}~05.parquet", f"{B}~03.parquet", "~fleet~00000001.parquet"]
    assert seen(root) == truth  # A's hours 03 and 04 from the fleet, 05 its own
    # A's unflushed rows of hour 05 stand for that hour alone, not for A's merged hours.
    over = [Overlay("job_minutes", f"{DAY}/05", A, jm(5, "a"))]
    assert seen(root, over) == {"a": 8, "b": 8}
    # A late row of hour 03: A writes the hour again, which takes over its rows at once.
    put(root, f"{DAY}/03", A, jm(3, "a"))
    truth["a"] = 9
    assert seen(root) == truth
    # The next merge takes it, and hour 05, and keeps B's hour as it was.
    assert M.step(sink, "job_minutes", DAY, A, m, at + 3600) == "merged"
    fleet = pq.read_table(root / fleet_key("job_minutes", DAY, 2))
    assert fleet[SOURCE].to_pylist().count(f"{B}~03") == 8
    assert fleet[SOURCE].to_pylist().count(f"{A}~03") == 3
    assert seen(root) == truth
    # A seals the day: its day object stands for all of A's hours, merged or not.
    put(root, DAY, A, jm(9, "a"))
    assert seen(root) == truth
    # Its hourly objects are superseded now: never merged nor handed over, but swept.
    assert M.step(sink, "job_minutes", DAY, A, m, at + 3600 + 660) == "waiting"
    sink.delete_hours("job_minutes", DAY, A)
    assert seen(root) == truth
    # A day after: B hands its hour over, then A's day object goes in, in place of every
    # hour of A's (A the date's only writer now).
    later = datetime(2026, 3, 2, 1, 0, tzinfo=UTC).timestamp()
    assert M.step(sink, "job_minutes", DAY, B, m, later) == "hours"
    assert seen(root) == truth
    assert M.step(sink, "job_minutes", DAY, A, m, later) == "merged"
    fleet = pq.read_table(root / fleet_key("job_minutes", DAY, 3))
    assert sorted(set(fleet[SOURCE].to_pylist())) == [A, f"{B}~03"]
    assert seen(root) == truth
    assert M.step(sink, "job_minutes", DAY, A, m, later + 660) == "handed"
    assert names(root) == ["~fleet~00000003.parquet"]
    assert seen(root) == truth


@pytest.mark.parametrize("native", [True, False], ids=["duckdb", "pyarrow"])
def test_a_hand_over_between_the_listing_and_the_read_is_read_once_without_a_retry(
    root: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """A query that listed a writer's object the chosen fleet object already holds reads
    those rows from the fleet object: the writer deleting its object (its hand-over) before
    the read takes nothing from the query, which runs once."""
    sink, m = LocalSink(root), Merging(merge_after=3600.0, grace=3600.0)
    assert M.step(sink, "job_minutes", DAY, FIRST_TURN[0], m, LATER) == "merged"
    assert len(names(root)) == 4  # every writer's object inside its grace period
    monkeypatch.setattr(R, "open_tables", functools.partial(R.open_tables, native=native))

    def hand_over() -> None:
        for w, what in ((A, "handed"), (B, "handed"), (C, "hours")):
            assert M.step(sink, "job_minutes", DAY, w, m, LATER + 3700) == what
        assert names(root) == ["~fleet~00000001.parquet"]

    calls = between_listing_and_read(monkeypatch, hand_over)
    res = R.query(R.locate(str(root)), ["job_minutes"], [], "SELECT count(*) AS n FROM job_minutes")
    assert res.to_pylist() == [{"n": 10}] and calls == ["10"]


def in_s3(
    root: Path,
    moto_server: MotoServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[str, S3Sink]:
    """``root``'s objects copied to the S3 server, and the warehouse's URL and sink there."""
    for k, v in credentials_env(moto_server.root).items():
        monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/w"
    sink = S3Sink(url, S3Config(url, moto_server.endpoint, REGION, "path"))
    for path in sorted(root.rglob("*.parquet")):
        sink.put(str(path.relative_to(root)), path.read_bytes())
    return url, sink


def test_from_s3_a_hand_over_between_the_listing_and_the_read_is_read_once_too(
    root: Path,
    moto_server: MotoServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same from a real S3 server: the reader lists with ETags (what the merging writer
    recorded), reads the fleet object's footer, and so skips the objects a hand-over may
    delete."""
    url, sink = in_s3(root, moto_server, monkeypatch)
    m = Merging(merge_after=3600.0, grace=3600.0)
    assert M.step(sink, "job_minutes", DAY, FIRST_TURN[0], m, LATER) == "merged"

    def hand_over() -> None:
        for w, what in ((A, "handed"), (B, "handed"), (C, "hours")):
            assert M.step(sink, "job_minutes", DAY, w, m, LATER + 3700) == what
        assert list(moto_server.objects("w/")) == [f"w/{fleet_key('job_minutes', DAY, 1)}"]

    calls = between_listing_and_read(monkeypatch, hand_over)
    loc = R.locate(url, R.S3Settings(moto_server.endpoint, REGION))
    sql = "SELECT node, count(*) AS n FROM job_minutes GROUP BY node ORDER BY node"
    res = R.query(loc, ["job_minutes"], [], sql)
    assert res.to_pylist() == [{"node": "a", "n": 5}, {"node": "b", "n": 3}, {"node": "c", "n": 2}]
    assert calls == ["5"]  # one run: nothing it read was deleted


def test_two_writers_racing_for_one_serial_cannot_both_win(root: Path) -> None:
    sink = LocalSink(root)
    todo = {s: o for n, o in sink.folder("job_minutes", DAY).items() if (s := n[:-8]) in (A, B)}
    assert M.merge(sink, "job_minutes", DAY, 1, ("", M.NO_FLEET), todo, LATER)
    assert not M.merge(sink, "job_minutes", DAY, 1, ("", M.NO_FLEET), {A: todo[A]}, LATER)
    assert pq.read_table(root / fleet_key("job_minutes", DAY, 1)).num_rows == 8
    assert seen(root) == {"a": 5, "b": 3, "c": 2}


# --- through the export, as the daemon runs it -------------------------------------------
def count(root: Path) -> int:
    con = R.open_tables(R.locate(str(root)), TABLES)
    return int(R.run_sql(con, "SELECT count(*) AS n FROM rank_minutes").to_pylist()[0]["n"])


def fleets(folder: str) -> list[str]:
    return sorted(p.name for p in Path(folder).glob("~fleet~*.parquet"))


def test_the_export_merges_hours_then_the_closed_day_and_hands_its_own_objects_over(
    db: Database,  # noqa: F811
    tmp_path: Path,
) -> None:
    root = tmp_path / "warehouse"
    cfg = load(env={"PROFD_STATE_DIR": str(tmp_path)})
    cfg = dataclasses.replace(cfg, node_name="node-a")
    clock = Clock(datetime(2026, 3, 4, 10, 30, tzinfo=UTC).timestamp())
    ex = Exporter(cfg, clock=clock)
    q = WarehouseQueueRepo(db)
    day = f"{root}/rank_minutes/date=2026-03-04"
    minutes(db, 3)
    # The open day's hour 03 ended long enough ago: written, then merged by the next look.
    assert ex.flush(q)
    assert fleets(day) == []
    assert ex.flush(q)
    assert fleets(day) == ["~fleet~00000001.parquet"]
    assert (Path(day) / f"{ex.stem}~03.parquet").exists()  # inside the grace period
    assert count(root) == 2
    clock.now += 3700  # past it: the next look at the hours (every open day) hands 03 over
    assert ex.flush(q)
    assert sorted(p.name for p in Path(day).glob("*.parquet")) == ["~fleet~00000001.parquet"]
    assert count(root) == 2
    assert ex.status()["hour_hand_overs"] >= 1

    # Sealed, one table a flush, and the day objects merged: the day is due since 01:00.
    clock.now = datetime(2026, 3, 5, 1, 30, tzinfo=UTC).timestamp()
    while q.unsealed_days():
        assert ex.flush(q)
    assert sorted(p.name for p in Path(day).glob("*.parquet"))[0] == f"{ex.stem}.parquet"
    assert count(root) == 2
    for _ in range(8):  # at most DAYS_PER_FLUSH of the six tables' days a flush
        assert ex.flush(q)
        ex._merge_check_at = 0.0  # what ten minutes would do
    assert ex.status()["fleet_objects_written"] >= 4  # rank_minutes and job_minutes, twice
    assert fleets(day) == ["~fleet~00000001.parquet", "~fleet~00000002.parquet"]
    assert (Path(day) / f"{ex.stem}.parquet").exists()  # inside the grace period
    assert count(root) == 2

    clock.now += 3700  # past the grace period: the node's own objects go
    for _ in range(8):
        assert ex.flush(q)
        ex._merge_check_at = 0.0
    assert sorted(p.name for p in Path(day).glob("*.parquet")) == ["~fleet~00000002.parquet"]
    assert q.unmerged("2026-03-06") == []
    assert count(root) == 2
    assert ex.status()["days_handed_to_fleet"] >= 2

    # A row of that day indexed late: the node writes its day object again, which takes over.
    minutes(db, 23, ranks=1)
    assert ex.flush(q)
    assert (Path(day) / f"{ex.stem}.parquet").exists()
    assert count(root) == 3
    assert q.unmerged("2026-03-06") == [
        ("job_minutes", "2026-03-04"),
        ("rank_minutes", "2026-03-04"),
    ]


def test_merge_after_has_a_floor(tmp_path: Path) -> None:
    conf = tmp_path / "profd.toml"
    conf.write_text("[warehouse]\nmerge_after = 10\n")
    with pytest.raises(ConfigError, match=r"warehouse.merge_after: must be a number >= 600"):
        load(conf, env={"PROFD_STATE_DIR": str(tmp_path)})
    conf.write_text("[warehouse]\nmerge = false\n")
    assert not load(conf, env={"PROFD_STATE_DIR": str(tmp_path)}).warehouse.merge


@pytest.mark.parametrize(
    ("before", "after", "runs"),
    [(5, 300, 2), (300, 5, 2), (5, 9, 1)],
    ids=["grown", "shrunk", "as-large"],
)
def test_from_s3_a_day_object_rewritten_between_the_listing_and_the_read_is_read_anew(
    before: int,
    after: int,
    runs: int,
    root: Path,
    moto_server: MotoServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sealed day object taking late rows is rewritten in place, under its key, while a
    query that listed the old one runs. The query reads it at the listed size (which saves
    a HEAD request an object): an object grown or shrunk since has no footer where the read
    looks, so the query lists and runs again; one as large as before (5 and 9 equal rows
    encode to the same bytes but one) reads at once. Either way the new object's rows come
    back, each once."""
    put(root, DAY, A, jm(before, "a"))
    url, sink = in_s3(root, moto_server, monkeypatch)
    late = parquet_bytes(jm(after, "a"))
    listed = R.s3_client(R.S3Settings(moto_server.endpoint, REGION)).head_object(
        Bucket=BUCKET, Key=f"w/{object_key('job_minutes', DAY, A)}"
    )["ContentLength"]
    assert (len(late) == listed) == (runs == 1), (len(late), listed)

    def late_rows() -> None:
        sink.put(object_key("job_minutes", DAY, A), late)

    calls = between_listing_and_read(monkeypatch, late_rows)
    loc = R.locate(url, R.S3Settings(moto_server.endpoint, REGION))
    sql = "SELECT node, count(*) AS n FROM job_minutes GROUP BY node ORDER BY node"
    res = R.query(loc, ["job_minutes"], [], sql)
    assert res.to_pylist() == [
        {"node": "a", "n": after},
        {"node": "b", "n": 3},
        {"node": "c", "n": 2},
    ]
    assert len(calls) == runs, calls
    # Where the read at the old size lands decides which error it is.
    gone = ("Parquet magic bytes not found", "Couldn't deserialize thrift")
    assert all(any(g in c for g in gone) for c in calls[:-1]), calls
