"""Run every profd benchmark and print target vs measured vs baseline, with the ratio.

Each benchmark runs as its own process (``bench/bench_<name>.py``) and writes
``{out}/<name>.json``; this driver then reads them all back and prints one table, and writes
``{out}/summary.json``. ``--quick`` runs tiny sizes (the smoke test); ``--only a,b`` picks
benchmarks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B

ORDER = ("idle", "trigger", "stall", "daemon", "index", "s3", "cluster", "report", "pipeline",
         "metrics", "stacks", "watch", "sampling", "hostile", "blackbox",
         "warehouse")  # fmt: skip


def main() -> int:
    ap = B.parser(__doc__)
    ap.add_argument("--only", help="comma-separated subset of " + ",".join(ORDER))
    args = ap.parse_args()
    names = [n for n in ORDER if not args.only or n in args.only.split(",")]
    out = Path(args.out)
    failed = []
    t_all = time.monotonic()
    print(f"machine: {json.dumps(B.machine())}", file=sys.stderr)
    for name in names:
        cmd = [sys.executable, str(B.BENCH / f"bench_{name}.py"), "--out", str(out)]
        if args.quick:
            cmd.append("--quick")
        print(f"\n=== bench_{name} {'(quick)' if args.quick else ''}", file=sys.stderr)
        t0 = time.monotonic()
        rc = subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        print(f"=== bench_{name}: rc {rc} in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        if rc != 0:
            failed.append(name)
    rows = []
    results = {}
    for name in names:
        p = out / f"{name}.json"
        if name in failed or not p.exists():
            continue
        res = json.loads(p.read_text())
        results[name] = res
        rows.extend(res["rows"])
    print()
    B.print_rows(rows)
    met = [r for r in rows if r["met"] is True]
    missed = [r for r in rows if r["met"] is False]
    print(
        f"\ntargets met: {len(met)}, missed: {len(missed)}; failed benchmarks: {failed or 'none'}"
    )
    (out / "summary.md").write_text(B.markdown_rows(rows))
    (out / "summary.json").write_text(
        json.dumps(
            {
                "quick": args.quick,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": B.machine(),
                "wall_s": round(time.monotonic() - t_all, 1),
                "failed": failed,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
