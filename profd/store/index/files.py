"""The spool's files: what each capture wrote, whether it is still on disk, and the spool's
size (written by the event loop; upload workers prune uploaded ones)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Mapping
from typing import Any

from profd.store.index.db import Repo


def insert_file(conn: sqlite3.Connection, f: Mapping[str, Any], trace_id: int | None) -> None:
    """One file into the ``files`` table (again: its size and upload anew)."""
    conn.execute(
        "INSERT INTO files (session, job, trace_id, kind, path, rel, bytes, created_at,"
        " upload_state) VALUES (:session, :job, :trace_id, :kind, :path, :rel, :bytes,"
        " :created_at, :upload_state) ON CONFLICT(path) DO UPDATE SET bytes=excluded.bytes,"
        " upload_state=CASE WHEN excluded.upload_state='pending' THEN 'pending'"
        " ELSE files.upload_state END, attempts=0, next_attempt_at=0, deleted=0",
        {"created_at": time.time(), **f, "trace_id": trace_id},
    )


class FileRepo(Repo):
    def add_file(self, f: Mapping[str, Any]) -> None:
        """A file of no trace (a ``session.json``, an incident's record)."""
        insert_file(self.conn, f, None)

    def spool_usage(self) -> tuple[int, int]:
        """(bytes held in the spool, of which not yet safely uploaded)."""
        r = self.conn.execute(
            "SELECT SUM(bytes) AS total, SUM(CASE WHEN upload_state != 'uploaded' THEN bytes END)"
            " AS unsafe FROM files WHERE deleted = 0"
        ).fetchone()
        return int(r["total"] or 0), int(r["unsafe"] or 0)

    def prunable(self) -> Iterable[dict[str, Any]]:
        """Verified-uploaded files still on disk, oldest first."""
        for r in self.conn.execute(
            "SELECT id, path, bytes FROM files WHERE upload_state = 'uploaded' AND deleted = 0"
            " ORDER BY uploaded_at, id"
        ).fetchall():
            yield dict(r)

    def mark_deleted(self, file_id: int) -> None:
        self.conn.execute("UPDATE files SET deleted = 1 WHERE id = ?", (file_id,))

    def labelled_with_files(
        self, label: str, before: float, after: tuple[float, str], limit: int
    ) -> list[tuple[float, str]]:
        """``(created_at, id)`` of up to ``limit`` sessions labelled ``label``, created before
        ``before`` and after ``after`` (in that order), that still have a file other than
        their manifest in the spool: the samples whose trace files may age out."""
        rows = self.conn.execute(
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
            for r in self.conn.execute(
                "SELECT id, path, kind, upload_state FROM files"
                " WHERE session = ? AND deleted = 0 AND kind != 'session'",
                (session,),
            )
        ]
