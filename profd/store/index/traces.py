"""Traces: one row per capture of one process and cycle, with its files (written by the
event loop, read by ``profctl traces`` and reports)."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from profd import globs
from profd.store.index.db import Repo, in_range
from profd.store.index.files import insert_file

# msgspec's decoder: a day of captures' statistics is some 10^5 documents of a few KiB.
_decode = msgspec.json.Decoder().decode

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


class TraceRepo(Repo):
    def add_trace(
        self, row: Mapping[str, Any], files: Sequence[Mapping[str, Any]], shared: bool = False
    ) -> int:
        """Index one capture and its files in one transaction; returns the trace id.

        A file is one process's capture: :class:`PathTaken` if ``row``'s trace or one of
        ``files`` already belongs to another capture (another session, process or cycle),
        unless ``shared`` (an nsys report of several ranks, indexed once for each)."""
        with self.transaction():
            if not shared:
                self._check_own(row, [row["path"], *(f["path"] for f in files)])
            cur = self.conn.execute(
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
                insert_file(self.conn, f, trace_id)
        return trace_id

    def _check_own(self, row: Mapping[str, Any], paths: Sequence[str]) -> None:
        marks = ",".join("?" * len(paths))
        other = self.conn.execute(
            "SELECT session, pid, role, rank, cycle FROM traces"
            f" WHERE (path IN ({marks}) OR id IN (SELECT trace_id FROM files"
            f" WHERE path IN ({marks}))) AND NOT (session = ? AND host = ? AND pid = ?"
            " AND cycle = ?) LIMIT 1",
            [*paths, *paths, row["session"], row["host"], row["pid"], row["cycle"]],
        ).fetchone()
        if other is not None:
            raise PathTaken(
                f"not indexed: {os.path.basename(row['path'])} is already the capture of"
                f" {other['role']} rank {other['rank']} (pid {other['pid']}) in session"
                f" {other['session']} cycle {other['cycle']}"
            )

    def traces(self, flt: TraceFilter) -> list[dict[str, Any]]:
        sql, args = _trace_query(flt)
        # Plain tuples zipped with the column names once: sqlite3.Row costs more per row than
        # the query itself at 100 rows.
        cur = self.conn.cursor()
        cur.row_factory = None
        cur.execute(sql, [*args, flt.limit])
        cols = [d[0] for d in cur.description]
        rows = [dict(zip(cols, t, strict=True)) for t in cur.fetchall()]
        if not rows:
            return rows
        for r in rows:
            r["steps"] = json.loads(r["steps"])
            r["stats"] = json.loads(r["stats"]) if r.get("stats") else None
        _attach_files(cur, rows)
        return rows

    # --- the warehouse export's read of a partition -----------------------------------------
    def trace_rows(
        self, since: float, until: float, stats: bool, job: str | None = None
    ) -> list[dict[str, Any]]:
        """Traces created in ``[since, until)`` with their target's world size, their
        session's backend and label, and their trace file's S3 uri and spool-relative path;
        ``stats`` parsed when asked for."""
        sql = (
            "SELECT t.id, t.session, t.job, t.host, t.role, t.rank, t.cycle, t.steps, t.bytes,"
            " t.state, t.stall_ms, t.created_at, tg.world_size, s.backend, s.label,"
            " f.s3_uri, f.rel" + (", t.stats" if stats else "") + " FROM traces t"
            " LEFT JOIN targets tg ON tg.session = t.session AND tg.host = t.host"
            " AND tg.pid = t.pid LEFT JOIN sessions s ON s.id = t.session"
            " LEFT JOIN files f ON f.path = t.path"
            " WHERE t.created_at >= ? AND t.created_at < ?"
        )
        sql, args = in_range(sql, since, until, job, "t.job")
        cur = self.conn.cursor()
        cur.row_factory = None
        cur.execute(sql + " ORDER BY t.id", args)
        cols = [d[0] for d in cur.description]
        out = [dict(zip(cols, t, strict=True)) for t in cur.fetchall()]
        for r in out:
            r["steps"] = _decode(r["steps"])
            if stats:
                r["stats"] = _decode(r["stats"]) if r["stats"] else None
        return out


def _trace_query(flt: TraceFilter) -> tuple[str, list[Any]]:
    """The ``SELECT`` of the traces ``flt`` asks for, its ``LIMIT`` left to bind last."""
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
    return sql, args


def _attach_files(cur: sqlite3.Cursor, rows: list[dict[str, Any]]) -> None:
    """Each trace row's ``files``, its combined ``upload_state`` and its trace's ``s3_uri``."""
    by_id = {r["id"]: r for r in rows}
    for r in rows:
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


def _combined_upload_state(states: set[str]) -> str:
    for s in ("failed", "uploading", "pending", "local"):
        if s in states:
            return s
    return "uploaded" if states else "local"
