"""The upload queue: the upload columns of ``files`` rows (owned by the upload workers, each
over its own connection; the event loop requeues and reads the queue's size)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from profd.store.index.db import Repo

#: Files a worker may take once their ``next_attempt_at`` has come: pending ones, and failed
#: ones that a retry may fix (a failed file whose local file is gone has 0).
_DUE = "(upload_state = 'pending' OR (upload_state = 'failed' AND next_attempt_at > 0))"


class UploadQueueRepo(Repo):
    def claim_upload(self, now: float) -> dict[str, Any] | None:
        """Take the next due upload; ``session`` files wait until the rest of their session.

        ``failed`` files are due too when their retry time has come (see :meth:`upload_retry`):
        the returned row's ``upload_state`` is the one it had before it was claimed."""
        with self.transaction():
            r = self.conn.execute(
                f"SELECT * FROM files f WHERE {_DUE} AND next_attempt_at <= ?"
                " AND deleted = 0 AND (kind != 'session' OR NOT EXISTS (SELECT 1 FROM files g"
                " WHERE g.session = f.session AND g.kind != 'session'"
                " AND g.upload_state IN ('pending', 'uploading', 'failed')))"
                " ORDER BY (kind = 'session'), id LIMIT 1",
                (now,),
            ).fetchone()
            if r is None:
                return None
            self.conn.execute(
                "UPDATE files SET upload_state = 'uploading', attempts = attempts + 1 WHERE id = ?",
                (r["id"],),
            )
            d = dict(r)
            d["attempts"] += 1
            return d

    def upload_done(self, file_id: int, s3_uri: str) -> None:
        self.conn.execute(
            "UPDATE files SET upload_state = 'uploaded', s3_uri = ?, uploaded_at = ?,"
            " last_error = NULL WHERE id = ?",
            (s3_uri, time.time(), file_id),
        )

    def upload_retry(self, file_id: int, error: str, at: float, give_up: bool) -> None:
        """A failed attempt: the file is tried again at ``at``; with ``give_up`` it is
        ``failed`` (it used up its attempts), and ``at`` 0 means never again by itself."""
        self.conn.execute(
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
        return self.conn.execute(sql, args).rowcount

    def requeue_recovered(self, keep: Callable[[str], bool]) -> int:
        """The store is back after an outage: ``failed`` files that a retry can fix (and whose
        path ``keep`` accepts: the local file exists) go back to the queue with their attempts
        reset, and files waiting out a backoff become due now. Returns how many were failed."""
        rows = self.conn.execute(
            "SELECT id, path FROM files WHERE upload_state = 'failed' AND next_attempt_at > 0"
            " AND deleted = 0"
        ).fetchall()
        ids = [r["id"] for r in rows if keep(r["path"])]
        n = 0
        with self.transaction():
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                # A worker may have claimed one since: only rows still failed are requeued.
                n += self.conn.execute(
                    "UPDATE files SET upload_state = 'pending', next_attempt_at = 0, attempts = 0"
                    f" WHERE upload_state = 'failed' AND id IN ({','.join('?' * len(chunk))})",
                    chunk,
                ).rowcount
            self.conn.execute(
                "UPDATE files SET next_attempt_at = 0"
                " WHERE upload_state = 'pending' AND deleted = 0 AND next_attempt_at > 0"
            )
        return n

    def uploading(self) -> list[dict[str, Any]]:
        """Rows a worker held: at start-up, the uploads a dead daemon was in the middle of."""
        return [
            dict(r)
            for r in self.conn.execute(
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
                for r in self.conn.execute(
                    f"SELECT rel FROM files WHERE rel IN ({','.join('?' * len(chunk))})", chunk
                )
            )
        return out

    def next_upload_due(self, now: float) -> float | None:
        """When the earliest backed-off upload becomes due (None if nothing waits on a timer)."""
        r = self.conn.execute(
            f"SELECT MIN(next_attempt_at) AS at FROM files"
            f" WHERE {_DUE} AND deleted = 0 AND next_attempt_at > ?",
            (now,),
        ).fetchone()
        return float(r["at"]) if r["at"] is not None else None

    def queue_stats(self) -> dict[str, int]:
        r = self.conn.execute(
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
        r = self.conn.execute(
            "SELECT SUM(bytes) AS b FROM files"
            " WHERE upload_state IN ('pending','uploading','failed') AND deleted = 0"
        ).fetchone()
        return int(r["b"] or 0)
