"""The index's schema over time: a real SQLite file written with each earlier schema (the
CREATE statements as profd wrote them then, from the history of the index module), a row or
two in it, opened by this profd: the rows are still there and the file has this schema. A
file of a newer schema is refused in one line, and a failed step changes nothing."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from profd.store.index import (
    SCHEMA_VERSION,
    Database,
    FileRepo,
    InboxRepo,
    IncidentRepo,
    IndexSchemaError,
    SessionRepo,
    StepMinuteRepo,
    TraceFilter,
    TraceRepo,
    WarehouseQueueRepo,
)
from profd.store.index import schema as S

# --- the tables as earlier profd versions created them ----------------------------------------
SESSIONS_1 = """CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, job TEXT NOT NULL, state TEXT NOT NULL, backend TEXT NOT NULL,
    label TEXT, region TEXT, request TEXT NOT NULL, cycles TEXT NOT NULL, error TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL
);"""
SESSIONS_2 = SESSIONS_1.replace(
    "cycles TEXT NOT NULL,", "cycles TEXT NOT NULL, plan INTEGER NOT NULL DEFAULT 0,"
)
# Schema 2 as later written, before the version moved on: the owner column too.
SESSIONS_3 = SESSIONS_2.replace("DEFAULT 0,", "DEFAULT 0, owner INTEGER,")
TARGETS_1 = """CREATE TABLE IF NOT EXISTS targets (
    session TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, job TEXT NOT NULL,
    role TEXT NOT NULL, rank INTEGER NOT NULL, world_size INTEGER NOT NULL,
    state TEXT NOT NULL, error TEXT, traces INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL, PRIMARY KEY (session, host, pid)
);"""
TARGETS_3 = TARGETS_1.replace(
    "DEFAULT 0,\n", "DEFAULT 0, final TEXT, results TEXT NOT NULL DEFAULT '[]',\n"
)
TARGETS_5 = TARGETS_3.replace("updated_at REAL NOT NULL,", "updated_at REAL NOT NULL, stem TEXT,")
TRACES_1 = """CREATE TABLE IF NOT EXISTS traces (
    id INTEGER PRIMARY KEY, session TEXT NOT NULL, job TEXT NOT NULL, host TEXT NOT NULL,
    pid INTEGER NOT NULL, role TEXT NOT NULL, rank INTEGER NOT NULL, cycle INTEGER NOT NULL,
    region TEXT, steps TEXT NOT NULL, path TEXT NOT NULL, bytes INTEGER NOT NULL,
    state TEXT NOT NULL, stall_ms REAL, step_ms_p50 REAL, step_ms_max REAL, torch TEXT,
    device TEXT, created_at REAL NOT NULL, UNIQUE (session, host, pid, cycle)
);"""
TRACES_4 = TRACES_1.replace("created_at REAL NOT NULL,", "created_at REAL NOT NULL, stats TEXT,")
FILES_1 = """CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY, session TEXT NOT NULL, job TEXT NOT NULL, trace_id INTEGER,
    kind TEXT NOT NULL, path TEXT NOT NULL UNIQUE, rel TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at REAL NOT NULL, upload_state TEXT NOT NULL, s3_uri TEXT,
    attempts INTEGER NOT NULL DEFAULT 0, next_attempt_at REAL NOT NULL DEFAULT 0,
    last_error TEXT, uploaded_at REAL, deleted INTEGER NOT NULL DEFAULT 0
);"""
INBOX_1 = """CREATE TABLE IF NOT EXISTS inbox (
    key TEXT PRIMARY KEY, message TEXT NOT NULL, received_at REAL NOT NULL,
    done INTEGER NOT NULL DEFAULT 0
);"""
STEP_MINUTES_6 = """CREATE TABLE IF NOT EXISTS step_minutes (
    job TEXT NOT NULL, host TEXT NOT NULL, role TEXT NOT NULL, rank INTEGER NOT NULL,
    pid INTEGER NOT NULL, minute INTEGER NOT NULL, steps INTEGER NOT NULL, sum_s REAL NOT NULL,
    p50_ms REAL, p90_ms REAL, max_ms REAL, regions TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS step_minutes_job ON step_minutes(job, minute);
CREATE INDEX IF NOT EXISTS step_minutes_minute ON step_minutes(minute);"""
INDEXES_1 = """
CREATE INDEX IF NOT EXISTS sessions_job ON sessions(job, created_at);
CREATE INDEX IF NOT EXISTS sessions_state ON sessions(state, created_at);
CREATE INDEX IF NOT EXISTS traces_job ON traces(job, created_at);
CREATE INDEX IF NOT EXISTS traces_session ON traces(session, rank);
CREATE INDEX IF NOT EXISTS traces_rank ON traces(rank, created_at);
CREATE INDEX IF NOT EXISTS traces_created ON traces(created_at);
CREATE INDEX IF NOT EXISTS files_trace ON files(trace_id);
CREATE INDEX IF NOT EXISTS files_session ON files(session);
CREATE INDEX IF NOT EXISTS files_queue ON files(upload_state, next_attempt_at);"""
TRACES_PATH_5 = "CREATE INDEX IF NOT EXISTS traces_path ON traces(path);"
INCIDENTS_7 = """CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY, kind TEXT NOT NULL, job TEXT NOT NULL, state TEXT NOT NULL,
    detected_at REAL NOT NULL, updated_at REAL NOT NULL, doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS incidents_detected ON incidents(detected_at);
CREATE INDEX IF NOT EXISTS incidents_job ON incidents(job, detected_at);
CREATE INDEX IF NOT EXISTS incidents_state ON incidents(state);"""

# Schema 8's export queue and its triggers, as this profd still writes them.
WAREHOUSE_QUEUE_8 = S.WAREHOUSE_QUEUE

# Schema 9's days of the hourly tables, before the fleet objects (schema 10: merged_at).
WAREHOUSE_DAYS_9 = """
CREATE TABLE IF NOT EXISTS warehouse_days (
    tbl TEXT NOT NULL,
    date TEXT NOT NULL,
    sealed_at REAL,
    swept_at REAL,
    PRIMARY KEY (tbl, date)
) WITHOUT ROWID;"""

#: (the version it stores, its tables): every schema an earlier profd wrote.
OLDER = {
    "1": (1, [SESSIONS_1, TARGETS_1, TRACES_1, FILES_1, INBOX_1, INDEXES_1]),
    "2": (2, [SESSIONS_2, TARGETS_1, TRACES_1, FILES_1, INBOX_1, INDEXES_1]),
    "2-owner": (2, [SESSIONS_3, TARGETS_1, TRACES_1, FILES_1, INBOX_1, INDEXES_1]),
    "3": (3, [SESSIONS_3, TARGETS_3, TRACES_1, FILES_1, INBOX_1, INDEXES_1]),
    "4": (4, [SESSIONS_3, TARGETS_3, TRACES_4, FILES_1, INBOX_1, INDEXES_1]),
    "5": (5, [SESSIONS_3, TARGETS_5, TRACES_4, FILES_1, INBOX_1, INDEXES_1, TRACES_PATH_5]),
    "6": (6, [SESSIONS_3, TARGETS_5, TRACES_4, FILES_1, INBOX_1, INDEXES_1, TRACES_PATH_5,
              STEP_MINUTES_6]),
    "7": (7, [SESSIONS_3, TARGETS_5, TRACES_4, FILES_1, INBOX_1, INDEXES_1, TRACES_PATH_5,
              STEP_MINUTES_6, INCIDENTS_7]),
    "8": (8, [SESSIONS_3, TARGETS_5, TRACES_4, FILES_1, INBOX_1, INDEXES_1, TRACES_PATH_5,
              STEP_MINUTES_6, INCIDENTS_7, WAREHOUSE_QUEUE_8]),
    "9": (9, [SESSIONS_3, TARGETS_5, TRACES_4, FILES_1, INBOX_1, INDEXES_1, TRACES_PATH_5,
              STEP_MINUTES_6, INCIDENTS_7, WAREHOUSE_QUEUE_8, WAREHOUSE_DAYS_9]),
}  # fmt: skip


def write_old(path: Path, version: int, tables: list[str]) -> None:
    """An index as that profd left it, with one session, target, trace, file and report."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);\n")
        db.executescript("\n".join(tables))
        db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(version),))
        db.execute(
            "INSERT INTO sessions (id, job, state, backend, label, region, request, cycles,"
            " error, created_at, updated_at) VALUES ('s1', 'j', 'done', 'torch', 'lbl', NULL,"
            " '{\"steps\": \"5:6\"}', '[[5, 5, 6]]', NULL, 1.0, 2.0)"
        )
        db.execute(
            "INSERT INTO targets (session, host, pid, job, role, rank, world_size, state,"
            " error, traces, updated_at) VALUES ('s1', 'h', 7, 'j', 'trainer', 0, 1, 'done',"
            " NULL, 1, 2.0)"
        )
        db.execute(
            "INSERT INTO traces (id, session, job, host, pid, role, rank, cycle, region, steps,"
            " path, bytes, state, created_at) VALUES (1, 's1', 'j', 'h', 7, 'trainer', 0, 0,"
            " NULL, '[5]', '/spool/t.gz', 9, 'done', 1.5)"
        )
        db.execute(
            "INSERT INTO files (session, job, trace_id, kind, path, rel, bytes, created_at,"
            " upload_state) VALUES ('s1', 'j', 1, 'trace', '/spool/t.gz', 'j/t.gz', 9, 1.5,"
            " 'uploaded')"
        )
        db.execute("INSERT INTO inbox (key, message, received_at) VALUES ('k1', '{}', 1.0)")
        if version >= 7:
            db.execute(
                "INSERT INTO incidents (id, kind, job, state, detected_at, updated_at, doc)"
                " VALUES ('i0', 'hang', 'j', 'open', 90000.0, 90000.0, '{}')"
            )
        if version >= 6:
            db.execute(
                "INSERT INTO step_minutes (job, host, role, rank, pid, minute, steps, sum_s,"
                " p50_ms, p90_ms, max_ms) VALUES ('j', 'h', 'trainer', 0, 7, 600, 10, 1.0,"
                " 100.0, 120.0, 150.0)"
            )
        db.commit()


def shape(path: Path) -> dict[str, set[str]]:
    """Every table's columns and every index's name: what a schema is, its comments aside."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        names = db.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
        out: dict[str, set[str]] = {"indexes": set()}
        for kind, name in names.fetchall():
            if kind == "index":
                out["indexes"].add(name)
            else:
                out[name] = {r[1] for r in db.execute(f"PRAGMA table_info({name})")}
        return out


def stored_version(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as db:
        row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return str(row[0])


@pytest.fixture(scope="module")
def current(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    path = tmp_path_factory.mktemp("fresh") / "index.db"
    Database(path).close()
    return shape(path)


@pytest.mark.parametrize("name", sorted(OLDER))
def test_an_index_of_each_earlier_schema_is_brought_up_to_date_with_its_rows(
    name: str, tmp_path: Path, current: dict[str, set[str]]
) -> None:
    version, tables = OLDER[name]
    path = tmp_path / "index.db"
    write_old(path, version, tables)
    assert shape(path) != current
    db = Database(path)
    try:
        assert shape(path) == current and stored_version(path) == str(SCHEMA_VERSION)
        s = SessionRepo(db).session("s1")
        assert s is not None
        assert (s["job"], s["state"], s["label"], s["request"], s["cycles"]) == (
            "j", "done", "lbl", {"steps": "5:6"}, [[5, 5, 6]],
        )  # fmt: skip
        assert (s["plan"], s["owner"]) == (0, None)
        (t,) = s["targets"]
        assert (t["pid"], t["traces"], t["final"], t["results"], t["stem"]) == (
            7, 1, None, [], None,
        )  # fmt: skip
        (tr,) = TraceRepo(db).traces(TraceFilter(session="s1"))
        assert (tr["path"], tr["steps"], tr["stats"], tr["upload_state"]) == (
            "/spool/t.gz", [5], None, "uploaded",
        )  # fmt: skip
        assert [f["path"] for f in tr["files"]] == ["/spool/t.gz"]
        assert InboxRepo(db).inbox_pending() == [("k1", {})]
        minutes, _ = StepMinuteRepo(db).step_history("j", 0, 10_000)
        assert [m["p50_ms"] for m in minutes] == ([100.0] if version >= 6 else [])
        # What this profd writes fits: the columns and tables the steps added.
        SessionRepo(db).save_session({**s, "owner": 1000, "plan": 1})
        IncidentRepo(db).save_incident(
            {"id": "i1", "kind": "slow_rank", "job": "j", "state": "open", "detected_at": 3.0}
        )
        assert FileRepo(db).spool_usage() == (9, 0)
        # What the index held before the export existed is marked for it, then what came.
        marks = {(m.table, m.part) for m in WarehouseQueueRepo(db).marks()}
        traces = {(t, "1970-01-01/00") for t in ("captures", "rank_steps", "operators")}
        minutes = {(t, "1970-01-01/00") for t in ("rank_minutes", "job_minutes")}
        incidents = {("incidents", "1970-01-01")}  # saved just above
        if version >= 7:
            incidents.add(("incidents", "1970-01-02"))  # i0, in the file before
        assert marks == traces | (minutes if version >= 6 else set()) | incidents
        # The days the export has written hourly objects of (or will), none sealed yet: an
        # index of schema 9 recorded them as it wrote (none here).
        repo = WarehouseQueueRepo(db)
        days = set(repo.unsealed_days())
        hourly = traces | (minutes if version >= 6 else set())
        assert days == ({(t, part[:10]) for t, part in hourly} if version < 9 else set())
        # A day sealed, then held by a fleet object (schema 10), then written again.
        repo.sealed("captures", "1970-01-01", 10.0)
        assert repo.unmerged("1970-01-02") == [("captures", "1970-01-01")]
        repo.merged("captures", "1970-01-01", 20.0)
        assert repo.unmerged("1970-01-02") == []
        repo.sealed("captures", "1970-01-01", 30.0)
        assert repo.unmerged("1970-01-02") == [("captures", "1970-01-01")]
    finally:
        db.close()
    db = Database(path)  # opened again: nothing left to do, nothing changes
    try:
        assert shape(path) == current
        assert SessionRepo(db).session("s1")["plan"] == 1  # type: ignore[index]
    finally:
        db.close()


def test_every_version_step_has_its_migration() -> None:
    assert sorted(S.MIGRATIONS) == list(range(1, SCHEMA_VERSION))
    assert {v for v, _ in OLDER.values()} == set(range(1, SCHEMA_VERSION))


def test_a_failed_step_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "index.db"
    write_old(path, *OLDER["2"])
    before = shape(path)

    def broken(conn: sqlite3.Connection) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    # Steps 2->3 ran inside the transaction before this one fails: they are undone too.
    monkeypatch.setitem(S.MIGRATIONS, 3, broken)
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        Database(path)
    assert shape(path) == before and stored_version(path) == "2"
    monkeypatch.undo()
    Database(path).close()
    assert stored_version(path) == str(SCHEMA_VERSION)


def test_an_index_of_a_newer_profd_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "index.db"
    Database(path).close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(99),))
        db.commit()
    before = shape(path)
    for readonly in (False, True):
        with pytest.raises(IndexSchemaError) as e:
            Database(path, readonly=readonly)
        msg = str(e.value)
        assert "\n" not in msg
        assert f"index schema 99, newer than this profd's {SCHEMA_VERSION}" in msg, msg
        assert str(path) in msg
    assert shape(path) == before and stored_version(path) == "99"
