"""The detectors' cost on the loop at 1,024 ranks (issue 22): ``Detectors.tick`` as the loop
calls it once a tick, in process, against a real step ledger (``Ledgers``) holding a minute
of 1 Hz heartbeats per rank, each tick after a new heartbeat of every rank.

Two shapes: one job of 1,024 independent workers in one role (the slow-rank rule compares
all of them: the most work), and 128 jobs of 8 ranks. Reported per tick: the detectors
alone, and what feeding the heartbeats cost in the same ticks (the ledger's own side, for
scale), both as CPU time of the thread. Nothing fires (steady steps), so no incident is
written.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B

from profd.config import WatchConfig
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Client
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.daemon.watch.detectors import Detectors
from profd.daemon.watch.incidents import Incidents
from profd.store.index import Index
from profd_client.protocol import STEP_BUCKETS

RANKS = 1024


def clients(n: int, per_job: int) -> list[Client]:
    return [
        Client(
            ident=f"c{i}".encode(),
            host=f"gpu-node-{i // 8:04d}",
            pid=10_000 + i,
            job=f"job-{i // per_job}",
            role="worker",
            rank=i % per_job,
            local_rank=i % 8,
            world_size=per_job,
            step_mode="optimizer",
            allowed=True,
            torch="2.13",
            device="cuda",
        )
        for i in range(n)
    ]


def ledger(step: int, rng: random.Random) -> dict[str, Any]:
    b = [0] * (len(STEP_BUCKETS) + 1)
    b[STEP_BUCKETS.index(0.5)] = 10
    p50 = 0.4 * (1 + rng.uniform(-0.05, 0.05))
    return {"at": step, "n": 10, "sum": 4.0, "q": [p50, p50 * 1.1, p50 * 1.2, p50 * 1.3],
            "b": b, "r": [], "epoch": 1}  # fmt: skip


def run(n: int, per_job: int, ticks: int, tmp: Path) -> dict[str, list[float]]:
    cs = clients(n, per_job)
    ledgers = Ledgers()
    cfg = WatchConfig()
    spool = tmp / f"spool-{per_job}"
    spool.mkdir()
    incidents = Incidents(
        Index(tmp / f"index-{per_job}.db"), spool, SpoolPerms(None), "n", cfg, None
    )
    det = Detectors(ledgers, cs, incidents, cfg.rules())
    rng = random.Random(1)
    mono = time.monotonic()
    step = 0
    feed: list[float] = []
    tick: list[float] = []
    for i in range(60 + ticks):  # a minute of history first, as a running job has
        mono += 1.0
        step += 10
        # CPU time of this thread, not wall time: the figures hold on a shared machine.
        t0 = time.thread_time()
        for c in cs:
            c.step = step
            ledgers.heartbeat(c, step, ledger(step, rng), mono)
        t1 = time.thread_time()
        det.tick(mono)
        t2 = time.thread_time()
        if i >= 60:
            feed.append(t1 - t0)
            tick.append(t2 - t1)
    assert not incidents.rows(), "a steady bench fired"
    return {"feed_s": feed, "tick_s": tick}


def main() -> int:
    args = B.parser(__doc__).parse_args()
    started = time.monotonic()
    n = 64 if args.quick else RANKS
    ticks = 5 if args.quick else 100
    with tempfile.TemporaryDirectory() as d:
        one = run(n, n, ticks, Path(d))
        many = run(n, 8, ticks, Path(d))
    rows = []
    for what, r in ((f"1 job of {n} workers", one), (f"{n // 8} jobs of 8 ranks", many)):
        rows.append(
            B.row(
                f"detectors per tick, {what}",
                "well under 1 ms (brief); CPU <= 5 % of a core (issue)",
                statistics.median(r["tick_s"]) * 1e3,
                "ms",
                baseline=statistics.median(r["feed_s"]) * 1e3,
                baseline_what="the same tick's heartbeats into the ledger (ms)",
                spread=f"p99 {B.pct(r['tick_s'], 99) * 1e3:.2f}",
            )
        )
    B.write_result(
        "watch",
        args.out,
        args.quick,
        {"ranks": n, "ticks": ticks},
        rows,
        {
            "one_job_tick_s": B.summary(one["tick_s"], 5),
            "one_job_feed_s": B.summary(one["feed_s"], 5),
            "jobs_of_8_tick_s": B.summary(many["tick_s"], 5),
            "jobs_of_8_feed_s": B.summary(many["feed_s"], 5),
        },
        started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
