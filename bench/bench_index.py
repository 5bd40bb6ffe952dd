"""The SQLite index with 1M traces: filtered query latency and insert rate.

Builds a real ``index.db`` (schema from :mod:`profd.store.index.schema`) with N trace rows,
each with its two file rows (trace + summary) as the daemon writes them: 1000 traces per
job, 100 ranks per session, sessions spread over 90 days. Bulk load uses the same INSERT
statements as ``TraceRepo.add_trace`` in 20k-row transactions; the real ``TraceRepo.add_trace``
(one transaction per trace, as the daemon calls it) is timed on a sample, into an empty
index and into the full one. Queries go through ``TraceRepo.traces(TraceFilter(...))`` with
limit 100 (the profctl default): by job, by session, by rank in a 1-day window.
Baseline: the same queries on a copy of the tables without any index (full scans).

Target: filtered query p50 <= 5 ms.
"""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B

from profd.store.index import Database, TraceFilter, TraceRepo

RANKS = 100
SESSIONS_PER_JOB = 10
SPAN_S = 90 * 86400.0
T0 = 1.7e9

TRACE_SQL = (
    "INSERT INTO traces (id, session, job, host, pid, role, rank, cycle, region, steps, path,"
    " bytes, state, stall_ms, step_ms_p50, step_ms_max, torch, device, created_at)"
    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
)
FILE_SQL = (
    "INSERT INTO files (session, job, trace_id, kind, path, rel, bytes, created_at,"
    " upload_state) VALUES (?,?,?,?,?,?,?,?,?)"
)


def session_of(i: int, n_sessions: int) -> tuple[str, str, float]:
    """(session id, job, created_at) of the i-th session."""
    job = f"job-{i // SESSIONS_PER_JOB:05d}"
    sid = f"s{i:07d}-{(i * 2654435761) % 16**6:06x}"
    return sid, job, T0 + SPAN_S * i / n_sessions


def trace_row(tid: int, i: int, rank: int, n_sessions: int) -> dict[str, Any]:
    sid, job, t = session_of(i, n_sessions)
    rel = f"{job}/{sid}/c0/main-r{rank}"
    return {
        "id": tid,
        "session": sid,
        "job": job,
        "host": f"node{rank // 8:03d}",
        "pid": 10000 + rank,
        "role": "actor" if rank % 2 else "learner",
        "rank": rank,
        "cycle": 0,
        "region": None,
        "steps": [100, 101, 102],
        "path": f"/var/lib/profd/spool/{rel}.pt.trace.json.gz",
        "rel": rel,
        "bytes": 5_000_000 + rank,
        "state": "ok",
        "stall_ms": 120.0,
        "step_ms_p50": 850.0,
        "step_ms_max": 900.0,
        "torch": "2.13.0",
        "device": "cuda:0 NVIDIA H100",
        "created_at": t + rank * 0.01,
    }


def bulk_load(idx: TraceRepo, n: int, batch: int) -> tuple[float, int]:
    """Load ``n`` traces in transactions of ``batch`` trace rows; (seconds, transactions)."""
    n_sessions = n // RANKS
    txs = 0
    db = idx.conn
    t0 = time.perf_counter()
    tid = 0
    batch_t: list[tuple[Any, ...]] = []
    batch_f: list[tuple[Any, ...]] = []
    for i in range(n_sessions):
        for rank in range(RANKS):
            tid += 1
            r = trace_row(tid, i, rank, n_sessions)
            batch_t.append(
                (
                    tid,
                    r["session"],
                    r["job"],
                    r["host"],
                    r["pid"],
                    r["role"],
                    r["rank"],
                    r["cycle"],
                    None,
                    json.dumps(r["steps"]),
                    r["path"],
                    r["bytes"],
                    r["state"],
                    r["stall_ms"],
                    r["step_ms_p50"],
                    r["step_ms_max"],
                    r["torch"],
                    r["device"],
                    r["created_at"],
                )
            )
            for kind, suffix in (("trace", ".pt.trace.json.gz"), ("summary", ".summary.txt")):
                batch_f.append(
                    (
                        r["session"],
                        r["job"],
                        tid,
                        kind,
                        r["path"].replace(".pt.trace.json.gz", suffix),
                        r["rel"] + suffix,
                        1000,
                        r["created_at"],
                        "uploaded",
                    )
                )
        if len(batch_t) >= batch or i == n_sessions - 1:
            db.execute("BEGIN")
            db.executemany(TRACE_SQL, batch_t)
            db.executemany(FILE_SQL, batch_f)
            db.execute("COMMIT")
            txs += 1
            batch_t, batch_f = [], []
    return time.perf_counter() - t0, txs


def add_trace_rate(idx: TraceRepo, n: int, first_session: int) -> float:
    rows = []
    for k in range(n):
        i, rank = first_session + k // RANKS, k % RANKS
        r = trace_row(0, i, rank, 10**6)
        del r["id"]
        files = [
            {
                "session": r["session"],
                "job": r["job"],
                "kind": kind,
                "path": r["path"].replace(".pt.trace.json.gz", suffix),
                "rel": r["rel"] + suffix,
                "bytes": 1000,
                "upload_state": "local",
            }
            for kind, suffix in (("trace", ".pt.trace.json.gz"), ("summary", ".summary.txt"))
        ]
        rows.append((r, files))
    t0 = time.perf_counter()
    for r, files in rows:
        idx.add_trace(r, files)
    return n / (time.perf_counter() - t0)


def queries(idx: TraceRepo, n: int, k: int, seed: int) -> dict[str, list[float]]:
    rnd = random.Random(seed)
    n_sessions = n // RANKS
    out: dict[str, list[float]] = {"job": [], "session": [], "rank+window": []}
    for _ in range(k):
        i = rnd.randrange(n_sessions)
        sid, job, t = session_of(i, n_sessions)
        flts = {
            "job": TraceFilter(job=job, limit=100),
            "session": TraceFilter(session=sid, limit=100),
            "rank+window": TraceFilter(
                rank=rnd.randrange(RANKS), since=t, until=t + 86400.0, limit=100
            ),
        }
        for name, f in flts.items():
            t0 = time.perf_counter()
            rows = idx.traces(f)
            out[name].append((time.perf_counter() - t0) * 1000)
            assert rows, (name, f)
    return out


def unindexed_copy(src: Path, dst: Path) -> None:
    db = sqlite3.connect(str(dst))
    db.execute("ATTACH DATABASE ? AS src", (str(src),))
    # CREATE TABLE AS copies columns and rows only: no primary key, unique or other index.
    db.execute("CREATE TABLE traces AS SELECT * FROM src.traces")
    db.execute("CREATE TABLE files AS SELECT * FROM src.files")
    db.commit()
    db.execute("DETACH DATABASE src")
    db.close()


def main() -> None:
    ap = B.parser(__doc__)
    ap.add_argument("--rows", type=int, default=None)
    args = ap.parse_args()
    started = time.monotonic()
    quick = args.quick
    n = args.rows or (20_000 if quick else 1_000_000)
    n = max(RANKS, n - n % RANKS)
    k_idx, k_scan, sample = (30, 3, 300) if quick else (300, 10, 5000)
    # Trace rows per bulk transaction; --quick loads several batches, as the full run does.
    batch = 5_000 if quick else 20_000
    tmp = Path(tempfile.mkdtemp(prefix="profd-bench-index-"))
    try:
        empty = Database(tmp / "empty" / "index.db")
        rate_empty = add_trace_rate(TraceRepo(empty), sample, 0)
        empty.close()

        full = Database(tmp / "full" / "index.db")
        idx = TraceRepo(full)
        load_s, load_txs = bulk_load(idx, n, batch)
        print(f"bulk loaded {n} traces in {load_s:.1f}s ({load_txs} tx)", file=sys.stderr)
        db_bytes = sum(p.stat().st_size for p in (tmp / "full").iterdir())
        queries(idx, n, 5, 1)  # warm the page cache
        q = queries(idx, n, k_idx, 2)
        rate_full = add_trace_rate(idx, sample, n // RANKS + 10)
        full.close()

        unindexed_copy(tmp / "full" / "index.db", tmp / "scan.db")
        scan = Database(tmp / "scan.db", readonly=True)
        queries(TraceRepo(scan), n, 1, 1)
        qs = queries(TraceRepo(scan), n, k_scan, 2)
        scan.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    at_target = n >= 1_000_000  # the target is stated for 1M traces
    rows = []
    for name in q:
        s, b = B.summary(q[name], 3), B.summary(qs[name], 1)
        ok = s["p50"] <= 5.0
        rows.append(
            B.row(
                f"query by {name}, {n:,} traces (p50)",
                "<= 5 ms",
                s["p50"],
                "ms",
                baseline=b["p50"],
                baseline_what="same query, no indexes",
                met=ok if at_target else None,
                spread=f"p99 {s['p99']} ms",
            )
        )
    rows.append(
        B.row(
            "insert rate, Index.add_trace (1 tx/trace) into full index",
            "-",
            rate_full,
            "traces/s",
            baseline=n / load_s,
            baseline_what=f"bulk executemany, {batch // 1000}k/tx",
            spread=f"into empty index {rate_empty:.0f}/s",
        )
    )
    details = {
        "rows": n,
        "files_rows": 2 * n,
        "db_bytes": db_bytes,
        "bulk_load_s": round(load_s, 1),
        "bulk_batch_rows": batch,
        "bulk_transactions": load_txs,
        "bulk_rows_per_s": round(n / load_s),
        "add_trace_rows_per_s_empty": round(rate_empty),
        "add_trace_rows_per_s_full": round(rate_full),
        "add_trace_sample": sample,
        "indexed_ms": {k: B.summary(v, 3) for k, v in q.items()},
        "no_index_ms": {k: B.summary(v, 1) for k, v in qs.items()},
        "queries_per_kind": {"indexed": k_idx, "no_index": k_scan},
    }
    params = {
        "rows": n,
        "ranks_per_session": RANKS,
        "sessions_per_job": SESSIONS_PER_JOB,
        "span_days": 90,
        "limit": 100,
    }
    B.write_result("index", args.out, quick, params, rows, details, started)


if __name__ == "__main__":
    main()
