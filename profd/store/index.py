"""The SQLite index: sessions, targets, traces, their files, the upload queue, and every
rank's step times per minute (``step_minutes``, written by the loop, kept ``keep_history``).

One file (``index.db``) in WAL mode so profctl-side readers and the daemon's upload workers
never block the event loop's writes. The event loop owns sessions/targets/traces rows; upload
workers own the upload columns of ``files`` rows. Every connection is thread-local in use:
open one :class:`Index` per thread.
"""

from __future__ import annotations

import heapq
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd import globs
from profd.states import sql_terminal
from profd.watch.stats import weighted_quantile

SCHEMA_VERSION = 7

#: Rank-minutes one ``history`` request reads at most (about 4 hours of 1,024 ranks, a month
#: of 8; some 0.4 s): a longer range is answered for its newest minutes.
HISTORY_MAX_ROWS = 250_000

#: ``inbox.done`` of a capture that is indexed while its raw trace still exists.
INBOX_RAW_LEFT = 2

SCHEMA = """
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
-- What the detectors noticed (profd.watch.incident.Incident); the record itself as json.
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

#: Files a worker may take once their ``next_attempt_at`` has come: pending ones, and failed
#: ones that a retry may fix (a failed file whose local file is gone has 0).
_DUE = "(upload_state = 'pending' OR (upload_state = 'failed' AND next_attempt_at > 0))"

_FILE_COLS = ("kind", "path", "bytes", "upload_state", "s3_uri", "last_error", "deleted")


class PathTaken(Exception):
    """A capture's file is already another capture's: two rows never name one file."""


@dataclass(frozen=True)
class TraceFilter:
    job: str | None = None
    session: str | None = None
    rank: int | None = None
    role: str | None = None  # a pattern, see profd.globs
    host: str | None = None
    state: str | None = None
    since: float | None = None  # unix time
    until: float | None = None
    limit: int = 100

    @classmethod
    def from_map(cls, m: Mapping[str, Any]) -> TraceFilter:
        known = set(cls.__dataclass_fields__)
        bad = set(m) - known
        if bad:
            raise ValueError(f"unknown trace filters {sorted(bad)}")
        return cls(**{k: v for k, v in m.items() if v is not None})


class Index:
    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = path
        if readonly:
            self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
            globs.register_sqlite(self.db)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Every job's sessions and paths are in it: the daemon's alone (profctl asks the
            # daemon). Created so before SQLite opens it; its -wal/-shm files copy the mode.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            os.chmod(path, 0o600)
            self.db = sqlite3.connect(str(path), timeout=30.0, isolation_level=None)
            globs.register_sqlite(self.db)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
            self._migrate()
            self.db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
        self.db.row_factory = sqlite3.Row

    def _migrate(self) -> None:
        """Bring an index written by an older profd up to this schema (additive only)."""
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(sessions)")}
        if "plan" not in cols:  # schema 1
            self.db.execute("ALTER TABLE sessions ADD COLUMN plan INTEGER NOT NULL DEFAULT 0")
        if "owner" not in cols:  # schema 2
            self.db.execute("ALTER TABLE sessions ADD COLUMN owner INTEGER")
        tcols = {r[1] for r in self.db.execute("PRAGMA table_info(targets)")}
        if "final" not in tcols:  # schema 3
            self.db.execute("ALTER TABLE targets ADD COLUMN final TEXT")
            self.db.execute("ALTER TABLE targets ADD COLUMN results TEXT NOT NULL DEFAULT '[]'")
        trcols = {r[1] for r in self.db.execute("PRAGMA table_info(traces)")}
        if "stats" not in trcols:  # schema 4
            self.db.execute("ALTER TABLE traces ADD COLUMN stats TEXT")
        if "stem" not in tcols:  # schema 5
            self.db.execute("ALTER TABLE targets ADD COLUMN stem TEXT")
        # schema 6: the step_minutes table, new: SCHEMA's CREATE TABLE IF NOT EXISTS adds it.
        # schema 7: the incidents table, likewise.

    def close(self) -> None:
        self.db.close()

    # --- sessions and targets (event loop) -------------------------------------------------
    def save_session(self, row: Mapping[str, Any]) -> None:
        self.db.execute(
            "INSERT INTO sessions (id, job, state, backend, label, region, request, cycles,"
            " plan, owner, error, created_at, updated_at) VALUES (:id, :job, :state, :backend,"
            " :label, :region, :request, :cycles, :plan, :owner, :error, :created_at,"
            " :updated_at)"
            " ON CONFLICT(id) DO UPDATE SET state=excluded.state, error=excluded.error,"
            " cycles=excluded.cycles, plan=excluded.plan, updated_at=excluded.updated_at",
            {
                "owner": None,
                **row,
                "request": json.dumps(row["request"]),
                "cycles": json.dumps(row["cycles"]),
            },
        )

    def save_target(self, row: Mapping[str, Any]) -> None:
        """Insert or update a target; ``final`` and ``results`` (a list) are what a
        restarted daemon needs to finish it and to write its ``session.json``."""
        self.db.execute(
            "INSERT INTO targets (session, host, pid, job, role, rank, world_size, state, error,"
            " traces, final, results, updated_at, stem) VALUES (:session, :host, :pid, :job,"
            " :role, :rank, :world_size, :state, :error, :traces, :final, :results,"
            " :updated_at, :stem) ON CONFLICT(session, host, pid) DO UPDATE SET"
            " state=excluded.state, error=excluded.error, traces=excluded.traces,"
            " final=excluded.final, results=excluded.results, updated_at=excluded.updated_at",
            {"stem": None, **row, "results": json.dumps(row["results"])},
        )

    def sessions(
        self, state: str | None = None, job: str | None = None, limit: int = 50
    ) -> list[dict[str, Any]]:
        where, args = [], []
        if state:
            where.append("state = ?")
            args.append(state)
        if job:
            where.append("job = ?")
            args.append(job)
        sql = "SELECT * FROM sessions"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC LIMIT ?"
        rows = self.db.execute(sql, [*args, limit]).fetchall()
        return [self._session_dict(r) for r in rows]

    def session(self, session_id: str) -> dict[str, Any] | None:
        """The session with this id, else the one whose id contains it (None: no session, or
        several: :meth:`session_ids` tells which)."""
        r = self.db.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if r is None:
            ids = self.session_ids(session_id, 2)
            if len(ids) != 1:
                return None
            r = self.db.execute("SELECT * FROM sessions WHERE id = ?", (ids[0],)).fetchone()
        d = self._session_dict(r)
        d["targets"] = [
            {**t, "results": json.loads(t["results"])}
            for t in self.db.execute(
                "SELECT * FROM targets WHERE session = ? ORDER BY rank, pid", (d["id"],)
            )
        ]
        return d

    def session_ids(self, part: str, limit: int) -> list[str]:
        """Up to ``limit`` ids that contain ``part`` (literal, case-sensitive), newest first:
        a user copies the random tail of an id as readily as its date."""
        rows = self.db.execute(
            "SELECT id FROM sessions WHERE instr(id, ?) > 0 ORDER BY created_at DESC LIMIT ?",
            (part, limit),
        ).fetchall()
        return [r[0] for r in rows]

    def has_session(self, session_id: str) -> bool:
        row = self.db.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return row is not None

    def open_sessions(self) -> list[dict[str, Any]]:
        rows = self.db.execute(
            f"SELECT id FROM sessions WHERE NOT {sql_terminal('state')}"
        ).fetchall()
        out = []
        for r in rows:
            s = self.session(r["id"])
            if s is not None:
                out.append(s)
        return out

    def unwritten_manifests(self) -> list[dict[str, Any]]:
        """Finished sessions whose ``session.json`` was never indexed (a daemon killed, or a
        full disk, between the session's end and its manifest), with their targets."""
        rows = self.db.execute(
            f"SELECT id FROM sessions s WHERE {sql_terminal('state')}"
            " AND NOT EXISTS (SELECT 1 FROM files f WHERE f.session = s.id AND f.kind = 'session')"
        ).fetchall()
        return [s for r in rows if (s := self.session(r["id"])) is not None]

    @staticmethod
    def _session_dict(r: sqlite3.Row) -> dict[str, Any]:
        d = dict(r)
        d["request"] = json.loads(d["request"])
        d["cycles"] = json.loads(d["cycles"])
        return d

    # --- captures inbox (event loop) ------------------------------------------------------------
    def inbox_put(self, key: str, message: Mapping[str, Any]) -> bool:
        """Persist a client report before acking it; False if it was already received."""
        cur = self.db.execute(
            "INSERT OR IGNORE INTO inbox (key, message, received_at) VALUES (?, ?, ?)",
            (key, json.dumps(message), time.time()),
        )
        return cur.rowcount == 1

    def inbox_done(self, key: str, raw_left: bool = False) -> None:
        """Processed; ``raw_left``: indexed, but its raw trace is not deleted yet."""
        self.db.execute(
            "UPDATE inbox SET done = ? WHERE key = ?", (INBOX_RAW_LEFT if raw_left else 1, key)
        )

    def inbox_pending(self) -> list[tuple[str, dict[str, Any]]]:
        """Reports to (re)process."""
        return self._inbox(0)

    def inbox_raw_left(self) -> list[tuple[str, dict[str, Any]]]:
        """Indexed captures whose raw trace a killed daemon did not get to delete."""
        return self._inbox(INBOX_RAW_LEFT)

    def _inbox(self, done: int) -> list[tuple[str, dict[str, Any]]]:
        rows = self.db.execute("SELECT key, message FROM inbox WHERE done = ?", (done,)).fetchall()
        return [(r["key"], json.loads(r["message"])) for r in rows]

    # --- traces and files -------------------------------------------------------------------
    def add_trace(
        self, row: Mapping[str, Any], files: Sequence[Mapping[str, Any]], shared: bool = False
    ) -> int:
        """Index one capture and its files in one transaction; returns the trace id.

        A file is one process's capture: :class:`PathTaken` if ``row``'s trace or one of
        ``files`` already belongs to another capture (another session, process or cycle),
        unless ``shared`` (an nsys report of several ranks, indexed once for each)."""
        with self._tx():
            if not shared:
                self._check_own(row, [row["path"], *(f["path"] for f in files)])
            cur = self.db.execute(
                "INSERT OR REPLACE INTO traces (session, job, host, pid, role, rank, cycle,"
                " region, steps, path, bytes, state, stall_ms, step_ms_p50, step_ms_max, torch,"
                " device, created_at, stats) VALUES (:session, :job, :host, :pid, :role, :rank,"
                " :cycle, :region, :steps, :path, :bytes, :state, :stall_ms, :step_ms_p50,"
                " :step_ms_max, :torch, :device, :created_at, :stats)",
                {
                    **row,
                    "steps": json.dumps(row["steps"]),
                    "stats": None if row.get("stats") is None else json.dumps(row["stats"]),
                },
            )
            trace_id = int(cur.lastrowid or 0)
            for f in files:
                self._add_file(f, trace_id)
        return trace_id

    def _check_own(self, row: Mapping[str, Any], paths: Sequence[str]) -> None:
        marks = ",".join("?" * len(paths))
        other = self.db.execute(
            "SELECT session, pid, role, rank, cycle FROM traces"
            f" WHERE (path IN ({marks}) OR id IN (SELECT trace_id FROM files"
            f" WHERE path IN ({marks}))) AND NOT (session = ? AND host = ? AND pid = ?"
            " AND cycle = ?) LIMIT 1",
            [*paths, *paths, row["session"], row["host"], row["pid"], row["cycle"]],
        ).fetchone()
        if other is not None:
            session, pid, role, rank, cycle = other
            raise PathTaken(
                f"not indexed: {os.path.basename(row['path'])} is already the capture of"
                f" {role} rank {rank} (pid {pid}) in session {session} cycle {cycle}"
            )

    def add_file(self, f: Mapping[str, Any]) -> None:
        self._add_file(f, None)

    def _add_file(self, f: Mapping[str, Any], trace_id: int | None) -> None:
        self.db.execute(
            "INSERT INTO files (session, job, trace_id, kind, path, rel, bytes, created_at,"
            " upload_state) VALUES (:session, :job, :trace_id, :kind, :path, :rel, :bytes,"
            " :created_at, :upload_state) ON CONFLICT(path) DO UPDATE SET bytes=excluded.bytes,"
            " upload_state=CASE WHEN excluded.upload_state='pending' THEN 'pending'"
            " ELSE files.upload_state END, attempts=0, next_attempt_at=0, deleted=0",
            {"created_at": time.time(), **f, "trace_id": trace_id},
        )

    def traces(self, flt: TraceFilter) -> list[dict[str, Any]]:
        where: list[str] = []
        args: list[Any] = []
        for col in ("job", "session", "rank", "host", "state"):
            v = getattr(flt, col)
            if v is not None:
                where.append(f"t.{col} = ?")
                args.append(v)
        if flt.role:
            cond, glob_args = globs.sqlite_condition("t.role", flt.role)
            where.append(cond)
            args.extend(glob_args)
        if flt.since is not None:
            where.append("t.created_at >= ?")
            args.append(flt.since)
        if flt.until is not None:
            where.append("t.created_at < ?")
            args.append(flt.until)
        sql = "SELECT t.* FROM traces t"
        if where:
            sql += " WHERE " + " AND ".join(where)
        # Ties broken by rowid, the implicit last column of every index, so the job/rank
        # indexes deliver rows already in order and no sort step is needed.
        sql += " ORDER BY t.created_at DESC, t.id DESC LIMIT ?"
        # Plain tuples zipped with the column names once: sqlite3.Row costs more per row than
        # the query itself at 100 rows.
        cur = self.db.cursor()
        cur.row_factory = None
        cur.execute(sql, [*args, flt.limit])
        cols = [d[0] for d in cur.description]
        rows = [dict(zip(cols, t, strict=True)) for t in cur.fetchall()]
        if not rows:
            return rows
        by_id = {r["id"]: r for r in rows}
        for r in rows:
            r["steps"] = json.loads(r["steps"])
            r["stats"] = json.loads(r["stats"]) if r.get("stats") else None
            r["files"] = []
        marks = ",".join("?" * len(by_id))
        cur.execute(
            f"SELECT trace_id, {', '.join(_FILE_COLS)} FROM files"
            f" WHERE trace_id IN ({marks}) ORDER BY id",
            list(by_id),
        )
        for trace_id, *values in cur.fetchall():
            by_id[trace_id]["files"].append(dict(zip(_FILE_COLS, values, strict=True)))
        for r in rows:
            if not r["files"]:
                # An nsys report shared by several ranks of one launch is stored once, under
                # the first rank's trace: the others find it by path.
                cur.execute(
                    f"SELECT {', '.join(_FILE_COLS)} FROM files WHERE trace_id ="
                    " (SELECT trace_id FROM files WHERE path = ?) ORDER BY id",
                    (r["path"],),
                )
                r["files"] = [dict(zip(_FILE_COLS, v, strict=True)) for v in cur.fetchall()]
            trace_file = next((f for f in r["files"] if f["path"] == r["path"]), None)
            states = {f["upload_state"] for f in r["files"]}
            r["upload_state"] = _combined_upload_state(states)
            r["s3_uri"] = trace_file["s3_uri"] if trace_file else None
        return rows

    # --- upload queue (upload workers) --------------------------------------------------------
    def claim_upload(self, now: float) -> dict[str, Any] | None:
        """Take the next due upload; ``session`` files wait until the rest of their session.

        ``failed`` files are due too when their retry time has come (see :meth:`upload_retry`):
        the returned row's ``upload_state`` is the one it had before it was claimed."""
        with self._tx():
            r = self.db.execute(
                f"SELECT * FROM files f WHERE {_DUE} AND next_attempt_at <= ?"
                " AND deleted = 0 AND (kind != 'session' OR NOT EXISTS (SELECT 1 FROM files g"
                " WHERE g.session = f.session AND g.kind != 'session'"
                " AND g.upload_state IN ('pending', 'uploading', 'failed')))"
                " ORDER BY (kind = 'session'), id LIMIT 1",
                (now,),
            ).fetchone()
            if r is None:
                return None
            self.db.execute(
                "UPDATE files SET upload_state = 'uploading', attempts = attempts + 1 WHERE id = ?",
                (r["id"],),
            )
            d = dict(r)
            d["attempts"] += 1
            return d

    def upload_done(self, file_id: int, s3_uri: str) -> None:
        self.db.execute(
            "UPDATE files SET upload_state = 'uploaded', s3_uri = ?, uploaded_at = ?,"
            " last_error = NULL WHERE id = ?",
            (s3_uri, time.time(), file_id),
        )

    def upload_retry(self, file_id: int, error: str, at: float, give_up: bool) -> None:
        """A failed attempt: the file is tried again at ``at``; with ``give_up`` it is
        ``failed`` (it used up its attempts), and ``at`` 0 means never again by itself."""
        self.db.execute(
            "UPDATE files SET upload_state = ?, last_error = ?, next_attempt_at = ? WHERE id = ?",
            ("failed" if give_up else "pending", error, at, file_id),
        )

    def requeue(self, session: str | None = None, include_failed: bool = True) -> int:
        """Uploads interrupted by a dead daemon (and failed ones) go back to the queue."""
        states = ("uploading", "failed") if include_failed else ("uploading",)
        marks = ",".join("?" * len(states))
        sql = (
            f"UPDATE files SET upload_state = 'pending', next_attempt_at = 0,"
            f" attempts = CASE WHEN upload_state = 'failed' THEN 0 ELSE attempts END"
            f" WHERE upload_state IN ({marks}) AND deleted = 0"
        )
        args: list[Any] = list(states)
        if session:
            sql += " AND session = ?"
            args.append(session)
        return self.db.execute(sql, args).rowcount

    def requeue_recovered(self, keep: Callable[[str], bool]) -> int:
        """The store is back after an outage: ``failed`` files that a retry can fix (and whose
        path ``keep`` accepts: the local file exists) go back to the queue with their attempts
        reset, and files waiting out a backoff become due now. Returns how many were failed."""
        rows = self.db.execute(
            "SELECT id, path FROM files WHERE upload_state = 'failed' AND next_attempt_at > 0"
            " AND deleted = 0"
        ).fetchall()
        ids = [r["id"] for r in rows if keep(r["path"])]
        n = 0
        with self._tx():
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                # A worker may have claimed one since: only rows still failed are requeued.
                n += self.db.execute(
                    "UPDATE files SET upload_state = 'pending', next_attempt_at = 0, attempts = 0"
                    f" WHERE upload_state = 'failed' AND id IN ({','.join('?' * len(chunk))})",
                    chunk,
                ).rowcount
            self.db.execute(
                "UPDATE files SET next_attempt_at = 0"
                " WHERE upload_state = 'pending' AND deleted = 0 AND next_attempt_at > 0"
            )
        return n

    def uploading(self) -> list[dict[str, Any]]:
        """Rows a worker held: at start-up, the uploads a dead daemon was in the middle of."""
        return [
            dict(r)
            for r in self.db.execute(
                "SELECT id, rel FROM files WHERE upload_state = 'uploading' AND deleted = 0"
            )
        ]

    def known_rels(self, rels: Iterable[str]) -> set[str]:
        """Which of ``rels`` are files of this index, deleted ones included: the S3 keys below
        the prefix that this node wrote (other nodes share the bucket and prefix)."""
        rels = list(rels)
        out: set[str] = set()
        for i in range(0, len(rels), 500):
            chunk = rels[i : i + 500]
            out.update(
                r["rel"]
                for r in self.db.execute(
                    f"SELECT rel FROM files WHERE rel IN ({','.join('?' * len(chunk))})", chunk
                )
            )
        return out

    def next_upload_due(self, now: float) -> float | None:
        """When the earliest backed-off upload becomes due (None if nothing waits on a timer)."""
        r = self.db.execute(
            f"SELECT MIN(next_attempt_at) AS at FROM files"
            f" WHERE {_DUE} AND deleted = 0 AND next_attempt_at > ?",
            (now,),
        ).fetchone()
        return float(r["at"]) if r["at"] is not None else None

    def queue_stats(self) -> dict[str, int]:
        r = self.db.execute(
            "SELECT"
            " SUM(upload_state IN ('pending','uploading')) AS queued,"
            " SUM(upload_state = 'failed') AS failed,"
            " SUM(CASE WHEN upload_state IN ('pending','uploading','failed') THEN bytes END)"
            "   AS bytes_pending,"
            " SUM(upload_state = 'uploaded') AS uploaded"
            " FROM files WHERE deleted = 0"
        ).fetchone()
        return {k: int(r[k] or 0) for k in ("queued", "failed", "bytes_pending", "uploaded")}

    def queue_bytes(self) -> int:
        """``queue_stats()["bytes_pending"]`` alone, through the ``files_queue`` index: it
        reads the queued rows only, not every file (``/metrics`` asks every few seconds)."""
        r = self.db.execute(
            "SELECT SUM(bytes) AS b FROM files"
            " WHERE upload_state IN ('pending','uploading','failed') AND deleted = 0"
        ).fetchone()
        return int(r["b"] or 0)

    # --- spool quota ---------------------------------------------------------------------------
    def spool_usage(self) -> tuple[int, int]:
        """(bytes held in the spool, of which not yet safely uploaded)."""
        r = self.db.execute(
            "SELECT SUM(bytes) AS total, SUM(CASE WHEN upload_state != 'uploaded' THEN bytes END)"
            " AS unsafe FROM files WHERE deleted = 0"
        ).fetchone()
        return int(r["total"] or 0), int(r["unsafe"] or 0)

    def prunable(self) -> Iterable[dict[str, Any]]:
        """Verified-uploaded files still on disk, oldest first."""
        for r in self.db.execute(
            "SELECT id, path, bytes FROM files WHERE upload_state = 'uploaded' AND deleted = 0"
            " ORDER BY uploaded_at, id"
        ).fetchall():
            yield dict(r)

    def mark_deleted(self, file_id: int) -> None:
        self.db.execute("UPDATE files SET deleted = 1 WHERE id = ?", (file_id,))

    # --- samples (event loop) ----------------------------------------------------------------
    def labelled_with_files(
        self, label: str, before: float, after: tuple[float, str], limit: int
    ) -> list[tuple[float, str]]:
        """``(created_at, id)`` of up to ``limit`` sessions labelled ``label``, created before
        ``before`` and after ``after`` (in that order), that still have a file other than
        their manifest in the spool: the samples whose trace files may age out."""
        rows = self.db.execute(
            "SELECT created_at, id FROM sessions s WHERE label = ? AND created_at < ?"
            " AND (created_at, id) > (?, ?) AND EXISTS (SELECT 1 FROM files f"
            " WHERE f.session = s.id AND f.deleted = 0 AND f.kind != 'session')"
            " ORDER BY created_at, id LIMIT ?",
            (label, before, after[0], after[1], limit),
        ).fetchall()
        return [(float(r["created_at"]), str(r["id"])) for r in rows]

    def capture_files(self, session: str) -> list[dict[str, Any]]:
        """A session's files still in the spool, its manifest left out."""
        return [
            dict(r)
            for r in self.db.execute(
                "SELECT id, path, kind, upload_state FROM files"
                " WHERE session = ? AND deleted = 0 AND kind != 'session'",
                (session,),
            )
        ]

    def last_labelled(self, job: str, label: str, before: float) -> str | None:
        """The id of ``job``'s last session labelled ``label`` that ended with results
        (done or partial) and was created before ``before``."""
        r = self.db.execute(
            "SELECT id FROM sessions WHERE job = ? AND created_at < ? AND label = ?"
            " AND state IN ('done', 'partial') ORDER BY created_at DESC LIMIT 1",
            (job, before, label),
        ).fetchone()
        return None if r is None else str(r["id"])

    # --- step minutes (event loop) ---------------------------------------------------------
    def add_step_minutes(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Closed minutes of ranks (the ledger's ``MinuteSummary`` fields), in one
        transaction: 1,024 ranks' minute is one commit, not 1,024."""
        with self._tx():
            self.db.executemany(
                "INSERT INTO step_minutes (job, host, role, rank, pid, minute, steps, sum_s,"
                " p50_ms, p90_ms, max_ms, regions) VALUES (:job, :host, :role, :rank, :pid,"
                " :minute, :steps, :sum_s, :p50_ms, :p90_ms, :max_ms, :regions)",
                ({**r, "regions": json.dumps(r.get("regions") or {})} for r in rows),
            )

    def step_history(
        self, job: str, since: float, until: float, max_rows: int = HISTORY_MAX_ROWS
    ) -> tuple[list[dict[str, Any]], float]:
        """``job``'s minutes that overlap ``[since, until)``, one row per minute and role
        (``HISTORY_ROW``), oldest first; and the ``since`` they cover: later than asked when
        the range holds more than ``max_rows`` rank-minutes (the newest are kept, whole
        minutes only), so one request never holds the loop for long."""
        cur = self.db.cursor()
        cur.row_factory = None
        # Newest first, the (job, minute) index's own order read backwards: no sort.
        cur.execute(
            "SELECT minute, role, host, rank, steps, p50_ms, p90_ms, max_ms FROM step_minutes"
            " WHERE job = ? AND minute > ? AND minute < ? ORDER BY minute DESC LIMIT ?",
            (job, since - 60.0, until, max_rows + 1),
        )
        rows = cur.fetchall()
        if len(rows) > max_rows:
            cut = rows[-1][0]  # the oldest minute read may be cut short: none of it
            rows = [r for r in rows if r[0] != cut]
            since = float(cut + 60)
        return history_rows(rows), since

    def last_step_minute(
        self, job: str, role: str, rank: int, since: float
    ) -> tuple[int, float] | None:
        """The newest minute of ``job``'s ``role`` rank ``rank`` that starts at ``since`` or
        later and has a p50: (minute start, p50 ms)."""
        r = self.db.execute(
            "SELECT minute, p50_ms FROM step_minutes WHERE job = ? AND minute >= ?"
            " AND role = ? AND rank = ? AND p50_ms IS NOT NULL ORDER BY minute DESC LIMIT 1",
            (job, int(since), role, rank),
        ).fetchone()
        return None if r is None else (int(r[0]), float(r[1]))

    def prune_step_minutes(self, before: float, chunk: int = 20_000) -> int:
        """Forget minutes that start before ``before``; how many. In chunks, each its own
        transaction, so a week of a large job goes without one long write lock."""
        n = 0
        while True:
            k = self.db.execute(
                "DELETE FROM step_minutes WHERE rowid IN"
                " (SELECT rowid FROM step_minutes WHERE minute < ? LIMIT ?)",
                (before, chunk),
            ).rowcount
            n += k
            if k < chunk:
                return n

    # --- incidents (event loop) ------------------------------------------------------------
    def save_incident(self, doc: Mapping[str, Any]) -> None:
        """Insert or replace an incident (``Incident.to_dict()``)."""
        self.db.execute(
            "INSERT INTO incidents (id, kind, job, state, detected_at, updated_at, doc)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET state=excluded.state,"
            " updated_at=excluded.updated_at, doc=excluded.doc",
            (
                doc["id"],
                doc["kind"],
                doc["job"],
                doc["state"],
                doc["detected_at"],
                time.time(),
                json.dumps(doc),
            ),
        )

    def incidents(
        self,
        job: str | None = None,
        kind: str | None = None,
        since: float | None = None,
        state: str | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        """Incidents, newest first."""
        where: list[str] = []
        args: list[Any] = []
        for col, v in (("job", job), ("kind", kind), ("state", state)):
            if v is not None:
                where.append(f"{col} = ?")
                args.append(v)
        if since is not None:
            where.append("detected_at >= ?")
            args.append(since)
        sql = "SELECT doc FROM incidents"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY detected_at DESC, id DESC LIMIT ?"
        return [json.loads(r[0]) for r in self.db.execute(sql, [*args, limit]).fetchall()]

    def incident_ids(self, part: str, limit: int) -> list[str]:
        """Up to ``limit`` incident ids that contain ``part``, newest first."""
        rows = self.db.execute(
            "SELECT id FROM incidents WHERE instr(id, ?) > 0 ORDER BY detected_at DESC LIMIT ?",
            (part, limit),
        ).fetchall()
        return [r[0] for r in rows]

    def incident(self, incident_id: str) -> dict[str, Any] | None:
        r = self.db.execute("SELECT doc FROM incidents WHERE id = ?", (incident_id,)).fetchone()
        return None if r is None else dict(json.loads(r[0]))

    def recent_incidents(self, since: float) -> list[dict[str, Any]]:
        """Open incidents and those detected since ``since``: what a restarted daemon holds
        again (open ones stay open; recent ones carry their job's cooldown)."""
        rows = self.db.execute(
            "SELECT doc FROM incidents WHERE state = 'open' OR detected_at >= ?"
            " ORDER BY detected_at",
            (since,),
        ).fetchall()
        return [json.loads(r[0]) for r in rows]

    # --- helpers -----------------------------------------------------------------------------
    def transaction(self) -> _Tx:
        """One commit for many writes (the event loop's write-behind flush)."""
        return _Tx(self.db)

    def _tx(self) -> _Tx:
        return _Tx(self.db)


class _Tx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.outer = False

    def __enter__(self) -> None:
        # Nested inside another transaction: part of that one, which commits or rolls back.
        self.outer = not self.db.in_transaction
        if self.outer:
            self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self.outer:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def history_rows(rows: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    """``(minute, role, host, rank, steps, p50_ms, p90_ms, max_ms)`` rows as ``HISTORY_ROW``
    dicts, oldest first: per minute and role the ranks that stepped, their steps, the median
    over ranks of each rank's p50 (and p90), the longest step and the 3 ranks with the
    highest p50. A rank with two rows in one minute (it re-attached) counts once: its steps
    summed, its quantiles combined weighted by steps."""
    groups: dict[tuple[int, str], list[Sequence[Any]]] = {}
    for r in rows:
        key = (r[0], r[1])
        g = groups.get(key)
        if g is None:
            groups[key] = [r]
        else:
            g.append(r)
    out = []
    for minute, role in sorted(groups):
        members = groups[(minute, role)]
        if len({(r[2], r[3]) for r in members}) < len(members):
            members = _one_per_rank(members)
        p50s = sorted(r[5] for r in members if r[5] is not None)
        p90s = sorted(r[6] for r in members if r[6] is not None)
        maxes = [r[7] for r in members if r[7] is not None]
        slow = heapq.nsmallest(
            3, (r for r in members if r[5] is not None), key=lambda r: (-r[5], r[2], r[3])
        )
        out.append(
            {
                "minute": int(minute),
                "role": role,
                "ranks": len(members),
                "steps": sum(r[4] for r in members),
                "p50_ms": _ms(_median(p50s)),
                "p90_ms": _ms(_median(p90s)),
                "max_ms": _ms(max(maxes)) if maxes else None,
                "slowest": [
                    {"host": r[2], "role": role, "rank": r[3], "p50_ms": _ms(r[5])} for r in slow
                ],
            }
        )
    return out


def _median(xs: Sequence[float]) -> float | None:
    n = len(xs)
    if not n:
        return None
    m = n // 2
    return float(xs[m]) if n % 2 else (xs[m - 1] + xs[m]) / 2.0


def _one_per_rank(members: list[Sequence[Any]]) -> list[Sequence[Any]]:
    by_rank: dict[tuple[str, int], list[Sequence[Any]]] = {}
    for r in members:
        by_rank.setdefault((r[2], r[3]), []).append(r)
    out: list[Sequence[Any]] = []
    for (host, rank), parts in by_rank.items():
        if len(parts) == 1:
            out.append(parts[0])
            continue
        maxes = [p[7] for p in parts if p[7] is not None]
        out.append(
            (
                parts[0][0],
                parts[0][1],
                host,
                rank,
                sum(p[4] for p in parts),
                weighted_quantile(((p[5], p[4]) for p in parts if p[5] is not None), 0.5),
                weighted_quantile(((p[6], p[4]) for p in parts if p[6] is not None), 0.9),
                max(maxes) if maxes else None,
            )
        )
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(float(v), 3)


def _combined_upload_state(states: set[str]) -> str:
    for s in ("failed", "uploading", "pending", "local"):
        if s in states:
            return s
    return "uploaded" if states else "local"
