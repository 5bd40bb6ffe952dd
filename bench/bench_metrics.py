"""``/metrics`` at 1,024 ranks: a scrape over real HTTP, the page's size, and the loop's publish.

1. The daemon's ``MetricsServer`` (its HTTP thread and renderer, in this process) serves a
   snapshot of 1,024 ranks, each with a full step-time histogram (19 buckets) and 4 regions:
   ``GET /metrics`` over a real socket, plain and gzip (as Prometheus asks), p50/p99 of the
   whole request. Target 100 ms. For comparison, the same page rendered the reference way,
   through prometheus-client's ``generate_latest`` over ``SnapshotCollector`` (in process).
2. What the event loop pays once a tick with ``[metrics]`` on: building the snapshot (the
   step ledger's series of 1,024 clients, each fed a ledger with 19 buckets and 4 regions,
   through ``Ledgers.series`` as the loop calls it; for reference, 1,024 synthetic
   ``RankSeries`` built by the bench itself) and publishing it.
"""

from __future__ import annotations

import gzip
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B
import msgspec
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.metrics import INCIDENT_KINDS, MetricsServer, SnapshotCollector
from profd.watch.snapshot import RankSeries, Snapshot
from profd_client import protocol as P
from profd_client.protocol import STEP_BUCKETS

RANKS = 1024
REGIONS = ("forward", "backward", "optimizer", "data")


def full_series(n: int) -> tuple[RankSeries, ...]:
    """``n`` ranks of 8 per host, every bucket and region filled (the biggest page)."""
    nb = len(STEP_BUCKETS) + 1
    return tuple(
        RankSeries(
            host=f"gpu-node-{i // 8:04d}",
            job="llama-70b-pretrain",
            role="trainer",
            rank=i,
            buckets=tuple((i * 7 + b * 13) % 997 for b in range(nb)),
            sum_s=123.456 + i,
            steps=1_000_000 + i * 17,
            regions=tuple((r, 10.5 * (k + 1) + i / 1000) for k, r in enumerate(REGIONS)),
        )
        for i in range(n)
    )


def snapshot(ranks: tuple[RankSeries, ...]) -> Snapshot:
    return Snapshot(
        at=time.time(),
        ranks=ranks,
        attached=len(ranks),
        sessions=(("pending", 0), ("armed", 1), ("capturing", 0), ("processing", 0)),
        incidents=tuple((k, 0) for k in INCIDENT_KINDS),
        upload_queue_bytes=1 << 30,
    )


def scrape(url: str, gz: bool) -> tuple[float, int, bytes]:
    headers = {"Accept-Encoding": "gzip"} if gz else {}
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        body = r.read()
    return time.perf_counter() - t0, len(body), body


def bench_scrapes(ranks: int, reps: int) -> dict[str, Any]:
    server = MetricsServer("127.0.0.1", 0, time.time)
    server.start()
    try:
        snap = snapshot(full_series(ranks))
        server.publish(snap)
        url = f"http://{server.address}/metrics"
        plain: list[float] = []
        zipped: list[float] = []
        for i in range(reps):
            # Alternate which goes first: a drifting machine favours neither.
            for gz in (False, True) if i % 2 == 0 else (True, False):
                took, size, body = scrape(url, gz)
                if gz:
                    zipped.append(took)
                    gz_bytes, page = size, gzip.decompress(body)
                else:
                    plain.append(took)
                    plain_bytes = size
        families = list(text_string_to_metric_families(page.decode()))
        samples = sum(len(f.samples) for f in families)
        collector = SnapshotCollector(server.latest, time.time)
        reference: list[float] = []
        for _ in range(max(2, reps // 10)):
            t0 = time.perf_counter()
            generate_latest(collector)
            reference.append(time.perf_counter() - t0)
    finally:
        server.stop()
    return {
        "plain_s": plain,
        "gzip_s": zipped,
        "reference_s": reference,
        "plain_bytes": plain_bytes,
        "gzip_bytes": gz_bytes,
        "families": len(families),
        "samples": samples,
    }


def registry_of(n: int) -> Registry:
    reg = Registry()
    for i in range(n):
        reg.add(
            Client(
                ident=f"c{i}".encode(),
                host=f"gpu-node-{i // 8:04d}",
                pid=10_000 + i,
                job="llama-70b-pretrain",
                role="trainer",
                rank=i,
                local_rank=i % 8,
                world_size=n,
                step_mode="optimizer",
                allowed=True,
                torch="2.13",
                device="cuda",
                step=1_000_000 + i,
            )
        )
    return reg


def bench_publish(ranks: int, reps: int) -> dict[str, list[float]]:
    """The loop's side: its snapshot each tick, and the swap."""
    server = MetricsServer("127.0.0.1", 0, time.time)  # never started: publish is a swap
    registry = registry_of(ranks)
    ledgers = Ledgers()
    b = [0] * (len(STEP_BUCKETS) + 1)
    b[STEP_BUCKETS.index(0.5)] = 10
    for c in registry:
        regions = [[name, 1.0, 10] for name in ("data", "forward", "backward", "optimizer")]
        ledger = msgspec.convert(
            {"at": c.step, "n": 10, "sum": 4.0, "q": [0.4, 0.45, 0.5, 0.5], "b": b,
             "r": regions, "epoch": 1},
            P.Ledger,
        )  # fmt: skip
        ledgers.heartbeat(c, c.step, ledger, time.monotonic())
    hook: list[float] = []
    full: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        server.publish(snapshot(ledgers.series(registry)))
        hook.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        server.publish(snapshot(full_series(ranks)))
        full.append(time.perf_counter() - t0)
    return {"hook_s": hook, "full_s": full}


def main() -> int:
    args = B.parser(__doc__).parse_args()
    started = time.monotonic()
    ranks = 64 if args.quick else RANKS
    reps = 5 if args.quick else 50
    s = bench_scrapes(ranks, reps)
    p = bench_publish(ranks, reps)
    plain50, gz50 = statistics.median(s["plain_s"]), statistics.median(s["gzip_s"])
    ref50 = statistics.median(s["reference_s"])
    rows = [
        B.row(
            f"GET /metrics, {ranks} ranks, gzip (as Prometheus asks)",
            "<= 100 ms",
            gz50 * 1e3,
            "ms",
            baseline=ref50 * 1e3,
            baseline_what="generate_latest alone, no HTTP/gzip (ms)",
            met=B.pct(s["gzip_s"], 99) <= 0.1 if not args.quick else None,
            spread=f"p99 {B.pct(s['gzip_s'], 99) * 1e3:.1f}",
        ),
        B.row(
            f"GET /metrics, {ranks} ranks, plain",
            "<= 100 ms",
            plain50 * 1e3,
            "ms",
            met=B.pct(s["plain_s"], 99) <= 0.1 if not args.quick else None,
            spread=f"p99 {B.pct(s['plain_s'], 99) * 1e3:.1f}",
        ),
        B.row(f"/metrics page, {ranks} ranks", "", s["plain_bytes"] / 1024, "KiB"),
        B.row(f"/metrics page gzipped, {ranks} ranks", "", s["gzip_bytes"] / 1024, "KiB"),
        B.row(
            f"loop's publish per tick, {ranks} clients (Ledgers.series, as the loop does)",
            "",
            statistics.median(p["hook_s"]) * 1e3,
            "ms",
            spread=f"p99 {B.pct(p['hook_s'], 99) * 1e3:.2f}",
        ),
        B.row(
            f"publish per tick, {ranks} synthetic RankSeries built by the bench (reference)",
            "",
            statistics.median(p["full_s"]) * 1e3,
            "ms",
            spread=f"p99 {B.pct(p['full_s'], 99) * 1e3:.2f}",
        ),
    ]
    B.write_result(
        "metrics",
        args.out,
        args.quick,
        {"ranks": ranks, "reps": reps, "regions": len(REGIONS)},
        rows,
        {
            "scrape_plain_s": B.summary(s["plain_s"], 4),
            "scrape_gzip_s": B.summary(s["gzip_s"], 4),
            "reference_generate_latest_s": B.summary(s["reference_s"], 4),
            "publish_hook_s": B.summary(p["hook_s"], 5),
            "publish_full_s": B.summary(p["full_s"], 5),
            **{k: s[k] for k in ("plain_bytes", "gzip_bytes", "families", "samples")},
        },
        started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
