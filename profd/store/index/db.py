"""The connection to ``index.db`` every repository of the index shares, and its transactions.

One file in WAL mode so profctl-side readers and the daemon's upload workers never block the
event loop's writes. A connection is thread-local in use: each thread opens its own
:class:`Database` and builds the repositories it needs over it.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from profd import globs
from profd.store.index.schema import bring_up_to_date, check_readable


class Database:
    """One connection to the index; a writable one brings the file up to this schema."""

    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = path
        self.conn = _open_readonly(path) if readonly else _open_writable(path)
        self.conn.row_factory = sqlite3.Row

    def transaction(self) -> Transaction:
        """One commit for many writes, through any repository over this connection."""
        return Transaction(self.conn)

    def close(self) -> None:
        self.conn.close()


class Repo:
    """What every repository is: queries over one :class:`Database`'s connection."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self.conn = db.conn

    @property
    def db(self) -> Database:
        """The database it reads: other areas' repositories over the same connection (one
        read snapshot, one transaction) are made from it."""
        return self._db

    def transaction(self) -> Transaction:
        """One commit for many writes: those through other repositories over the same
        :class:`Database` are part of it too (they share its connection)."""
        return self._db.transaction()


def in_range(
    sql: str, since: float, until: float, job: str | None, job_column: str = "job"
) -> tuple[str, list[Any]]:
    """``sql``, whose WHERE clause ends bounding a column by ``>= ? AND < ?``, and its
    arguments, limited to ``job``'s rows too when one is given (a partition of the warehouse
    export: one day or hour, of every job or of one)."""
    if job is None:
        return sql, [since, until]
    return f"{sql} AND {job_column} = ?", [since, until, job]


class Transaction:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.outer = False

    def __enter__(self) -> None:
        # Nested inside another transaction: part of that one, which commits or rolls back.
        self.outer = not self.conn.in_transaction
        if self.outer:
            self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self.outer:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")


def _open_readonly(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    globs.register_sqlite(conn)
    try:
        check_readable(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


def _open_writable(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every job's sessions and paths are in it: the daemon's alone (profctl asks the daemon).
    # Created so before SQLite opens it; its -wal/-shm files copy the mode. Only when it is
    # not there: closing any descriptor of the file drops every POSIX lock this process
    # holds on it, those of the connections already open included (a thread's own
    # connection opened beside the loop's), and a process that then closes the last
    # connection it knows of deletes the WAL under them: committed writes lost.
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        pass
    os.chmod(path, 0o600)
    conn = sqlite3.connect(str(path), timeout=30.0, isolation_level=None)
    try:
        globs.register_sqlite(conn)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        with Transaction(conn):
            bring_up_to_date(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn
