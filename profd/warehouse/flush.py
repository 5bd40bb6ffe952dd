"""The export's flush process: ``python -m profd.warehouse.flush``, started by the daemon's
export thread (:mod:`profd.warehouse.export`) when partitions are dirty. It reads its job
(JSON, one object) on stdin, writes every dirty partition's object, unmarks each one written
(unless marked again meanwhile), seals the closed days and sweeps what the seals superseded
(:mod:`profd.warehouse.seal`), and prints its result (JSON, one line) on stdout:
``{"objects", "rows", "bytes", "sealed", "swept", "error"}``. It loads pyarrow so that the
daemon never does, and exits: a process the daemon keeps would keep pyarrow's memory too.

It dies with the daemon (``PR_SET_PDEATHSIG``): a restarted daemon's flush never races an
orphaned one's writes of the same objects. SIGTERM (the daemon stopping) ends it after the
object it is writing.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd.config import S3Config
from profd.daemon.runtime import faults
from profd.store import s3
from profd.store.index import Database, Mark, WarehouseQueueRepo
from profd.warehouse.build import Source, build
from profd.warehouse.lean import refuse
from profd.warehouse.seal import Merging, Seals, due
from profd.warehouse.sink import Sink, make_sink
from profd.warehouse.tables import HOURLY, RANK_DAYS, TABLES, cutoff_date, expired, object_key

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: Days of tables newly sealed by one flush (module :mod:`profd.warehouse.seal`).
SEALS_PER_FLUSH = 1


@dataclass(frozen=True)
class Policy:
    """What the daemon's job says about time: ``now``, the retention and the seals."""

    now: float
    keep_days: int
    keep_rank_days: int
    seals: Seals
    #: Seconds after an hour or a date ends before its objects are merged into fleet
    #: objects (None: never).
    merge_after: float | None = None
    #: Whether this flush also looks at the open days' hours (the exporter says so every
    #: few minutes, not every flush: each look lists a folder).
    merge_hours: bool = False

    def expired(self, table: str, part: str) -> bool:
        return expired(table, part, self.now, self.keep_days, self.keep_rank_days)


def write_dirty(
    repo: WarehouseQueueRepo,
    sink: Sink,
    node: str,
    stem: str,
    policy: Policy,
    stopping: threading.Event,
    done: dict[str, Any],
) -> None:
    """Every dirty partition not past its retention written, partition by partition; then
    each closed day sealed, and the hourly objects of days sealed ``sweep_after`` ago
    deleted (module :mod:`profd.warehouse.seal`). Counted in ``done`` (``objects``,
    ``rows``, ``bytes``, ``sealed``, ``swept``) as they are: a failure leaves the counts of
    those done before."""
    now, seals = policy.now, policy.seals
    sealed = repo.sealed_days()
    # One new seal per flush (the oldest): a day of a busy node's capture tables is most of a
    # minute of this process's time, and the rows indexed meanwhile wait for the next flush.
    to_seal = set(due(repo.unsealed_days(), seals, now, policy.expired)[:SEALS_PER_FLUSH])
    days: dict[str, list[str]] = {}
    by_part: dict[str, list[str]] = {}
    for mark in repo.marks():
        if policy.expired(mark.table, mark.part):
            continue
        day = (mark.table, mark.part[:10])
        if mark.table in HOURLY and (
            day in sealed or day in to_seal or seals.sealable(day[1], now)
        ):
            # A sealed day's object takes its changes; a closed day's rows that come late
            # (a daemon that was down) go straight into it, never into hourly objects.
            to_seal.add(day)
        else:
            by_part.setdefault(mark.part, []).append(mark.table)
    for table, date in to_seal:
        days.setdefault(date, []).append(table)
    for part, tables in by_part.items():
        if stopping.is_set():
            return
        n, size = _write(repo, sink, node, stem, part, tables, now)
        _count(done, objects=len(tables), rows=n, bytes=size)
    for date, tables in sorted(days.items()):
        if stopping.is_set():
            return
        n, size = _write_days(repo, sink, node, stem, date, sorted(tables), now)
        new_seals = sum((t, date) not in sealed for t in tables)
        _count(done, objects=len(tables), rows=n, bytes=size, sealed=new_seals)
    for table, date in repo.unswept(now - seals.sweep_after):
        if stopping.is_set():
            return
        sink.delete_hours(table, date, stem)
        repo.swept(table, date, now)
        _count(done, swept=1)
    for table in TABLES:
        repo.forget_days(table, cutoff_date(now, retention_days(table, policy)))
    if policy.merge_after is not None and not stopping.is_set():
        merging = Merging.of(policy.merge_after, seals.sweep_after)
        _merge(repo, sink, stem, policy, merging, stopping, done)


def _merge(
    repo: WarehouseQueueRepo,
    sink: Sink,
    stem: str,
    policy: Policy,
    merging: Merging,
    stopping: threading.Event,
    done: dict[str, Any],
) -> None:
    """This node's part in the fleet objects (module :mod:`profd.warehouse.merge`)."""
    from profd.warehouse.merge import tend

    now = policy.now
    days = [d for d in repo.unmerged(merging.cutoff(now)) if not policy.expired(*d)]
    # Open days (today, and yesterday until its seal): their hours go into fleet objects
    # while the day goes on, each looked at whenever the exporter says it is time.
    opened = [d for d in repo.unsealed_days() if not policy.expired(*d) and d not in days]
    counts = tend(
        days,
        sink,
        stem,
        merging,
        now,
        lambda t, d: repo.merged(t, d, now),
        stopping.is_set,
        always=opened if policy.merge_hours else None,
    )
    _count(done, **counts)


def retention_days(table: str, policy: Policy) -> int:
    return policy.keep_rank_days if table in RANK_DAYS else policy.keep_days


def _count(done: dict[str, Any], **more: int) -> None:
    for k, v in more.items():
        done[k] = done.get(k, 0) + v


def _write(
    repo: WarehouseQueueRepo,
    sink: Sink,
    node: str,
    stem: str,
    part: str,
    tables: list[str],
    now: float,
) -> tuple[int, int]:
    """One partition's objects: the marks' gens and the rows read in one snapshot (the
    capture tables of an hour share one read of its traces), then each object written
    and its mark removed, unless marked again meanwhile."""
    # Imported here, once main() refused what pyarrow would import and never use.
    from profd.warehouse.arrow import arrow_table, parquet_bytes

    built: list[tuple[Mark, Any]] = []
    with repo.snapshot():
        src = Source.of(repo.db, node)
        for table in tables:
            gen = repo.gen(table, part)
            if gen is not None:
                built.append((Mark(table, part, gen), arrow_table(table, build(table, part, src))))
    rows = nbytes = 0
    for mark, table in built:
        data = parquet_bytes(table)
        sink.put(object_key(mark.table, mark.part, stem), data)
        # The crash switch kills the daemon (our parent: _die_with checked) and then this
        # process, both before the unmark.
        faults.point("warehouse-written", os.getppid())
        faults.point("warehouse-written")
        if mark.table in HOURLY:
            repo.record_day(mark.table, mark.part[:10])
        else:
            # A daily table's object is its day object from the start: nothing to seal or
            # sweep, a day to merge once closed.
            repo.sealed(mark.table, mark.part, now)
            repo.swept(mark.table, mark.part, now)
        repo.written(mark)
        rows, nbytes = rows + table.num_rows, nbytes + len(data)
    return rows, nbytes


def _write_days(
    repo: WarehouseQueueRepo,
    sink: Sink,
    node: str,
    stem: str,
    date: str,
    tables: list[str],
    now: float,
) -> tuple[int, int]:
    """The day objects of ``tables`` for ``date``: every hour's rows read in one snapshot
    with the marks of the day's hours, each table's day written hour by hour into one file
    (an hour's rows in memory at a time), then put, the day recorded as sealed, and the
    marks removed unless marked again meanwhile."""
    from profd.warehouse.arrow import DayWriter, arrow_table

    writers = {t: DayWriter(t) for t in tables}
    with repo.snapshot():
        marks = {t: repo.day_marks(t, date) for t in tables}
        for hour in range(24):
            src = Source.of(repo.db, node)  # one hour's traces at a time
            for t in tables:
                writers[t].add(arrow_table(t, build(t, f"{date}/{hour:02d}", src)))
    rows = nbytes = 0
    for t in tables:
        data = writers[t].finish()
        sink.put(object_key(t, date, stem), data)
        faults.point("warehouse-written", os.getppid())
        faults.point("warehouse-written")
        repo.sealed(t, date, now)
        for mark in marks[t]:
            repo.written(mark)
        rows, nbytes = rows + writers[t].rows, nbytes + len(data)
    return rows, nbytes


def _die_with(daemon_pid: int) -> None:
    """Killed when the daemon dies, however it dies; gone at once if it already has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != daemon_pid:
        os._exit(1)


#: What pyarrow would import and this process never uses (module :mod:`.lean`).
UNUSED = ("pandas", "numpy")


def main() -> int:
    refuse(UNUSED, "the flush process")
    job = json.loads(sys.stdin.read())
    _die_with(int(job["daemon_pid"]))
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda _s, _f: stopping.set())
    result: dict[str, Any] = {
        "objects": 0, "rows": 0, "bytes": 0, "sealed": 0, "swept": 0, "merged": 0,
        "handed": 0, "error": None,
    }  # fmt: skip
    db = Database(Path(job["index"]))
    try:
        sink = make_sink(job["url"], S3Config(**job["s3"]))
        policy = Policy(
            float(job["now"]),
            int(job["keep_days"]),
            int(job["keep_rank_days"]),
            Seals(float(job["seal_after"]), float(job["sweep_after"])),
            None if job.get("merge_after") is None else float(job["merge_after"]),
            bool(job.get("merge_hours", False)),
        )
        repo = WarehouseQueueRepo(db)
        write_dirty(repo, sink, job["node"], job["stem"], policy, stopping, result)
    except Exception as exc:
        result["error"] = s3.describe(exc)
    finally:
        db.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
