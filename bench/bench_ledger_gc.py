"""The cyclic garbage collector over the daemon's step ledgers at 1,024 ranks: the ledger
module as it was at ``--before`` (read from git) against the module now, in one process
each, alternating.

Each run fills 1,024 ranks' ledgers with ``--seconds`` heartbeats each (one a second, the
window of ``top`` full after 60), counting and timing every collection the heartbeats cause
(``gc.callbacks``), then times one full pass (``gc.collect(2)``) over what they keep. What
the interpreter had before the ledgers is frozen first, as the daemon freezes what start-up
built. Prints per side: µs per heartbeat (the collections included), full passes and the
longest, one full pass, and the objects the collector watches.

    PYTHONPATH=.:client python bench/bench_ledger_gc.py --before bdcf83e [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent


def one_run(before: str | None, seconds: int, ranks: int) -> dict[str, Any]:
    import tempfile

    from bench_ledger_ingest import _before, _Clock, _heartbeats

    from profd.daemon.clients import ledger as now_module
    from profd.daemon.clients.registry import Client

    module = _before(before, Path(tempfile.mkdtemp())) if before else now_module
    clients = [
        Client(b"r%d" % r, "n1", 1000 + r, f"j{r // 64}", "trainer", r % 64, r % 8, 64,
               "optimizer", True, None, None)
        for r in range(ranks)
    ]  # fmt: skip
    hbs = _heartbeats(seconds)
    gc.collect()
    gc.freeze()
    clock = _Clock()
    ledgers = module.Ledgers(clock)
    pauses: list[tuple[int, float]] = []
    began = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(timed)
    t0 = time.perf_counter()
    for i, m in enumerate(hbs):
        clock.t += 1.0
        for c in clients:
            ledgers.heartbeat(c, m.step, m.ledger, 1000.0 + i)
    took = time.perf_counter() - t0
    gc.callbacks.remove(timed)
    t1 = time.perf_counter()
    gc.collect(2)
    full = time.perf_counter() - t1
    fulls = [p for g, p in pauses if g == 2]
    return {
        "us_per_heartbeat": took / (seconds * ranks) * 1e6,
        "full_passes": len(fulls),
        "longest_full_ms": max(fulls, default=0.0) * 1e3,
        "one_full_pass_ms": full * 1e3,
        "objects_watched": len(gc.get_objects()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit whose ledger module is the base")
    ap.add_argument("--runs", type=int, default=3, help="runs of each side, alternating")
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--one", choices=("before", "now"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        before = args.before if args.one == "before" else None
        print(json.dumps(one_run(before, args.seconds, args.ranks)))
        return
    results: dict[str, list[dict[str, Any]]] = {"before": [], "now": []}
    for k in range(args.runs):
        for side in ("before", "now") if k % 2 == 0 else ("now", "before"):
            out = subprocess.run(
                [sys.executable, __file__, "--before", args.before, "--one", side,
                 "--seconds", str(args.seconds), "--ranks", str(args.ranks)],
                capture_output=True, text=True, check=True, cwd=ROOT,
            ).stdout  # fmt: skip
            results[side].append(json.loads(out))
    for side, runs in results.items():
        name = f"{side} ({args.before})" if side == "before" else side
        cols = {k: [r[k] for r in runs] for k in runs[0]}
        longest = [round(x, 1) for x in cols["longest_full_ms"]]
        print(
            f"{name}: {statistics.median(cols['us_per_heartbeat']):.2f} µs/heartbeat, "
            f"full passes {cols['full_passes']}, longest {longest} ms, "
            f"one full pass {statistics.median(cols['one_full_pass_ms']):.1f} ms, "
            f"{cols['objects_watched'][0]:,} objects watched"
        )


if __name__ == "__main__":
    main()
