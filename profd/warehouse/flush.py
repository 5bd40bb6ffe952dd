"""The export's flush process: ``python -m profd.warehouse.flush``, started by the daemon's
export thread (:mod:`profd.warehouse.export`) when partitions are dirty. It reads its job
(JSON, one object) on stdin, writes every dirty partition's object, unmarks each one written
(unless marked again meanwhile), and prints its result (JSON, one line) on stdout:
``{"objects", "rows", "bytes", "error"}``. It loads pyarrow so that the daemon never does,
and exits: a process the daemon keeps would keep pyarrow's memory too.

It dies with the daemon (``PR_SET_PDEATHSIG``): a restarted daemon's flush never races an
orphaned one's writes of the same objects. SIGTERM (the daemon stopping) ends it after the
object it is writing.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from profd.config import S3Config
from profd.daemon.runtime import faults
from profd.store import s3
from profd.store.index import Database, Mark, WarehouseQueueRepo
from profd.warehouse.build import Source, build
from profd.warehouse.sink import Sink, make_sink
from profd.warehouse.tables import expired, object_key

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def write_dirty(
    repo: WarehouseQueueRepo,
    sink: Sink,
    node: str,
    stem: str,
    keep: tuple[float, int, int],
    stopping: threading.Event,
    done: dict[str, Any],
) -> None:
    """Every dirty partition not past its retention (``keep``: now, keep_days,
    keep_rank_days) written, partition by partition, counted in ``done`` (``objects``,
    ``rows``, ``bytes``) as they are: a failure leaves the counts of those written before."""
    now, keep_days, keep_rank_days = keep
    by_part: dict[str, list[str]] = {}
    for mark in repo.marks():
        if not expired(mark.table, mark.part, now, keep_days, keep_rank_days):
            by_part.setdefault(mark.part, []).append(mark.table)
    for part, tables in by_part.items():
        if stopping.is_set():
            break
        n, size = _write(repo, sink, node, stem, part, tables)
        done["objects"] += len(tables)
        done["rows"] += n
        done["bytes"] += size


def _write(
    repo: WarehouseQueueRepo, sink: Sink, node: str, stem: str, part: str, tables: list[str]
) -> tuple[int, int]:
    """One partition's objects: the marks' gens and the rows read in one snapshot (the
    capture tables of an hour share one read of its traces), then each object written
    and its mark removed, unless marked again meanwhile."""
    # Imported here, once main() refused what pyarrow would import and never use.
    from profd.warehouse.arrow import arrow_table, parquet_bytes

    built: list[tuple[Mark, Any]] = []
    with repo.snapshot():
        src = Source(repo, node)
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
        repo.written(mark)
        rows, nbytes = rows + table.num_rows, nbytes + len(data)
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


#: What pyarrow would import and this process never uses: pandas, on the first array made
#: of Python objects, only to ask whether they are pandas objects (~0.3 s of CPU and ~50 MB
#: at each flush); numpy, at ``import pyarrow`` (~0.06 s, ~10 MB). pyarrow works without
#: either, taking Python objects as plain sequences.
UNUSED = ("pandas", "numpy")


class _Refuse(importlib.abc.MetaPathFinder):
    """``import`` of :data:`UNUSED` fails in this process, as if they were not installed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.partition(".")[0] in UNUSED:
            raise ModuleNotFoundError(f"{fullname}: not used by the flush process")


def main() -> int:
    sys.meta_path.insert(0, _Refuse())
    job = json.loads(sys.stdin.read())
    _die_with(int(job["daemon_pid"]))
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda _s, _f: stopping.set())
    result: dict[str, Any] = {"objects": 0, "rows": 0, "bytes": 0, "error": None}
    db = Database(Path(job["index"]))
    try:
        sink = make_sink(job["url"], S3Config(**job["s3"]))
        keep = (float(job["now"]), int(job["keep_days"]), int(job["keep_rank_days"]))
        repo = WarehouseQueueRepo(db)
        write_dirty(repo, sink, job["node"], job["stem"], keep, stopping, result)
    except Exception as exc:
        result["error"] = s3.describe(exc)
    finally:
        db.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
