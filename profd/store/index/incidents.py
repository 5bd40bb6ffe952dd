"""Incidents: what the detectors noticed, each record as json (written by the event loop)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from profd.store.index.db import Repo, in_range


class IncidentRepo(Repo):
    def save_incident(self, doc: Mapping[str, Any]) -> None:
        """Insert or replace an incident (``Incident.to_dict()``)."""
        self.conn.execute(
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
        return [json.loads(r["doc"]) for r in self.conn.execute(sql, [*args, limit]).fetchall()]

    def incident_ids(self, part: str, limit: int) -> list[str]:
        """Up to ``limit`` incident ids that contain ``part``, newest first."""
        rows = self.conn.execute(
            "SELECT id FROM incidents WHERE instr(id, ?) > 0 ORDER BY detected_at DESC LIMIT ?",
            (part, limit),
        ).fetchall()
        return [r["id"] for r in rows]

    def incident(self, incident_id: str) -> dict[str, Any] | None:
        r = self.conn.execute("SELECT doc FROM incidents WHERE id = ?", (incident_id,)).fetchone()
        return None if r is None else dict(json.loads(r["doc"]))

    def recent_incidents(self, since: float) -> list[dict[str, Any]]:
        """Open incidents and those detected since ``since``: what a restarted daemon holds
        again (open ones stay open; recent ones carry their job's cooldown)."""
        rows = self.conn.execute(
            "SELECT doc FROM incidents WHERE state = 'open' OR detected_at >= ?"
            " ORDER BY detected_at",
            (since,),
        ).fetchall()
        return [json.loads(r["doc"]) for r in rows]

    def incident_docs(
        self, since: float, until: float, job: str | None = None
    ) -> list[dict[str, Any]]:
        """Incidents detected in ``[since, until)``, each ``Incident.to_dict()``."""
        sql, args = in_range(
            "SELECT doc FROM incidents WHERE detected_at >= ? AND detected_at < ?",
            since,
            until,
            job,
        )
        rows = self.conn.execute(sql + " ORDER BY detected_at, id", args).fetchall()
        return [json.loads(r[0]) for r in rows]
