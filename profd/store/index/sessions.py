"""Sessions and their targets (written by the event loop)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from typing import Any

from profd.states import sql_terminal
from profd.store.index.db import Repo


class SessionRepo(Repo):
    def save_session(self, row: Mapping[str, Any]) -> None:
        self.conn.execute(
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
        self.conn.execute(
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
        rows = self.conn.execute(sql, [*args, limit]).fetchall()
        return [_session_dict(r) for r in rows]

    def session(self, session_id: str) -> dict[str, Any] | None:
        """The session with this id, else the one whose id contains it (None: no session, or
        several: :meth:`session_ids` tells which)."""
        r = self.conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if r is None:
            ids = self.session_ids(session_id, 2)
            if len(ids) != 1:
                return None
            r = self.conn.execute("SELECT * FROM sessions WHERE id = ?", (ids[0],)).fetchone()
        d = _session_dict(r)
        d["targets"] = [
            {**t, "results": json.loads(t["results"])}
            for t in self.conn.execute(
                "SELECT * FROM targets WHERE session = ? ORDER BY rank, pid", (d["id"],)
            )
        ]
        return d

    def session_ids(self, part: str, limit: int) -> list[str]:
        """Up to ``limit`` ids that contain ``part`` (literal, case-sensitive), newest first:
        a user copies the random tail of an id as readily as its date."""
        rows = self.conn.execute(
            "SELECT id FROM sessions WHERE instr(id, ?) > 0 ORDER BY created_at DESC LIMIT ?",
            (part, limit),
        ).fetchall()
        return [r["id"] for r in rows]

    def has_session(self, session_id: str) -> bool:
        row = self.conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return row is not None

    def open_sessions(self) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            f"SELECT id FROM sessions WHERE NOT {sql_terminal('state')}"
        ).fetchall()
        return [s for r in rows if (s := self.session(r["id"])) is not None]

    def unwritten_manifests(self) -> list[dict[str, Any]]:
        """Finished sessions whose ``session.json`` was never indexed (a daemon killed, or a
        full disk, between the session's end and its manifest), with their targets."""
        rows = self.conn.execute(
            f"SELECT id FROM sessions s WHERE {sql_terminal('state')}"
            " AND NOT EXISTS (SELECT 1 FROM files f WHERE f.session = s.id AND f.kind = 'session')"
        ).fetchall()
        return [s for r in rows if (s := self.session(r["id"])) is not None]

    def last_labelled(self, job: str, label: str, before: float) -> str | None:
        """The id of ``job``'s last session labelled ``label`` that ended with results
        (done or partial) and was created before ``before``."""
        r = self.conn.execute(
            "SELECT id FROM sessions WHERE job = ? AND created_at < ? AND label = ?"
            " AND state IN ('done', 'partial') ORDER BY created_at DESC LIMIT 1",
            (job, before, label),
        ).fetchone()
        return None if r is None else str(r["id"])


def _session_dict(r: sqlite3.Row) -> dict[str, Any]:
    d = dict(r)
    d["request"] = json.loads(d["request"])
    d["cycles"] = json.loads(d["cycles"])
    return d
