"""The captures inbox: a client's report, kept before it is acked (written by the event loop)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from profd.store.index.db import Repo

#: ``inbox.done`` of a capture that is indexed while its raw trace still exists.
INBOX_RAW_LEFT = 2


class InboxRepo(Repo):
    def inbox_put(self, key: str, message: Mapping[str, Any]) -> bool:
        """Persist a client report before acking it; False if it was already received."""
        cur = self.conn.execute(
            "INSERT OR IGNORE INTO inbox (key, message, received_at) VALUES (?, ?, ?)",
            (key, json.dumps(message), time.time()),
        )
        return cur.rowcount == 1

    def inbox_done(self, key: str, raw_left: bool = False) -> None:
        """Processed; ``raw_left``: indexed, but its raw trace is not deleted yet."""
        self.conn.execute(
            "UPDATE inbox SET done = ? WHERE key = ?", (INBOX_RAW_LEFT if raw_left else 1, key)
        )

    def inbox_pending(self) -> list[tuple[str, dict[str, Any]]]:
        """Reports to (re)process."""
        return self._inbox(0)

    def inbox_raw_left(self) -> list[tuple[str, dict[str, Any]]]:
        """Indexed captures whose raw trace a killed daemon did not get to delete."""
        return self._inbox(INBOX_RAW_LEFT)

    def _inbox(self, done: int) -> list[tuple[str, dict[str, Any]]]:
        rows = self.conn.execute(
            "SELECT key, message FROM inbox WHERE done = ?", (done,)
        ).fetchall()
        return [(r["key"], json.loads(r["message"])) for r in rows]
