"""The index's schema: the tables as this profd writes them, the version it stores, and one
migration for each step from an older version to the next.

The version is ``meta.schema_version`` (profd has stored it there since its first index). A
writable open applies the steps from the stored version on, in order, then creates what is
missing (tables, indexes) and stores this version, all in one transaction. Every step checks
before it alters: schema 2 was written both with and without ``sessions.owner``, and
schema 1 kept its version when later code had added columns.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

SCHEMA_VERSION = 10

#: Schema 6: one rank's steps per minute (the step ledger's closed minutes).
STEP_MINUTES = """
-- One rank's steps in one minute of wall time (the step ledger's closed minutes). Not
-- unique: a rank that re-attaches within a minute (a restarted daemon or process) closes
-- that minute twice; a read merges them.
CREATE TABLE IF NOT EXISTS step_minutes (
    job TEXT NOT NULL,
    host TEXT NOT NULL,
    role TEXT NOT NULL,
    rank INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    minute INTEGER NOT NULL,    -- unix time of the minute's start
    steps INTEGER NOT NULL,
    sum_s REAL NOT NULL,
    p50_ms REAL,
    p90_ms REAL,
    max_ms REAL,
    regions TEXT NOT NULL DEFAULT '{}'  -- json: seconds inside each region in the minute
);
CREATE INDEX IF NOT EXISTS step_minutes_job ON step_minutes(job, minute);
CREATE INDEX IF NOT EXISTS step_minutes_minute ON step_minutes(minute);
"""

#: Schema 7: what the detectors noticed.
INCIDENTS = """
-- What the detectors noticed (profd.watch.incident_record.Incident); the record itself as json.
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    job TEXT NOT NULL,
    state TEXT NOT NULL,        -- open | resolved
    detected_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    doc TEXT NOT NULL           -- json: Incident.to_dict()
);
CREATE INDEX IF NOT EXISTS incidents_detected ON incidents(detected_at);
CREATE INDEX IF NOT EXISTS incidents_job ON incidents(job, detected_at);
CREATE INDEX IF NOT EXISTS incidents_state ON incidents(state);
"""

#: Schema 8: what the warehouse export has still to write. Each mark is made by a trigger in
#: the transaction that writes its row, so no row is ever indexed without its partition
#: marked, whatever kills the daemon. ``gen`` grows each time a partition is marked again:
#: the exporter removes a mark only if ``gen`` is what it was when it read the rows.
WAREHOUSE_QUEUE = """
-- Partitions of the warehouse (profd/warehouse/tables.py) whose objects are older than
-- their rows here: part is YYYY-MM-DD/HH (UTC), or YYYY-MM-DD for incidents.
CREATE TABLE IF NOT EXISTS warehouse_dirty (
    tbl TEXT NOT NULL,
    part TEXT NOT NULL,
    gen INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (tbl, part)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS warehouse_traces_insert AFTER INSERT ON traces BEGIN
    INSERT INTO warehouse_dirty (tbl, part) VALUES
        ('captures', strftime('%Y-%m-%d/%H', NEW.created_at, 'unixepoch')),
        ('rank_steps', strftime('%Y-%m-%d/%H', NEW.created_at, 'unixepoch')),
        ('operators', strftime('%Y-%m-%d/%H', NEW.created_at, 'unixepoch'))
    ON CONFLICT (tbl, part) DO UPDATE SET gen = gen + 1;
END;
CREATE TRIGGER IF NOT EXISTS warehouse_traces_update AFTER UPDATE ON traces BEGIN
    INSERT INTO warehouse_dirty (tbl, part) VALUES
        ('captures', strftime('%Y-%m-%d/%H', NEW.created_at, 'unixepoch')),
        ('rank_steps', strftime('%Y-%m-%d/%H', NEW.created_at, 'unixepoch')),
        ('operators', strftime('%Y-%m-%d/%H', NEW.created_at, 'unixepoch')),
        ('captures', strftime('%Y-%m-%d/%H', OLD.created_at, 'unixepoch')),
        ('rank_steps', strftime('%Y-%m-%d/%H', OLD.created_at, 'unixepoch')),
        ('operators', strftime('%Y-%m-%d/%H', OLD.created_at, 'unixepoch'))
    ON CONFLICT (tbl, part) DO UPDATE SET gen = gen + 1;
END;
-- A capture's trace_key becomes its S3 uri once the trace is uploaded.
CREATE TRIGGER IF NOT EXISTS warehouse_trace_uploaded AFTER UPDATE OF s3_uri ON files
WHEN NEW.kind = 'trace' AND NEW.trace_id IS NOT NULL
    AND NEW.s3_uri IS NOT OLD.s3_uri BEGIN
    INSERT INTO warehouse_dirty (tbl, part)
        SELECT 'captures', strftime('%Y-%m-%d/%H', created_at, 'unixepoch') FROM traces
        WHERE id = NEW.trace_id
    ON CONFLICT (tbl, part) DO UPDATE SET gen = gen + 1;
END;
CREATE TRIGGER IF NOT EXISTS warehouse_minutes_insert AFTER INSERT ON step_minutes BEGIN
    INSERT INTO warehouse_dirty (tbl, part) VALUES
        ('rank_minutes', strftime('%Y-%m-%d/%H', NEW.minute, 'unixepoch')),
        ('job_minutes', strftime('%Y-%m-%d/%H', NEW.minute, 'unixepoch'))
    ON CONFLICT (tbl, part) DO UPDATE SET gen = gen + 1;
END;
CREATE TRIGGER IF NOT EXISTS warehouse_incidents_insert AFTER INSERT ON incidents BEGIN
    INSERT INTO warehouse_dirty (tbl, part)
        VALUES ('incidents', strftime('%Y-%m-%d', NEW.detected_at, 'unixepoch'))
    ON CONFLICT (tbl, part) DO UPDATE SET gen = gen + 1;
END;
CREATE TRIGGER IF NOT EXISTS warehouse_incidents_update AFTER UPDATE ON incidents BEGIN
    INSERT INTO warehouse_dirty (tbl, part) VALUES
        ('incidents', strftime('%Y-%m-%d', NEW.detected_at, 'unixepoch')),
        ('incidents', strftime('%Y-%m-%d', OLD.detected_at, 'unixepoch'))
    ON CONFLICT (tbl, part) DO UPDATE SET gen = gen + 1;
END;
"""

#: Schema 8's first open marks every partition the index already has rows for, so an
#: upgraded node exports its history too (the exporter skips what retention would delete).
WAREHOUSE_BACKFILL = """
INSERT OR IGNORE INTO warehouse_dirty (tbl, part)
    SELECT t.tbl, strftime('%Y-%m-%d/%H', h.created_at, 'unixepoch')
    FROM (SELECT DISTINCT CAST(created_at / 3600 AS INTEGER) * 3600 AS created_at
          FROM traces) h,
         (SELECT 'captures' AS tbl UNION ALL SELECT 'rank_steps' UNION ALL SELECT 'operators') t;
INSERT OR IGNORE INTO warehouse_dirty (tbl, part)
    SELECT t.tbl, strftime('%Y-%m-%d/%H', h.minute, 'unixepoch')
    FROM (SELECT DISTINCT minute / 3600 * 3600 AS minute FROM step_minutes) h,
         (SELECT 'rank_minutes' AS tbl UNION ALL SELECT 'job_minutes') t;
INSERT OR IGNORE INTO warehouse_dirty (tbl, part)
    SELECT DISTINCT 'incidents', strftime('%Y-%m-%d', detected_at, 'unixepoch') FROM incidents;
"""

#: Schema 9: the days of the hourly tables this node has written, and where each is in its
#: seal (profd/warehouse/flush.py): hourly objects only; sealed (its day object written, which
#: supersedes them); swept (its hourly objects deleted, a grace period later).
WAREHOUSE_DAYS = """
CREATE TABLE IF NOT EXISTS warehouse_days (
    tbl TEXT NOT NULL,
    date TEXT NOT NULL,  -- YYYY-MM-DD (UTC)
    sealed_at REAL,  -- when its day object was first written
    swept_at REAL,  -- when its hourly objects were deleted
    merged_at REAL,  -- when its day object was deleted, a fleet object holding its rows
    PRIMARY KEY (tbl, date)
) WITHOUT ROWID;
"""

#: Schema 9's first open records the days the index has rows of, whose hourly objects the
#: export has written or will write.
WAREHOUSE_DAYS_BACKFILL = """
INSERT OR IGNORE INTO warehouse_days (tbl, date)
    SELECT t.tbl, d.date
    FROM (SELECT DISTINCT strftime('%Y-%m-%d', created_at, 'unixepoch') AS date FROM traces) d,
         (SELECT 'captures' AS tbl UNION ALL SELECT 'rank_steps' UNION ALL SELECT 'operators') t;
INSERT OR IGNORE INTO warehouse_days (tbl, date)
    SELECT t.tbl, d.date
    FROM (SELECT DISTINCT strftime('%Y-%m-%d', minute, 'unixepoch') AS date FROM step_minutes) d,
         (SELECT 'rank_minutes' AS tbl UNION ALL SELECT 'job_minutes') t;
"""

SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    state TEXT NOT NULL,
    backend TEXT NOT NULL,
    label TEXT,
    region TEXT,
    request TEXT NOT NULL,      -- json: the start spec as given
    cycles TEXT NOT NULL,       -- json: [[warmup, start, stop], ...]
    plan INTEGER NOT NULL DEFAULT 0,  -- times --next moved the cycles (a rank got them late)
    owner INTEGER,              -- the uid whose processes it captures; NULL: several/unknown
    error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_job ON sessions(job, created_at);
CREATE INDEX IF NOT EXISTS sessions_state ON sessions(state, created_at);
CREATE INDEX IF NOT EXISTS sessions_label ON sessions(label, created_at);
CREATE TABLE IF NOT EXISTS targets (
    session TEXT NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    job TEXT NOT NULL,
    role TEXT NOT NULL,
    rank INTEGER NOT NULL,
    world_size INTEGER NOT NULL,
    state TEXT NOT NULL,
    error TEXT,
    traces INTEGER NOT NULL DEFAULT 0,
    final TEXT,                 -- the client's own last word (done/stopped/...), if any
    results TEXT NOT NULL DEFAULT '[]',  -- json: per-cycle results, as session.json lists them
    updated_at REAL NOT NULL,
    stem TEXT,                  -- the name its files share; NULL (older rows): {role}-r{rank}
    PRIMARY KEY (session, host, pid)
);
CREATE TABLE IF NOT EXISTS traces (
    id INTEGER PRIMARY KEY,
    session TEXT NOT NULL,
    job TEXT NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    role TEXT NOT NULL,
    rank INTEGER NOT NULL,
    cycle INTEGER NOT NULL,
    region TEXT,
    steps TEXT NOT NULL,        -- json list of global step numbers
    path TEXT NOT NULL,         -- the .pt.trace.json.gz
    bytes INTEGER NOT NULL,
    state TEXT NOT NULL,
    stall_ms REAL,
    step_ms_p50 REAL,
    step_ms_max REAL,
    torch TEXT,
    device TEXT,
    created_at REAL NOT NULL,
    stats TEXT,                 -- json: the pipeline's per-rank statistics (rankstats.py)
    UNIQUE (session, host, pid, cycle)
);
CREATE INDEX IF NOT EXISTS traces_job ON traces(job, created_at);
CREATE INDEX IF NOT EXISTS traces_session ON traces(session, rank);
CREATE INDEX IF NOT EXISTS traces_rank ON traces(rank, created_at);
CREATE INDEX IF NOT EXISTS traces_created ON traces(created_at);
-- Not UNIQUE: an nsys report of several ranks is indexed once per rank (add_trace's shared),
-- and an index written before the check may hold rows that share a path.
CREATE INDEX IF NOT EXISTS traces_path ON traces(path);
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY,
    session TEXT NOT NULL,
    job TEXT NOT NULL,
    trace_id INTEGER,           -- NULL for session.json
    kind TEXT NOT NULL,         -- trace | summary | memory | session
    path TEXT NOT NULL UNIQUE,
    rel TEXT NOT NULL,          -- path relative to the spool: the S3 key below the prefix
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    upload_state TEXT NOT NULL, -- local | pending | uploading | uploaded | failed
    s3_uri TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL DEFAULT 0,  -- when a pending or failed file is tried next;
                                -- 0 on a failed file: never by itself (its local file is gone)
    last_error TEXT,
    uploaded_at REAL,
    deleted INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS files_trace ON files(trace_id);
CREATE INDEX IF NOT EXISTS files_session ON files(session);
CREATE INDEX IF NOT EXISTS files_queue ON files(upload_state, next_attempt_at);
CREATE TABLE IF NOT EXISTS inbox (
    key TEXT PRIMARY KEY,       -- session/host/pid/cycle: a report is processed once
    message TEXT NOT NULL,      -- json: the client's captured report plus its identity
    received_at REAL NOT NULL,
    done INTEGER NOT NULL DEFAULT 0  -- 0 to process, 1 done, 2 indexed with its raw left
);
"""
    + STEP_MINUTES
    + INCIDENTS
    + WAREHOUSE_QUEUE
    + WAREHOUSE_DAYS
)


class IndexSchemaError(Exception):
    """The index cannot be used by this profd (written by a newer one, or unreadable)."""


def _columns(conn: sqlite3.Connection, table: str) -> set[str] | None:
    """The table's columns; None when there is no such table (then the current schema's
    ``CREATE TABLE IF NOT EXISTS`` makes it whole, after the steps)."""
    cols = {str(r[1]) for r in conn.execute(f"PRAGMA table_info({table})")}
    return cols or None


def _add_column(conn: sqlite3.Connection, table: str, column: str, decl: str) -> None:
    cols = _columns(conn, table)
    if cols is not None and column not in cols:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def statements(script: str) -> Iterator[str]:
    """A script's statements one by one: ``executescript`` would commit the transaction a
    migration runs in."""
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            yield buf
            buf = ""
    if buf.strip():
        raise ValueError(f"incomplete SQL statement: {buf.strip()[:60]}")


def _v1_to_v2(conn: sqlite3.Connection) -> None:
    """How many times ``--next`` moved a session's cycles."""
    _add_column(conn, "sessions", "plan", "INTEGER NOT NULL DEFAULT 0")


def _v2_to_v3(conn: sqlite3.Connection) -> None:
    """The uid a session captures (added while the version still said 2), and a target's
    last word and per-cycle results, which a restarted daemon needs to finish it."""
    _add_column(conn, "sessions", "owner", "INTEGER")
    _add_column(conn, "targets", "final", "TEXT")
    _add_column(conn, "targets", "results", "TEXT NOT NULL DEFAULT '[]'")


def _v3_to_v4(conn: sqlite3.Connection) -> None:
    """A trace's per-rank statistics."""
    _add_column(conn, "traces", "stats", "TEXT")


def _v4_to_v5(conn: sqlite3.Connection) -> None:
    """The name a target's files share (``traces_path`` comes with the current schema)."""
    _add_column(conn, "targets", "stem", "TEXT")


def _v5_to_v6(conn: sqlite3.Connection) -> None:
    for stmt in statements(STEP_MINUTES):
        conn.execute(stmt)


def _v6_to_v7(conn: sqlite3.Connection) -> None:
    for stmt in statements(INCIDENTS):
        conn.execute(stmt)


def _v7_to_v8(conn: sqlite3.Connection) -> None:
    """The warehouse export's queue and its triggers, with what the index already holds
    marked. A trigger or a mark on a table an old index never had is left to the schema's
    own pass after the steps, which creates the table empty, its triggers with it."""
    for stmt in statements(WAREHOUSE_QUEUE + WAREHOUSE_BACKFILL):
        if all(_columns(conn, t) is not None for t in _TABLES_NAMED.findall(stmt)):
            conn.execute(stmt)


def _v8_to_v9(conn: sqlite3.Connection) -> None:
    """The days the warehouse export has written hourly objects of, to be sealed."""
    for stmt in statements(WAREHOUSE_DAYS + WAREHOUSE_DAYS_BACKFILL):
        if all(_columns(conn, t) is not None for t in _TABLES_NAMED.findall(stmt)):
            conn.execute(stmt)


def _v9_to_v10(conn: sqlite3.Connection) -> None:
    """Which of this node's days a fleet object holds (profd/warehouse/merge.py)."""
    if _columns(conn, "warehouse_days") is not None:
        _add_column(conn, "warehouse_days", "merged_at", "REAL")


#: The tables a statement reads or puts a trigger on.
_TABLES_NAMED = re.compile(r"\b(?:ON|FROM)\s+([a-z_]+)\b")


#: The step from each older version to the next, by the version it starts from.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _v1_to_v2,
    2: _v2_to_v3,
    3: _v3_to_v4,
    4: _v4_to_v5,
    5: _v5_to_v6,
    6: _v6_to_v7,
    7: _v7_to_v8,
    8: _v8_to_v9,
    9: _v9_to_v10,
}
assert sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION))


def stored_version(conn: sqlite3.Connection, path: Path) -> int:
    """The version the index says it has; 0 for a new (empty) file."""
    if _columns(conn, "meta") is None:
        return 0 if _columns(conn, "sessions") is None else 1
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        # Tables without a version: written by some profd that died before storing it.
        return 0 if _columns(conn, "sessions") is None else 1
    try:
        return int(row[0])
    except (TypeError, ValueError):
        raise IndexSchemaError(
            f"{path}: schema version {row[0]!r} is not a number; not a profd index?"
        ) from None


def _refuse_newer(version: int, path: Path) -> None:
    if version > SCHEMA_VERSION:
        raise IndexSchemaError(
            f"{path} has index schema {version}, newer than this profd's {SCHEMA_VERSION}:"
            " run the profd that wrote it, or move the file away to start a new index"
        )


def check_readable(conn: sqlite3.Connection, path: Path) -> None:
    """A read-only open: refused if a newer profd wrote the index."""
    _refuse_newer(stored_version(conn, path), path)


def bring_up_to_date(conn: sqlite3.Connection, path: Path) -> None:
    """Inside the caller's transaction: each step from the stored version on, then whatever
    the current schema has that the file lacks (tables, indexes), then this version."""
    version = stored_version(conn, path)
    _refuse_newer(version, path)
    for step in range(version, SCHEMA_VERSION) if version else ():
        MIGRATIONS[step](conn)
    for stmt in statements(SCHEMA):
        conn.execute(stmt)
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
