"""The detectors' cost on the loop at 1,024 ranks: ``Detectors.tick`` as the loop
calls it once a tick, in process, against a real step ledger (``Ledgers``) holding a minute
of 1 Hz heartbeats per rank, each tick after a new heartbeat of every rank.

Two shapes: one job of 1,024 independent workers in one role (the slow-rank rule compares
all of them: the most work), and 128 jobs of 8 ranks. Reported per tick: the detectors
alone, and what feeding the heartbeats cost in the same ticks (the ledger's own side, for
scale), both as CPU time of the thread. Then the loop's tick as a share of one core at its
rate (one tick per heartbeat interval, 1 s): the heartbeats, the ledger's and the
incidents' housekeeping and the detectors, beside the same ticks without the detectors (the
baseline, measured in the same ticks). Nothing fires (steady steps), so no incident is
written.

Then detection, in simulated time through the same real objects (``Ledgers``, ``Detectors``,
``Incidents`` on a temporary index, default ``[watch]``): 1,024 ranks sending 1 Hz
heartbeats of 10 steps of 100 ms ± 10 % (uniform jitter per step):
- false alarms: 10,000 steady steps of 1,024 independent workers and of a 1,024-rank
  lockstep job (target: 0 incidents);
- latency: a lockstep job 20 % slower on every rank after 11 minutes (its baseline full),
  and one worker of 1,024 25 % slower after 2 minutes: seconds from the change to the
  incident (target <= 60 s), and which ranks it names.

And the ``straggler`` detector on samples, at 2 and 1,024 ranks: the real
``SampleStragglers`` over a real index holding each sample's per-rank statistics (synthetic,
``tests/stats_synth.py``: a lockstep job, 2-step samples as ``sample_steps`` defaults to),
three clean samples, then rank n/3 25 % slower: which sample after the change names it
(target: the first) and whether any incident names another rank.
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
import msgspec
from incidentstore import incidents_on
from stats_synth import store_session, synthetic_session  # tests/, on sys.path through benchlib

from profd.config import Config, WatchConfig
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.sessions.samples import SampleStragglers
from profd.daemon.watch.detector_runs import Detectors
from profd.store.index import Database, SessionRepo
from profd.watch.sampling import LABEL, sample_id
from profd_client import protocol as P
from profd_client.protocol import STEP_BUCKETS

RANKS = 1024
#: The loop's tick: it runs the detectors once every heartbeat interval.
TICK_S = Config.heartbeat_interval


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


def registry(cs: list[Client]) -> Registry:
    reg = Registry()
    for c in cs:
        reg.add(c)
    return reg


def ledger(step: int, rng: random.Random) -> P.Ledger:
    b = [0] * (len(STEP_BUCKETS) + 1)
    b[STEP_BUCKETS.index(0.5)] = 10
    p50 = 0.4 * (1 + rng.uniform(-0.05, 0.05))
    return typed({"at": step, "n": 10, "sum": 4.0, "q": [p50, p50 * 1.1, p50 * 1.2, p50 * 1.3],
                  "b": b, "r": [], "epoch": 1})  # fmt: skip


def run(n: int, per_job: int, ticks: int, tmp: Path) -> dict[str, list[float]]:
    cs = clients(n, per_job)
    ledgers = Ledgers()
    cfg = WatchConfig()
    spool = tmp / f"spool-{per_job}"
    spool.mkdir()
    db = Database(tmp / f"index-{per_job}.db")
    incidents = incidents_on(db, spool, cfg, host="n")
    det = Detectors(ledgers, registry(cs), incidents, cfg.rules())
    rng = random.Random(1)
    mono = time.monotonic()
    step = 0
    feed: list[float] = []
    housekeeping: list[float] = []
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
        # The rest of the loop's tick that the step clock needs with or without detectors.
        ledgers.tick(cs)
        ledgers.take_minutes()
        incidents.tick()
        t2 = time.thread_time()
        det.tick(mono)
        t3 = time.thread_time()
        if i >= 60:
            feed.append(t1 - t0)
            housekeeping.append(t2 - t1)
            tick.append(t3 - t2)
    assert not incidents.rows(), "a steady bench fired"
    without = [f + h for f, h in zip(feed, housekeeping, strict=True)]
    return {
        "feed_s": feed,
        "tick_s": tick,
        "loop_without_s": without,
        "loop_with_s": [w + t for w, t in zip(without, tick, strict=True)],
    }


STEP_S = 0.1
STEPS_PER_HB = 10


def _steps(base: float, rng: random.Random) -> list[float]:
    return [base * rng.uniform(0.9, 1.1) for _ in range(STEPS_PER_HB)]


def typed(fields: dict[str, Any]) -> P.Ledger:
    """A ledger as the daemon gets it from a heartbeat: validated and typed."""
    return msgspec.convert(fields, P.Ledger)


def _ledger(at: int, times: list[float]) -> P.Ledger:
    """A heartbeat's ledger for these step times, as the client summarises them."""
    ts = sorted(times)
    b = [0] * (len(STEP_BUCKETS) + 1)
    for t in ts:
        b[next((i for i, edge in enumerate(STEP_BUCKETS) if t <= edge), len(STEP_BUCKETS))] += 1
    q = [ts[len(ts) // 2], ts[int(len(ts) * 0.9)], ts[-1], ts[-1]]
    return typed({"at": at, "n": len(ts), "sum": sum(ts), "q": q, "b": b, "r": [], "epoch": 1})


def detect(
    n: int, lockstep: bool, ticks: int, change_at: int | None, slower: float, who: int | None,
    tmp: Path,
) -> dict[str, Any]:  # fmt: skip
    """One simulated run: ``ticks`` heartbeats of every rank; from tick ``change_at`` the
    rank ``who`` (every rank when None) steps ``slower`` times longer. The incidents it
    gave and when."""
    per_job = n
    cs = clients(n, per_job)
    clock = [1_800_000_000.0]
    ledgers = Ledgers(clock=lambda: clock[0])
    cfg = WatchConfig()
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    spool = run_dir / "spool"
    spool.mkdir()
    index = Database(run_dir / "index.db")
    incidents = incidents_on(index, spool, cfg, host="n", clock=lambda: clock[0])
    det = Detectors(ledgers, registry(cs), incidents, cfg.rules())
    rng = random.Random(n * 7 + (change_at or 0))
    mono = 1000.0
    step = 0
    first: dict[str, float] = {}
    for i in range(ticks):
        mono += 1.0
        clock[0] += 1.0
        step += STEPS_PER_HB
        changed = change_at is not None and i >= change_at
        shared = _steps(STEP_S, rng) if lockstep else None
        for c in cs:
            times = shared if shared is not None else _steps(STEP_S, rng)
            if changed and (who is None or c.rank == who):
                times = [t * slower for t in times]
            c.step = step
            ledgers.heartbeat(c, step, _ledger(step, times), mono)
        det.tick(mono)
        incidents.tick()
        for row in incidents.rows():
            first.setdefault(row["id"], float(i))
    rows = incidents.rows()
    index.close()
    return {
        "incidents": [
            {
                "kind": r["kind"],
                "ranks": [s["rank"] for s in r["suspects"]],
                "after_change_s": None if change_at is None else first[r["id"]] - change_at,
            }
            for r in rows
        ],
        "steps": ticks * STEPS_PER_HB,
    }


def detection(n: int, quick: bool, tmp: Path) -> dict[str, Any]:
    steady_ticks = 50 if quick else 10_000 // STEPS_PER_HB
    # The rule judges from half a baseline and a window on (6 minutes); the full size waits
    # for a full 10-minute baseline and a window.
    baseline_ticks = 400 if quick else 660
    return {
        "steady_workers": detect(n, False, steady_ticks, None, 1.0, None, tmp),
        "steady_lockstep": detect(n, True, steady_ticks, None, 1.0, None, tmp),
        "regression_20pct": detect(n, True, baseline_ticks + 120, baseline_ticks, 1.2, None, tmp),
        "slow_rank_25pct": detect(n, False, 120 + 120, 120, 1.25, 7 % n, tmp),
    }


def straggler_samples(n: int, tmp: Path) -> dict[str, Any]:
    """The ``straggler`` detector as the daemon runs it when a sample ends
    (:class:`SampleStragglers` over the per-rank statistics in a real index, incidents into
    a real :class:`Incidents`): three clean samples of a lockstep job of ``n`` ranks, then
    samples with rank ``n // 3`` 25 % slower. ``[watch]`` defaults: samples of
    ``sample_steps`` steps; step jitter ±10 % (as a normal of the same spread)."""
    cfg = WatchConfig()
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    spool = run_dir / "spool"
    spool.mkdir()
    index = Database(run_dir / "index.db")
    sessions = SessionRepo(index)
    incidents = incidents_on(index, spool, cfg, host="n")
    det = SampleStragglers(sessions, incidents.open, incidents.clear_ranks)
    slow = n // 3
    clean, named_at, named = 3, None, []
    for k in range(clean + 3):
        sid = sample_id("bench", 1000 * k + 1)
        s = synthetic_session(
            n, cfg.sample_steps, straggler=slow if k >= clean else None, extra_ms=25.0,
            compute_ms=100.0, noise_ms=100.0 * 0.1 / 3**0.5, seed=k, session=sid,
        )  # fmt: skip
        store_session(sessions, s, LABEL, float(k))
        opened = det.processed(sid)
        if k < clean:
            continue
        if opened and named_at is None:
            named_at = k - clean + 1
            named = [x.rank for i in opened for x in i.suspects]
    rows = incidents.rows()
    index.close()
    return {
        "ranks": n,
        "sample_steps": cfg.sample_steps,
        "straggler": slow,
        "false_alarms": sum(1 for r in rows if all(s["rank"] != slow for s in r["suspects"])),
        "named_on_sample": named_at,
        "named": named,
    }


def main() -> int:
    args = B.parser(__doc__).parse_args()
    started = time.monotonic()
    n = 64 if args.quick else RANKS
    ticks = 5 if args.quick else 100
    with tempfile.TemporaryDirectory() as d:
        one = run(n, n, ticks, Path(d))
        many = run(n, 8, ticks, Path(d))
        found = detection(n, args.quick, Path(d))
        samples = [straggler_samples(k, Path(d)) for k in (2, n)]
    rows = []
    for what, r in ((f"1 job of {n} workers", one), (f"{n // 8} jobs of 8 ranks", many)):
        rows.append(
            B.row(
                f"detectors per tick, {what}",
                "well under 1 ms (brief); CPU <= 5 % of a core",
                statistics.median(r["tick_s"]) * 1e3,
                "ms",
                baseline=statistics.median(r["feed_s"]) * 1e3,
                baseline_what="the same tick's heartbeats into the ledger (ms)",
                spread=f"p99 {B.pct(r['tick_s'], 99) * 1e3:.2f}",
            )
        )
        rows.append(
            B.row(
                f"loop's tick with detectors, {what}: % of one core at 1 tick/s",
                "<= 5 % (daemon at 1024 clients, all of it)",
                statistics.median(r["loop_with_s"]) / TICK_S * 100,
                "%",
                baseline=statistics.median(r["loop_without_s"]) / TICK_S * 100,
                baseline_what="the same ticks without the detectors (heartbeats, ledger and "
                "incident housekeeping), %",
                spread=f"p99 {B.pct(r['loop_with_s'], 99) / TICK_S * 100:.2f}",
            )
        )
    for name, what in (("steady_workers", "independent workers"), ("steady_lockstep", "lockstep")):
        r = found[name]
        rows.append(
            B.row(
                f"incidents over {r['steps']:,} steady steps, {n} {what} (±10 % jitter)",
                "0",
                float(len(r["incidents"])),
                "incidents",
                met=not r["incidents"],
            )
        )
    for name, what, kind, ranks in (
        ("regression_20pct", "a 20 % regression", "regression", []),
        ("slow_rank_25pct", "one rank 25 % slower", "slow_rank", [7 % n]),
    ):
        hits = [x for x in found[name]["incidents"] if x["after_change_s"] is not None]
        right = [(x["kind"], x["ranks"]) for x in hits] == [(kind, ranks)]
        rows.append(
            B.row(
                f"{what} at {n} ranks: seconds to its incident",
                "<= 60 s",
                min(x["after_change_s"] for x in hits) if hits else None,
                "s",
                spread=f"incidents {found[name]['incidents']}",
                # One incident, of its kind, naming the right rank (none for a regression).
                met=right and hits[0]["after_change_s"] <= 60,
            )
        )
    for x in samples:
        rows.append(
            B.row(
                f"straggler 25 % slower at {x['ranks']} ranks: samples until named "
                f"({x['sample_steps']}-step samples)",
                "1 (the first sample after it starts)",
                x["named_on_sample"],
                "samples",
                spread=f"named {x['named']}; incidents naming another rank {x['false_alarms']}",
                met=x["named_on_sample"] == 1 and x["named"] == [x["straggler"]],
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
            "one_job_loop_with_s": B.summary(one["loop_with_s"], 5),
            "one_job_loop_without_s": B.summary(one["loop_without_s"], 5),
            "jobs_of_8_loop_with_s": B.summary(many["loop_with_s"], 5),
            "jobs_of_8_loop_without_s": B.summary(many["loop_without_s"], 5),
            "detection": found,
            "straggler_samples": samples,
        },
        started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
