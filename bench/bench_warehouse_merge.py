"""What a fleet object's merge costs the node that makes it (profd/warehouse/merge.py).

A closed day of 1,024 nodes (8 ranks each, 128 jobs, bench/warehouse_fleet.py): every node's
day object of ``rank_minutes`` (the biggest table: a row per rank and minute) and of
``job_minutes``, on local disk. Each table's day is merged by profd's own ``merge()`` in a
process of its own, as the export's flush process runs it: wall time, CPU and peak RSS of
that process, and the objects and bytes before and after. Then the same day merged again
with one node's day object rewritten (a late row): the second merge reads the first fleet
object and that one node's object.

``--hourly``: the open day's merges instead, as the merging node makes them through the day.
The 24 hours of every node's hourly objects (not sealed); hour 00 merged alone into a new
fleet object (the day's first merge), hours 01-22 merged in one go (setting the scene, not
timed), then hour 23 into that fleet object of 23 hours (the day's biggest merge: it reads
and writes again everything merged before). A merge's cost grows with the hours it carries,
so the day's 24 merges cost about 24 x the mean of the first and the last.

Baseline: the node's own seal of its day (one node's objects, the same process shape), which
every node pays already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B
import numpy as np
from warehouse_fleet import Fleet, seal, write_job_minutes, write_rank_minutes

from profd.warehouse.sink import LocalSink
from profd.warehouse.tables import object_key

CHILD = """
import json, resource, sys, time
from pathlib import Path
from profd.warehouse.lean import refuse
refuse(("pandas",), "the merge benchmark")
from profd.warehouse.merge import NO_FLEET, footer, merge
from profd.warehouse.sink import LocalSink
from profd.warehouse.tables import fleet_serial, stem_of
root, table, date, hours = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
sink = LocalSink(Path(root))
t0, c0 = time.monotonic(), time.process_time()
listed = sink.folder(table, date)
fleets = sorted((k, n) for n in listed if (k := fleet_serial(n)) is not None)
serial, chosen = fleets[-1] if fleets else (0, "")
base = footer(sink, table, date, chosen, listed[chosen].size) if chosen else NO_FLEET
if hours == "day":
    ours = {w: o for n, o in listed.items() if (w := stem_of(n)) and n == f"{w}.parquet"}
else:  # "first-last": those hours' objects of every writer
    lo, hi = (int(h) for h in hours.split("-"))
    ours = {n[:-8]: o for n, o in listed.items()
            if stem_of(n) and n.count("~") == 2 and lo <= int(n[-10:-8]) <= hi}
todo = {s: o for s, o in ours.items() if base.held.get(s) != o.token}
ok = merge(sink, table, date, serial + 1, (chosen, base), todo, time.time())
print(json.dumps({"ok": ok, "wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - c0,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "sources": len(todo), "serial": serial + 1}))
"""


def run_merge(root: Path, table: str, date: str, hours: str = "day") -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), table, date, hours],
        capture_output=True,
        text=True,
        check=True,
    )
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def folder_size(root: Path, table: str, date: str) -> tuple[int, int]:
    files = list((root / table / f"date={date}").glob("*.parquet"))
    return len(files), sum(f.stat().st_size for f in files)


def main() -> None:
    p = B.parser(__doc__)
    p.add_argument("--hourly", action="store_true", help="the open day's hourly merges")
    args = p.parse_args()
    started = time.monotonic()
    nodes = 32 if args.quick else 1024
    # A whole UTC day ending at a midnight: 24 hours of every node's minutes, one date.
    midnight = float(int(time.time() // 86400 * 86400) - 86400)
    f = Fleet(nodes=nodes, jobs=max(1, nodes // 8), rank_minute_hours=24, job_minute_days=1)
    f.end = midnight
    date = time.strftime("%Y-%m-%d", time.gmtime(midnight - 3600))
    tmp = Path(tempfile.mkdtemp(prefix="bench-merge-"))
    root = tmp / "warehouse"
    rng = np.random.default_rng(7)
    t0 = time.monotonic()
    write_rank_minutes(f, root, rng)
    f.end = midnight - 60  # job minutes end at the day's last minute
    write_job_minutes(f, root, rng)
    if not args.hourly:
        seal(root, time.strftime("%Y-%m-%d", time.gmtime(midnight)), set())
    made_s = time.monotonic() - t0
    details: dict[str, Any] = {"nodes": nodes, "date": date, "generate_s": round(made_s, 1)}
    if args.hourly:
        hourly(root, date, nodes, details, args, started)
        return
    rows = []
    for table in ("job_minutes", "rank_minutes"):
        before = folder_size(root, table, date)
        first = run_merge(root, table, date)
        after = folder_size(root, table, date)
        # One node's late row: its day object rewritten, merged again into serial 2.
        stem = f.stem(0)
        key = object_key(table, date, stem)
        LocalSink(root).put(key, (root / key).read_bytes())
        second = run_merge(root, table, date)
        details[table] = {
            "objects_before": before[0],
            "bytes_before": before[1],
            "fleet_bytes": after[1] - before[1],
            "first": first,
            "again_after_one_late_node": second,
        }
        rows.append(
            B.row(
                f"merge of a {nodes}-node day of {table}: CPU",
                "(once a day, on one node)",
                first["cpu_s"],
                "s",
                spread=f"wall {first['wall_s']:.1f} s, peak RSS {first['peak_rss_mib']:.0f} MiB,"
                f" {before[0]} objects -> 1 of {(after[1] - before[1]) / 2**20:.1f} MiB;"
                f" again after one late node: {second['cpu_s']:.1f} s CPU",
            )
        )
    B.write_result(
        "warehouse_merge", args.out, args.quick, {"nodes": nodes}, rows, details, started
    )


def hourly(
    root: Path, date: str, nodes: int, details: dict[str, Any], args: Any, started: float
) -> None:
    rows = []
    for table in ("job_minutes", "rank_minutes"):
        first = run_merge(root, table, date, "0-0")
        run_merge(root, table, date, "1-22")
        last = run_merge(root, table, date, "23-23")
        day = 24 * (first["cpu_s"] + last["cpu_s"]) / 2
        details[table] = {"hour_00": first, "hour_23": last, "day_cpu_s_estimate": day}
        rows.append(
            B.row(
                f"hourly merges of a {nodes}-node open day of {table}: CPU a day",
                "(on one node; 24 x the mean of the first and the last)",
                day,
                "s",
                spread=f"hour 00 {first['cpu_s']:.1f} s, hour 23 {last['cpu_s']:.1f} s CPU"
                f" (wall {last['wall_s']:.1f} s, peak RSS {last['peak_rss_mib']:.0f} MiB)",
            )
        )
    B.write_result(
        "warehouse_merge_hourly", args.out, args.quick, {"nodes": nodes}, rows, details, started
    )


if __name__ == "__main__":
    main()
