"""The warehouse export's queue (``warehouse_dirty``: partitions whose rows changed since
their object was written, marked by the index's own triggers, see :mod:`.schema`) and its
days. The rows of a partition are read by each area's own repository (``TraceRepo``,
``StepMinuteRepo``, ``IncidentRepo``) over the same connection, in :meth:`snapshot`.

The exporter reads a mark's ``gen`` and the partition's rows in one read transaction, writes
the object, then calls :meth:`WarehouseQueueRepo.written`: the mark goes only if nobody
marked the partition again meanwhile, so rows indexed during a write are exported by the
next flush, never lost.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from profd.store.index.db import Repo


class Mark(NamedTuple):
    table: str
    part: str
    gen: int


class WarehouseQueueRepo(Repo):
    @property
    def db_path(self) -> Path:
        """The index file: the export's flush process opens a connection of its own to it."""
        return self._db.path

    def marks(self) -> list[Mark]:
        """Every dirty partition, oldest first."""
        rows = self.conn.execute("SELECT tbl, part, gen FROM warehouse_dirty ORDER BY part, tbl")
        return [Mark(str(r[0]), str(r[1]), int(r[2])) for r in rows.fetchall()]

    # fetchall, never fetchone: a statement left unfinished holds its read snapshot in WAL
    # mode, and the export thread's connection would see the index as it was, for good.
    def pending(self) -> int:
        ((n,),) = self.conn.execute("SELECT count(*) FROM warehouse_dirty").fetchall()
        return int(n)

    def gen(self, table: str, part: str) -> int | None:
        rows = self.conn.execute(
            "SELECT gen FROM warehouse_dirty WHERE tbl = ? AND part = ?", (table, part)
        ).fetchall()
        return int(rows[0][0]) if rows else None

    def day_marks(self, table: str, date: str) -> list[Mark]:
        """The marks of ``table``'s hours of ``date``."""
        rows = self.conn.execute(
            "SELECT part, gen FROM warehouse_dirty WHERE tbl = ? AND part >= ? AND part < ?",
            (table, date + "/", date + "0"),
        ).fetchall()
        return [Mark(table, str(r[0]), int(r[1])) for r in rows]

    def written(self, mark: Mark) -> bool:
        """The partition's object now holds the rows read at ``mark.gen``: unmark it, unless
        it was marked again since (False: it stays for the next flush)."""
        with self.transaction():
            cur = self.conn.execute(
                "DELETE FROM warehouse_dirty WHERE tbl = ? AND part = ? AND gen = ?",
                (mark.table, mark.part, mark.gen),
            )
            return cur.rowcount > 0

    # --- the days of the hourly tables, and their seals (profd/warehouse/flush.py) ----------
    def record_day(self, table: str, date: str) -> None:
        """An hourly object of ``table`` for ``date`` was written: the day is to be sealed."""
        with self.transaction():
            self.conn.execute(
                "INSERT OR IGNORE INTO warehouse_days (tbl, date) VALUES (?, ?)", (table, date)
            )

    def unsealed_days(self) -> list[tuple[str, str]]:
        """(table, date) of every day with hourly objects and no day object yet, oldest first."""
        rows = self.conn.execute(
            "SELECT tbl, date FROM warehouse_days WHERE sealed_at IS NULL ORDER BY date, tbl"
        ).fetchall()
        return [(str(r[0]), str(r[1])) for r in rows]

    def sealed_days(self) -> set[tuple[str, str]]:
        """(table, date) of every day whose day object was written: it takes the day's rows."""
        rows = self.conn.execute(
            "SELECT tbl, date FROM warehouse_days WHERE sealed_at IS NOT NULL"
        ).fetchall()
        return {(str(r[0]), str(r[1])) for r in rows}

    def sealed(self, table: str, date: str, at: float) -> None:
        """``table``'s day object of ``date`` was written (first, or again): it is this
        node's, not a fleet object's, until the next merge."""
        with self.transaction():
            self.conn.execute(
                "INSERT INTO warehouse_days (tbl, date, sealed_at) VALUES (?, ?, ?)"
                " ON CONFLICT (tbl, date) DO UPDATE SET sealed_at = COALESCE(sealed_at, ?),"
                " merged_at = NULL",
                (table, date, at, at),
            )

    def unmerged(self, before: str) -> list[tuple[str, str]]:
        """(table, date) of the days before ``before`` whose day object this node has
        written and not handed over to a fleet object, oldest first."""
        rows = self.conn.execute(
            "SELECT tbl, date FROM warehouse_days WHERE sealed_at IS NOT NULL"
            " AND merged_at IS NULL AND date < ? ORDER BY date, tbl",
            (before,),
        ).fetchall()
        return [(str(r[0]), str(r[1])) for r in rows]

    def merged(self, table: str, date: str, at: float) -> None:
        """This node's day object of ``table``'s ``date`` is gone, a fleet object holds it."""
        with self.transaction():
            self.conn.execute(
                "UPDATE warehouse_days SET merged_at = ? WHERE tbl = ? AND date = ?",
                (at, table, date),
            )

    def unswept(self, sealed_before: float) -> list[tuple[str, str]]:
        """(table, date) of the days sealed before ``sealed_before`` whose hourly objects
        are not deleted yet."""
        rows = self.conn.execute(
            "SELECT tbl, date FROM warehouse_days WHERE sealed_at <= ? AND swept_at IS NULL"
            " ORDER BY date, tbl",
            (sealed_before,),
        ).fetchall()
        return [(str(r[0]), str(r[1])) for r in rows]

    def swept(self, table: str, date: str, at: float) -> None:
        with self.transaction():
            self.conn.execute(
                "UPDATE warehouse_days SET swept_at = ? WHERE tbl = ? AND date = ?",
                (at, table, date),
            )

    def forget_days(self, table: str, before: str) -> None:
        """The days of ``table`` before ``before`` (past retention) forgotten."""
        with self.transaction():
            self.conn.execute(
                "DELETE FROM warehouse_days WHERE tbl = ? AND date < ?", (table, before)
            )

    def drop(self, table: str, part: str) -> None:
        """Forget a mark whatever its gen (a partition past its retention)."""
        self.conn.execute("DELETE FROM warehouse_dirty WHERE tbl = ? AND part = ?", (table, part))

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """One read transaction: a mark's gen and its rows are read as of one moment."""
        if self.conn.in_transaction:
            yield
            return
        self.conn.execute("BEGIN")
        try:
            yield
        finally:
            self.conn.execute("COMMIT")
