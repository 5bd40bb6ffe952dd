"""What the daemon could not write, and where: the one owner of "the disk is full".

Every writer that hits a full disk (the index in the state dir, the pipeline and
``session.json`` in the spool) keeps its work for a later try and tells :class:`Storage`,
which logs the first failure and the recovery once, and is what ``profctl status`` shows
under ``storage``. Nothing here retries: each writer owns its retry.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("profd.storage")

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def is_disk_full(exc: BaseException) -> bool:
    """Out of space or quota: an ``OSError`` saying so, or SQLite's ``SQLITE_FULL``."""
    if isinstance(exc, OSError):
        return exc.errno in _FULL_ERRNOS
    if isinstance(exc, sqlite3.OperationalError):
        # The result code, its primary part: never the message's text. SQLite's own errors
        # carry it (Python 3.11+); one raised by Python code has none, and is no full disk.
        code = getattr(exc, "sqlite_errorcode", None)
        return code is not None and code & 0xFF == sqlite3.SQLITE_FULL
    return False


def describe(exc: BaseException, where: Path | None = None) -> str:
    """One line for a write error; a full disk says ``disk full`` first, with the place."""
    if is_disk_full(exc):
        place = f" in {where}" if where is not None else ""
        return f"disk full{place} ({exc})"
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Problem:
    reason: str
    since: float
    count: int = 1


class Storage:
    """Write problems by area: ``index`` (the state dir) and ``spool``."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs
        self.problems: dict[str, Problem] = {}

    def failed(self, area: str, exc: BaseException, what: str) -> str:
        """Record that ``what`` could not be written in ``area``; the one-line reason."""
        why = describe(exc, self.dirs.get(area))
        p = self.problems.get(area)
        if p is None:
            self.problems[area] = Problem(why, time.time())
            log.error("cannot write %s: %s; it waits until the write succeeds", what, why)
        else:
            p.reason = why
            p.count += 1
        return why

    def ok(self, area: str) -> None:
        """A write to ``area`` succeeded: its problem, if any, is over."""
        p = self.problems.pop(area, None)
        if p is not None:
            log.info("%s writable again after %.0fs (%d failed writes)", area, _ago(p), p.count)

    def status(self) -> dict[str, Any]:
        return {
            "ok": not self.problems,
            "problems": {
                area: {"error": p.reason, "since": p.since, "failed_writes": p.count}
                for area, p in self.problems.items()
            },
            "free_bytes": {area: _free(d) for area, d in self.dirs.items()},
        }


def _ago(p: Problem) -> float:
    return time.time() - p.since


def _free(d: Path) -> int | None:
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
