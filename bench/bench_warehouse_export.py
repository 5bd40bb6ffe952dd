"""The warehouse export's cost: CPU per flush at 1,024 ranks and one capture a second, and the
bytes a rank-day of ``rank_minutes`` takes.

A real ``index.db`` is fed as the daemon feeds it: every simulated minute, one closed minute
for each of 1,024 ranks (``StepMinuteRepo.add_step_minutes``, one transaction) and 60
captures, one a second, each a trace row with its statistics (``TraceRepo.add_trace``: 8
steps, 20 CPU operators, 20 GPU kernels, 4 collectives, as ``rankstats`` keeps them). After
each minute the exporter flushes once (``Exporter.flush``, to a local directory), and the
CPU time of that flush is taken: this process's (``time.process_time``) plus its reaped
children's (``RUSAGE_CHILDREN``), i.e. the flush process the export starts, with its
interpreter start and imports, and Arrow's own threads in it.
The current hour's capture objects are rewritten whole at each flush and grow through the
hour, so the flush is measured at several points of the day: the index is first filled with
that many hours of captures, one a second, then ``--minutes`` live minutes are fed and
flushed (half past an hour: the average flush; five to the hour: the largest).

Once a day each node seals the day that closed (one object per hourly table for the whole
day): ``seal_day`` fills a whole day (captures one a second, every rank's minutes), flushes
it hour by hour as the day goes, then flushes an hour after midnight until every hourly
table's day is sealed (one a flush), and takes those flushes' CPU, the longest one's wall
time (what rows indexed meanwhile wait) and the flush processes' peak memory.

Targets: export <= 1 % of a core (CPU per flush / ``flush_every`` 60 s); <= 64 KiB per
rank-day of ``rank_minutes`` (one hour of 1,024 ranks written, x 24 / 1,024).
"""

from __future__ import annotations

import dataclasses
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B

from profd.config import load
from profd.store.index import Database, StepMinuteRepo, TraceRepo, WarehouseQueueRepo
from profd.warehouse.export import Exporter
from profd.warehouse.tables import HOURLY

FLUSH_EVERY_S = 60.0
DAY0 = 1_790_000_000 // 86400 * 86400  # a UTC midnight
STEPS = 8
RANKS_PER_NODE = 8


def stats(rng: random.Random) -> dict[str, Any]:
    ms = [round(100 + rng.random() * 20, 3) for _ in range(STEPS)]
    return {
        "v": 1,
        "mode": "gpu",
        "steps": {
            "step": list(range(1000, 1000 + STEPS)),
            "start_us": [i * 1e5 for i in range(STEPS)],
            "ms": ms,
            "compute_ms": [round(m * 0.7, 3) for m in ms],
            "collective_ms": [round(m * 0.2, 3) for m in ms],
            "idle_ms": [round(m * 0.1, 3) for m in ms],
            "gap_ms": [1.0] * STEPS,
            "wait_ms": [round(m * 0.3, 3) for m in ms],
        },
        "steps_total": STEPS,
        "ops": [[f"aten::op_{i}", 40, rng.random() * 50, rng.random() * 80] for i in range(20)],
        "gpu_ops": [[f"kernel_{i}_sm90_xmma", 40, rng.random() * 50] for i in range(20)],
        "collectives": [[f"nccl:coll_{i}", 16, rng.random() * 30] for i in range(4)],
    }


def capture(i: int, at: float, rng: random.Random, ranks: int) -> tuple[dict[str, Any], Any]:
    rank = i % ranks
    sid = f"s{i // ranks:08d}"
    path = f"/spool/job/{sid}/c0/trainer-r{rank}.pt.trace.json.gz"
    row = {
        "session": sid, "job": "job", "host": f"h{rank // RANKS_PER_NODE}", "pid": 1000 + rank,
        "role": "trainer", "rank": rank, "cycle": 0, "region": None,
        "steps": list(range(1000, 1000 + STEPS)), "path": path, "bytes": 5 << 20,
        "state": "done", "stall_ms": 3.0, "step_ms_p50": 110.0, "step_ms_max": 120.0,
        "torch": "2.13", "device": "cuda", "created_at": at, "stats": stats(rng),
    }  # fmt: skip
    f = {"session": sid, "job": "job", "kind": "trace", "path": path,
         "rel": path[len("/spool/"):], "bytes": 5 << 20, "upload_state": "local"}  # fmt: skip
    return row, f


def minutes(minute: int, ranks: int, rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for r in range(ranks):
        p50 = 100 + rng.gauss(0, 3)
        out.append(
            {"job": "job", "host": f"h{r // RANKS_PER_NODE}", "role": "trainer", "rank": r,
             "pid": 1000 + r, "minute": minute, "steps": 540, "sum_s": 59.4,
             "p50_ms": round(p50, 3), "p90_ms": round(p50 * 1.05, 3),
             "max_ms": round(p50 * 1.2, 3),
             "regions": {"forward": round(20 + rng.random(), 4),
                         "backward": round(35 + rng.random(), 4)}}
        )  # fmt: skip
    return out


def fill_hours(db: Database, hours: float, ranks: int, rng: random.Random) -> int:
    """``hours`` of captures, one a second, from midnight on."""
    repo = TraceRepo(db)
    n = int(hours * 3600)
    with db.transaction():
        for i in range(n):
            row, f = capture(i, DAY0 + i, rng, ranks)
            repo.add_trace(row, [f])
    return n


def exporter(state: Path, clock: Any = time.time) -> Exporter:
    cfg = load(env={"PROFD_STATE_DIR": str(state)})
    cfg = dataclasses.replace(
        cfg,
        node_name="bench",
        warehouse=dataclasses.replace(cfg.warehouse, keep_days=100_000, keep_rank_days=100_000),
    )
    return Exporter(cfg, clock=clock)


def cpu_s() -> float:
    """CPU seconds of this process and of its children reaped so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ru.ru_utime + ru.ru_stime


def run_at(hours: float, live_minutes: int, ranks: int) -> dict[str, Any]:
    """Flush CPU per minute with the day already ``hours`` old."""
    rng = random.Random(7)
    tmp = Path(tempfile.mkdtemp(prefix="bench-wh-"))
    try:
        db = Database(tmp / "index.db")
        q = WarehouseQueueRepo(db)
        ex = exporter(tmp)
        n = fill_hours(db, hours, ranks, rng)
        ex.flush(q)  # the backlog, not timed: what the live minutes cost is the question
        cpu: list[float] = []
        for m in range(live_minutes):
            start = DAY0 + int(hours * 3600) + m * 60
            StepMinuteRepo(db).add_step_minutes(minutes(start, ranks, rng))
            repo = TraceRepo(db)
            for s in range(60):
                row, f = capture(n, start + s, rng, ranks)
                repo.add_trace(row, [f])
                n += 1
            c0 = cpu_s()
            assert ex.flush(q)
            cpu.append(cpu_s() - c0)
        sizes = {
            p.parent.parent.name: p.stat().st_size for p in (tmp / "warehouse").rglob("*.parquet")
        }
        db.close()
        return {"hours": hours, "captures": n, "cpu_s": cpu, "object_bytes": sizes}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def seal_day(ranks: int, hours: int) -> dict[str, Any]:
    """The seal of one day of ``hours`` hours (captures one a second, ``ranks`` ranks'
    minutes), each hour flushed as it ends, then the seal's flush an hour after midnight."""
    rng = random.Random(5)
    tmp = Path(tempfile.mkdtemp(prefix="bench-wh-"))
    try:
        db = Database(tmp / "index.db")
        q = WarehouseQueueRepo(db)
        now = [float(DAY0)]
        ex = exporter(tmp, clock=lambda: now[0])
        n = 0
        for h in range(hours):
            start = DAY0 + h * 3600
            repo = StepMinuteRepo(db)
            with db.transaction():
                for m in range(60):
                    repo.add_step_minutes(minutes(start + m * 60, ranks, rng))
                for s in range(3600):
                    row, f = capture(n, start + s, rng, ranks)
                    TraceRepo(db).add_trace(row, [f])
                    n += 1
            now[0] = start + 3600.0
            assert ex.flush(q)
        now[0] = DAY0 + 86400 + 3600.0  # seal_after (1 h) after the day closed
        before_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        flushes: list[tuple[float, float]] = []  # (CPU, wall) of each flush that sealed
        while ex.status()["days_sealed"] < len(HOURLY):
            c0, t0 = cpu_s(), time.monotonic()
            assert ex.flush(q)
            flushes.append((cpu_s() - c0, time.monotonic() - t0))
        cpu = sum(c for c, _ in flushes)
        wall = max(w for _, w in flushes)
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        day = {
            p.parent.parent.name: p.stat().st_size
            for p in (tmp / "warehouse").rglob("*.parquet")
            if p.name.count("~") == 1 and p.parent.parent.name != "incidents"
        }
        st = ex.status()
        db.close()
        return {
            "hours": hours, "captures": n, "ranks": ranks, "cpu_s": round(cpu, 2),
            "longest_flush_s": round(wall, 2),
            "flushes": [[round(c, 2), round(w, 2)] for c, w in flushes],
            "children_peak_rss_mib": round(peak_kib / 1024, 1),
            "peak_rss_grew": peak_kib > before_kib,
            "day_object_bytes": day, "days_sealed": st["days_sealed"],
        }  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def rank_day_bytes(ranks: int) -> tuple[float, int]:
    """Bytes per rank-day of ``rank_minutes``: one full hour of ``ranks`` ranks written."""
    rng = random.Random(11)
    tmp = Path(tempfile.mkdtemp(prefix="bench-wh-"))
    try:
        db = Database(tmp / "index.db")
        hour = DAY0 + 5 * 3600
        repo = StepMinuteRepo(db)
        for m in range(60):
            repo.add_step_minutes(minutes(hour + m * 60, ranks, rng))
        ex = exporter(tmp)
        assert ex.flush(WarehouseQueueRepo(db))
        (obj,) = (tmp / "warehouse" / "rank_minutes").rglob("*.parquet")
        size = obj.stat().st_size
        db.close()
        return size * 24 / ranks, size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    args = B.parser(__doc__)
    args.add_argument("--ranks", type=int, default=1024)
    args.add_argument("--minutes", type=int, default=5, help="live minutes per point")
    # An hour's capture objects grow through the hour: x.5 is the average flush, x.95 the
    # largest (the end of the hour, and of the day for the day's incidents object).
    args.add_argument("--hours", default="0.5,0.95,12.5,23.95", help="hours into the day")
    a = args.parse_args()
    started = time.monotonic()
    ranks = 64 if a.quick else a.ranks
    live = 2 if a.quick else a.minutes
    hours = [0.0, 0.1] if a.quick else [float(h) for h in a.hours.split(",")]
    points = [run_at(h, live, ranks) for h in hours]
    per_rank_day, hour_bytes = rank_day_bytes(ranks)
    sealed = seal_day(ranks, 2 if a.quick else 24)
    rows = []
    for p in points:
        cpu = sorted(p["cpu_s"])
        core = B.pct(cpu, 50) / FLUSH_EVERY_S
        rows.append(
            B.row(
                f"export CPU, {p['hours']:g} h into the day ({ranks} ranks, 1 capture/s)",
                "<= 1 % of a core",
                core * 100,
                "% core",
                met=core <= 0.01,
                spread=f"flush p50 {B.pct(cpu, 50):.3f} s, max {max(cpu):.3f} s",
            )
        )
    rows.append(
        B.row(
            "rank_minutes bytes per rank-day",
            "<= 64 KiB",
            per_rank_day / 1024,
            "KiB",
            met=per_rank_day <= 64 * 1024,
            spread=f"one hour of {ranks} ranks: {hour_bytes} B",
        )
    )
    rows.append(
        B.row(
            f"a day's seal ({sealed['hours']} h: {sealed['captures']:,} captures, {ranks} ranks)",
            "once a day (no target)",
            sealed["cpu_s"],
            "s CPU",
            spread=f"{len(sealed['flushes'])} flushes, the longest {sealed['longest_flush_s']} s;"
            f" flush processes' peak RSS {sealed['children_peak_rss_mib']} MiB",
        )
    )
    B.write_result(
        "warehouse_export",
        a.out,
        a.quick,
        {"ranks": ranks, "live_minutes": live, "hours": hours, "flush_every": FLUSH_EVERY_S},
        rows,
        {"points": points, "rank_day_bytes": per_rank_day, "seal": sealed},
        started,
    )


if __name__ == "__main__":
    main()
