"""The warehouse export: a worker thread that, every ``flush_every`` seconds, rewrites the
object of each partition the index marked dirty (``warehouse_dirty``), then unmarks it.

Off the event loop: the thread has its own index connection (as upload workers do). The
objects themselves are built and written by a short-lived process (:mod:`profd.warehouse.flush`),
started only when some partition is dirty and gone once it has written them: Parquet needs
pyarrow (~50 MB resident once loaded), which the daemon itself never loads. That process
reads each partition's rows and its mark's ``gen`` in one read transaction. A mark goes only
once its object is written and only if its ``gen`` did not change meanwhile, so:

* a daemon or flush process killed at any point leaves its marks, and the next flush writes
  those partitions again, whole: nothing lost, nothing twice (an object is replaced, never
  appended to). The flush process dies with the daemon (``PR_SET_PDEATHSIG``), so a
  restarted daemon's flush never races an orphaned one;
* a write that fails (store unreachable, disk full, anything) leaves the marks; the flush
  stops there and the next one is tried after a backoff that doubles up to
  :data:`BACKOFF_MAX_S`. The first failure of an outage is logged, and the recovery.

Once a day it deletes the date partitions past ``keep_days`` (``keep_rank_days`` for
``rank_minutes``): every writer's objects of such a date, not only this node's, so the
objects of a retired or reimaged node (whose stem no daemon writes any more) go too. A
date past retention is never written again (its marks are dropped unwritten), so deleting
it whole races with nobody; the fleet's smallest ``keep_days`` wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from profd.config import Config
from profd.store import s3
from profd.store.index import Database, WarehouseQueueRepo
from profd.warehouse.build import Source, build
from profd.warehouse.instance import instance_id
from profd.warehouse.seal import Merging, Seals, due, overlay_part
from profd.warehouse.sink import Sink, make_sink
from profd.warehouse.tables import RANK_DAYS, TABLES, cutoff_date, expired, writer_stem

log = logging.getLogger("profd.warehouse")

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 300.0
RETENTION_EVERY_S = 86400.0
#: How often a day of this node waiting for the fleet starts a flush of its own.
MERGE_CHECK_EVERY_S = 600.0
STOP_JOIN_S = 10.0


class FlushFailed(Exception):
    """The flush process's error, in its words, or how it ended without saying."""


class Exporter:
    def __init__(
        self, cfg: Config, sink: Sink | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        wh = cfg.warehouse
        assert wh.url is not None
        self.cfg = cfg
        self.url = wh.url
        self.flush_every = wh.flush_every
        self.keep_days = wh.keep_days
        self.keep_rank_days = wh.keep_rank_days
        self.seals = Seals(wh.seal_after, wh.sweep_after)
        self.merging = Merging.of(wh.merge_after, wh.sweep_after) if wh.merge else None
        self._merge_check_at = 0.0
        self._hours_check_at = 0.0
        self.node = cfg.node_name
        self.instance = instance_id(cfg.state_dir)
        self.stem = writer_stem(self.node, self.instance)
        self.sink = sink if sink is not None else make_sink(self.url, cfg.s3)
        self.clock = clock
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._db: Database | None = None
        self._child: subprocess.Popen[bytes] | None = None  # the flush process, while it runs
        # Counters, guarded by _lock (read by status() on the event loop).
        self._pending = 0
        self._flushes = 0
        self._objects = 0
        self._rows = 0
        self._bytes = 0
        self._errors = 0
        self._failing = 0  # flushes failed in a row: the outage's length
        self._last_flush_at: float | None = None
        self._last_flush_cpu_s: float | None = None
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._retention_due = 0.0
        self._deleted = 0
        self._sealed = 0
        self._swept = 0
        self._merged = 0
        self._handed = 0
        self._hours_handed = 0

    # --- lifecycle (event loop) ----------------------------------------------------------------
    def start(self) -> None:
        log.info("warehouse export to %s as %s every %gs", self.url, self.stem, self.flush_every)
        self._thread = threading.Thread(target=self._run, name="profd-warehouse", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        child = self._child
        if child is not None:
            # It stops after the object it is writing; one it leaves marked is written by
            # the next daemon.
            with contextlib.suppress(OSError):
                child.send_signal(signal.SIGTERM)
        if self._thread is not None:
            self._thread.join(STOP_JOIN_S)
            if self._thread.is_alive():
                log.info("warehouse export still writing at shutdown; the next start redoes it")

    def kick(self) -> None:
        """Flush now rather than at the next ``flush_every`` (tests, benchmarks)."""
        self._wake.set()

    def status(self, repo: WarehouseQueueRepo | None = None) -> dict[str, Any]:
        """The counters; ``pending_partitions`` counted now on ``repo`` (the caller's
        connection) when given: the last flush's count is up to ``flush_every`` old, and
        rows indexed since are pending too."""
        pending: int | None = None
        if repo is not None:
            try:
                pending = repo.pending()
            except sqlite3.Error as exc:  # a locked index: the last flush's count
                log.debug("warehouse: cannot count the marks: %s", exc)
        with self._lock:
            return {
                "enabled": True,
                "url": self.url,
                "stem": self.stem,
                "flush_every": self.flush_every,
                "pending_partitions": self._pending if pending is None else pending,
                "flushes": self._flushes,
                "objects_written": self._objects,
                "rows_written": self._rows,
                "bytes_written": self._bytes,
                "last_flush_at": self._last_flush_at,
                "last_flush_cpu_s": self._last_flush_cpu_s,
                "errors": self._errors,
                "failing": self._failing > 0,
                "last_error": self._last_error,
                "last_error_at": self._last_error_at,
                "retention_deleted": self._deleted,
                "days_sealed": self._sealed,
                "days_swept": self._swept,
                "fleet_objects_written": self._merged,
                "days_handed_to_fleet": self._handed,
                "hour_hand_overs": self._hours_handed,
            }

    # --- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        db = self._db = Database(self.cfg.index_path)
        repo = WarehouseQueueRepo(db)
        try:
            while not self._stopping.is_set():
                ok = self.flush(repo)
                if ok:
                    self.retention()
                wait = self.flush_every if ok else self._backoff()
                self._wake.wait(wait)
                self._wake.clear()
        finally:
            db.close()

    def _backoff(self) -> float:
        with self._lock:
            n = self._failing
        return float(min(BACKOFF_MAX_S, max(self.flush_every, BACKOFF_MIN_S * 2 ** (n - 1))))

    def flush(self, repo: WarehouseQueueRepo) -> bool:
        """Write every dirty partition; False if a write failed (the rest waits)."""
        cpu0 = time.thread_time()
        child_cpu = 0.0
        now = self.clock()
        objects = rows = nbytes = 0
        error: BaseException | None = None
        try:
            for mark in repo.marks():
                if self._expired(mark.table, mark.part, now):
                    repo.drop(mark.table, mark.part)
            hours = self._hours_due(repo, now)
            due = (
                repo.pending() or self._seals_due(repo, now) or self._merges_due(repo, now) or hours
            )
            if due and not self._stopping.is_set():
                res, child_cpu = self._flush_process(repo.db_path, now, hours)
                objects, rows, nbytes = int(res["objects"]), int(res["rows"]), int(res["bytes"])
                with self._lock:
                    self._sealed += int(res.get("sealed", 0))
                    self._merged += int(res.get("merged", 0))
                    self._handed += int(res.get("handed", 0))
                    self._hours_handed += int(res.get("hours", 0))
                    self._swept += int(res.get("swept", 0))
                if res["error"]:
                    raise FlushFailed(str(res["error"]))
            pending = repo.pending()
        except Exception as exc:
            error = exc
            try:
                pending = repo.pending()
            except Exception:
                pending = -1
        cpu = time.thread_time() - cpu0 + child_cpu
        self._flushed(now, cpu, objects, rows, nbytes, pending, error)
        return error is None

    def _seals_due(self, repo: WarehouseQueueRepo, now: float) -> bool:
        """A closed day to seal, or a sealed day's hourly objects to delete."""
        if repo.unswept(now - self.seals.sweep_after):
            return True

        def expired(table: str, date: str) -> bool:
            return self._expired(table, date, now)

        return bool(due(repo.unsealed_days(), self.seals, now, expired))

    def _merges_due(self, repo: WarehouseQueueRepo, now: float) -> bool:
        """A closed day of this node's not in a fleet object yet. While there are, a flush
        of their own starts no more often than every :data:`MERGE_CHECK_EVERY_S` (or a
        quarter of the grace period, if shorter): a day waits out its grace period, and
        each look is a process that loads pyarrow."""
        if self.merging is None or now < self._merge_check_at:
            return False
        if not repo.unmerged(self.merging.cutoff(now)):
            return False
        self._merge_check_at = now + self._merge_check_every()
        return True

    def _hours_due(self, repo: WarehouseQueueRepo, now: float) -> bool:
        """Time for a look at the open days' hours (:mod:`profd.warehouse.merge`): as
        often as at closed days, while this node has open days."""
        if self.merging is None or now < self._hours_check_at or not repo.unsealed_days():
            return False
        self._hours_check_at = now + self._merge_check_every()
        return True

    def _merge_check_every(self) -> float:
        assert self.merging is not None
        return max(self.flush_every, min(MERGE_CHECK_EVERY_S, self.merging.grace / 4))

    def _flush_process(
        self, index: Path, now: float, merge_hours: bool = False
    ) -> tuple[dict[str, Any], float]:
        """Run :mod:`profd.warehouse.flush` on the marks there are: its result (the
        objects, rows and bytes it wrote, and its error or None) and the CPU seconds it
        took. :class:`FlushFailed` if it ended without a result or not cleanly."""
        job = {
            "index": str(index),
            "url": self.url,
            "s3": dataclasses.asdict(self.cfg.s3),
            "node": self.node,
            "stem": self.stem,
            "keep_days": self.keep_days,
            "keep_rank_days": self.keep_rank_days,
            "seal_after": self.seals.seal_after,
            "sweep_after": self.seals.sweep_after,
            "merge_after": self.merging.merge_after if self.merging is not None else None,
            "merge_hours": merge_hours,
            "now": now,
            "daemon_pid": os.getpid(),
        }
        child = subprocess.Popen(
            # -P: nothing from the daemon's working directory is imported.
            [sys.executable, "-P", "-m", "profd.warehouse.flush"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self._child = child
        try:
            assert child.stdin is not None and child.stdout is not None
            with contextlib.suppress(BrokenPipeError):  # it died at once: its exit says why
                child.stdin.write(json.dumps(job).encode())
                child.stdin.close()
            out = child.stdout.read()
            child.stdout.close()
            # Reaped here rather than by Popen.wait: wait4 gives this child's own CPU.
            _, status, ru = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
        finally:
            self._child = None
        cpu = ru.ru_utime + ru.ru_stime
        try:
            res = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError, UnicodeDecodeError):
            raise FlushFailed(f"flush process ended with {_exit(child.returncode)}") from None
        if child.returncode != 0 and not res.get("error"):
            res["error"] = f"flush process ended with {_exit(child.returncode)}"
        return res, cpu

    def _expired(self, table: str, part: str, now: float) -> bool:
        return expired(table, part, now, self.keep_days, self.keep_rank_days)

    def _flushed(
        self,
        now: float,
        cpu: float,
        objects: int,
        rows: int,
        nbytes: int,
        pending: int,
        error: BaseException | None,
    ) -> None:
        with self._lock:
            self._flushes += 1
            self._objects += objects
            self._rows += rows
            self._bytes += nbytes
            self._pending = pending
            self._last_flush_cpu_s = round(cpu, 6)
            if error is None:
                self._last_flush_at = now
                recovered, self._failing = self._failing, 0
            else:
                self._errors += 1
                self._failing += 1
                self._last_error = (
                    str(error) if isinstance(error, FlushFailed) else s3.describe(error)
                )
                self._last_error_at = now
                first = self._failing == 1
        if error is not None:
            if first:
                log.warning(
                    "warehouse: cannot write to %s (%s); %d partition(s) kept to retry",
                    self.url,
                    self._last_error,
                    pending,
                )
            else:
                log.debug("warehouse: still failing: %s", self._last_error)
        elif recovered:
            log.info(
                "warehouse: writing to %s again after %d failed flush(es)", self.url, recovered
            )

    def retention(self) -> None:
        """Once a day: delete the date partitions past their retention (module doc)."""
        now = self.clock()
        if now < self._retention_due:
            return
        self._retention_due = now + RETENTION_EVERY_S
        deleted = 0
        try:
            for table in TABLES:
                days = self.keep_rank_days if table in RANK_DAYS else self.keep_days
                cut = cutoff_date(now, days)
                for date in self.sink.dates(table):
                    if date < cut:
                        deleted += self.sink.delete_date(table, date, None)
        except Exception as exc:
            self._retention_due = now + 3600.0  # tried again in an hour, not a day
            log.warning("warehouse: retention: %s", s3.describe(exc))
        with self._lock:
            self._deleted += deleted
        if deleted:
            log.info("warehouse: deleted %d object(s) past retention", deleted)

    # --- unflushed rows, for readers on this node (event loop) --------------------------------
    def overlays(self, repo: WarehouseQueueRepo, job: str | None = None) -> list[dict[str, Any]]:
        """Each dirty partition's rows as its object will hold them (a list per column), for
        a reader to use in place of that object; a sealed day of an hourly table as the
        whole day (:func:`profd.warehouse.seal.overlay_part`). ``repo`` is the caller's
        connection."""
        out: list[dict[str, Any]] = []
        now = self.clock()
        seen: set[tuple[str, str]] = set()
        with repo.snapshot():
            src = Source.of(repo.db, self.node, job)
            sealed = repo.sealed_days()
            for mark in repo.marks():
                if self._expired(mark.table, mark.part, now):
                    continue
                part = overlay_part(mark.table, mark.part, sealed, self.seals, now)
                if (mark.table, part) in seen:
                    continue
                seen.add((mark.table, part))
                out.append(
                    {
                        "table": mark.table,
                        "part": part,
                        "stem": self.stem,
                        "columns": build(mark.table, part, src),
                    }
                )
        return out

    def describe(self) -> dict[str, Any]:
        """The ``warehouse`` request's answer, less its overlays."""
        return {
            "url": self.url,
            "node": self.node,
            "instance": self.instance,
            "stem": self.stem,
            "flush_every": self.flush_every,
        }


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {-code}"
    return f"exit code {code}"
