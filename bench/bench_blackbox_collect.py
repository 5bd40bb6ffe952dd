"""Collecting the black boxes of a 64-rank node (docs/design.md "Black box": ≤ 5 s), and the
trace they make.

A real daemon and ``--ranks`` real Python processes (``bench/steploop.py``: attached with
profd_client, a step every ``--step-ms`` on a thread of their own, black box on with the
defaults: 512 steps, 10 stack samples a second). Once every ring holds ``keep_steps`` steps,
each trial runs ``profctl blackbox --json -o FILE`` as a process: its wall time (start-up,
collection, the Perfetto trace written), the daemon's collection time (``collect_s``: every
rank asked at once, all answers in), and the trace's size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib as B


def trial(env: dict[str, str], out: Path) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    r = subprocess.run(
        [str(B.BIN / "profctl"), "blackbox", "--job", "bench", "--json", "-o", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    dt = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"profctl blackbox exited {r.returncode}: {r.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(r.stdout)
    return dt, doc


def main() -> int:
    ap = B.parser(__doc__)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.trials = 4, 2
    started = time.monotonic()
    d = B.Daemon().start()
    try:
        env, ranks = B.steploop_ranks(d, args.ranks, args.step_ms)
    except BaseException:
        d.stop()
        raise
    wall: list[float] = []
    collect: list[float] = []
    sizes: list[int] = []
    held: list[int] = []
    try:
        # Full rings: 512 steps of every rank (and their samples) before the first trial.
        time.sleep(max(5.0, 600 * args.step_ms / 1000.0))
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bb.json.gz"
            for _ in range(args.trials):
                dt, doc = trial(env, out)
                assert len(doc["ranks"]) == args.ranks and not doc["missing"], doc["missing"]
                wall.append(dt)
                collect.append(doc["collect_s"])
                sizes.append(doc["trace_bytes"])
                held += [r["steps"] for r in doc["ranks"]]
    finally:
        B.finish_workers(ranks)
        d.stop()
    n = args.ranks
    rows = [
        B.row(
            f"black boxes of {n} local ranks collected by the daemon (collect_s p50)",
            "<= 5 s",
            B.pct(collect, 50),
            "s",
            met=B.pct(collect, 50) <= 5.0,
            spread=f"max {max(collect):.3f} s over {len(collect)}",
        ),
        B.row(
            f"profctl blackbox --json -o, {n} ranks: collected and written (wall p50)",
            "s",
            B.pct(wall, 50),
            "s",
            spread=f"max {max(wall):.3f} s",
        ),
        B.row(
            f"its Perfetto trace, {n} ranks x {min(held)}+ steps, gzipped",
            "<= 20 MB (64 ranks x 512 steps)",
            max(sizes) / 1e6,
            "MB",
            met=max(sizes) <= 20e6 if n >= 64 else None,
        ),
    ]
    details = {"wall_s": wall, "collect_s": collect, "trace_bytes": sizes, "steps_held": held}
    B.write_result("blackbox_collect", args.out, args.quick, vars(args), rows, details, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
