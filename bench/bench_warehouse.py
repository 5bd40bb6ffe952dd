"""Warehouse queries on a simulated fleet: profctl goodput, trend and nodes, local and in S3.

A fleet of 1,024 nodes x 8 ranks and 128 jobs (bench/warehouse_fleet.py: one object per
writer and partition, as the daemon's export writes them) is generated once into a local
directory: 30 days of incidents (each with lost_rank_s), 10,000 captures with their ranks'
steps and operators, one day of rank minutes, and job minutes (``--job-minute-days``, one
object per node and hour: the default 1 day is 25,600 objects; the 30 days of the target
are 737,280, about 4 GB and half an hour to write on a 2-core machine). ``--sealed`` seals
every closed day as the daemons do (one object per node, day and hourly table). The incidents
table is uploaded to a local moto S3 server. ``profctl goodput --since 30d``, ``profctl
trend`` (over all 10,000 captures) and ``profctl nodes`` run as real processes (start-up
and imports included), ``--repeat`` times.

Baseline: the goodput question answered the way a fleet without a warehouse would, each
node's own SQLite index asked one after another (as ``--cluster`` fans out to every node)
and the answers merged: 1,024 SQLite files, each with that node's incidents. It leaves out
the network round trip to each node and every node that is down or reimaged (whose rows
are gone); ``trend`` and ``nodes`` have no such baseline (a node keeps only its own
captures and minutes, for its own retention).

Targets: goodput p50 <= 2 s from local disk, <= 10 s from S3; trend <= 2 s; nodes <= 2 s.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_s3
import benchlib as B
import pyarrow.parquet as pq
from warehouse_fleet import Fleet, generate

PROFCTL = str(Path(sys.executable).parent / "profctl")
PREFIX = "warehouse"


def fleet_for(quick: bool, job_minute_days: float, sealed: bool, merged: bool = False) -> Fleet:
    if quick:
        return Fleet(
            sealed=sealed,
            merged=merged,
            nodes=16,
            jobs=4,
            days=3,
            job_minute_days=1,
            rank_minute_hours=1,
            captures=40,
            incidents=60,
            bad_nodes=(3,),
        )
    return Fleet(job_minute_days=job_minute_days, incidents=5_000, sealed=sealed, merged=merged)


def profctl(env: dict[str, str], *args: str) -> tuple[float, list[dict[str, Any]]]:
    t0 = time.monotonic()
    r = subprocess.run(
        [PROFCTL, "--json", *args], env=env, capture_output=True, text=True, timeout=600
    )
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"profctl {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    rows: list[dict[str, Any]] = json.loads(r.stdout)
    return took, rows


def timed(env: dict[str, str], n: int, *args: str) -> tuple[list[float], list[dict[str, Any]]]:
    times, rows = [], []
    for _ in range(n):
        t, rows = profctl(env, *args)
        times.append(t)
    print(f"profctl {' '.join(args)}: {', '.join(f'{t:.2f}' for t in times)} s", file=sys.stderr)
    return times, rows


def sqlite_nodes(f: Fleet, root: Path, out: Path) -> int:
    """One SQLite file per node holding the incidents that node wrote: the per-node index
    a fan-out would ask."""
    out.mkdir(parents=True)
    per_node: dict[str, list[tuple[Any, ...]]] = {f.node(i): [] for i in range(f.nodes)}
    for p in (root / "incidents").rglob("*.parquet"):
        t = pq.read_table(p, columns=["id", "kind", "job", "node", "detected", "lost_rank_s"])
        for r in t.to_pylist():
            per_node[r["node"]].append(
                (r["id"], r["kind"], r["job"], r["detected"].timestamp(), r["lost_rank_s"])
            )
    for node, rows in per_node.items():
        db = sqlite3.connect(out / f"{node}.db")
        db.execute(
            "CREATE TABLE incidents (id TEXT PRIMARY KEY, kind TEXT, job TEXT,"
            " detected REAL, lost_rank_s REAL)"
        )
        db.execute("CREATE INDEX incidents_detected ON incidents (detected)")
        db.executemany("INSERT INTO incidents VALUES (?,?,?,?,?)", rows)
        db.commit()
        db.close()
    return sum(len(r) for r in per_node.values())


def fan_out_goodput(dbs: Path, since: float) -> tuple[float, dict[str, float]]:
    """Every node's index asked in turn, the answers merged: rank-hours lost per job."""
    t0 = time.monotonic()
    lost: dict[str, float] = {}
    for p in sorted(dbs.glob("*.db")):
        db = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
        for job, s in db.execute(
            "SELECT job, sum(lost_rank_s) FROM incidents WHERE detected >= ? GROUP BY job",
            (since,),
        ):
            lost[job] = lost.get(job, 0.0) + s / 3600.0
        db.close()
    return time.monotonic() - t0, lost


def upload(root: Path, table: str, endpoint: str) -> tuple[int, float]:
    import pyarrow.fs as pafs

    s3 = pafs.S3FileSystem(
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
        endpoint_override=endpoint.split("://", 1)[1],
        scheme="http",
    )
    t0 = time.monotonic()
    pafs.copy_files(
        str(root / table),
        f"{bench_s3.BUCKET}/{PREFIX}/{table}",
        source_filesystem=pafs.LocalFileSystem(),
        destination_filesystem=s3,
        use_threads=True,
    )
    return sum(1 for _ in (root / table).rglob("*.parquet")), time.monotonic() - t0


def s3_env(endpoint: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PROFD_", "AWS_"))}
    e.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_ENDPOINT_URL=endpoint,
        PROFD_RUNTIME_DIR="/nonexistent",
    )
    return e


def agree(a: dict[str, float], b: dict[str, float]) -> bool:
    return set(a) == set(b) and all(abs(a[k] - b[k]) <= 1e-9 * max(1.0, abs(b[k])) for k in a)


def main() -> None:
    p = B.parser(__doc__)
    p.add_argument("--repeat", type=int, default=5, help="runs of each query")
    p.add_argument(
        "--job-minute-days",
        type=float,
        default=1,
        help="days of job minutes (1,024 nodes x 24 objects a day)",
    )
    p.add_argument("--keep", help="generate into (or reuse) this directory")
    p.add_argument(
        "--sealed",
        action="store_true",
        help="closed days sealed as the daemons seal them (one object per node, day and table)",
    )
    p.add_argument(
        "--merged",
        action="store_true",
        help="closed days merged as the daemons merge them (one fleet object per table and day)",
    )
    args = p.parse_args()
    quick = args.quick
    # moto's fake credentials, for this process's own S3 client only.
    for k, v in s3_env("http://unused").items():
        if k.startswith("AWS_") and k != "AWS_ENDPOINT_URL":
            os.environ[k] = v
    started = time.monotonic()
    f = fleet_for(quick, args.job_minute_days, args.sealed, args.merged)
    # --quick: each query once; a second run of a ~0.6 s profctl start-up checks no path more.
    n = 1 if quick else args.repeat
    tmp = Path(tempfile.mkdtemp(prefix="bench-warehouse-"))
    root = Path(args.keep) if args.keep else tmp / "warehouse"
    moto = None
    try:
        if (root / "fleet.json").exists():
            made = json.loads((root / "fleet.json").read_text())
            f.end = made["end"]
        else:
            made = {"end": f.end, **generate(f, root)}
            (root / "fleet.json").write_text(json.dumps(made))
        print(f"fleet: {json.dumps(made['objects'])}", file=sys.stderr)
        local = s3_env("http://unused")
        local["PROFD_WAREHOUSE"] = str(root)
        q: dict[str, list[float]] = {}
        answers: dict[str, list[dict[str, Any]]] = {}
        # One instant for every run and the baseline: "30d ago" moves while they run.
        since = time.time() - 30 * 86400
        window = ("--since", datetime.fromtimestamp(since, UTC).isoformat())
        q["goodput_local"], answers["goodput"] = timed(local, n, "goodput", *window)
        q["trend"], answers["trend"] = timed(local, n, "trend", "--job", "*", "--op", "aten::mm")
        q["nodes"], answers["nodes"] = timed(local, n, "nodes", *window)

        port = B.free_port()
        moto = bench_s3.start_moto(port, tmp / "moto.log")
        endpoint = f"http://127.0.0.1:{port}"
        bench_s3.client(endpoint).create_bucket(Bucket=bench_s3.BUCKET)
        uploaded, upload_s = upload(root, "incidents", endpoint)
        remote = s3_env(endpoint)
        remote["PROFD_WAREHOUSE"] = f"s3://{bench_s3.BUCKET}/{PREFIX}"
        q["goodput_s3"], s3_answer = timed(remote, n, "goodput", *window)

        fanned_rows = sqlite_nodes(f, root, tmp / "nodes")
        fan = [fan_out_goodput(tmp / "nodes", since) for _ in range(n)]
        fan_s = [t for t, _ in fan]
        by_job = fan[-1][1]
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)

    # The three answers agree where they answer the same question.
    # (Sums of floats in another order: equal to within rounding.)
    mine = {r["job"]: r["rank_hours_lost"] for r in answers["goodput"]}
    assert agree(mine, {r["job"]: r["rank_hours_lost"] for r in s3_answer}), "local, S3 differ"
    assert agree(mine, by_job), "warehouse and fan-out differ"
    assert answers["trend"] and answers["nodes"]

    s = {k: B.summary(v, 3) for k, v in q.items()}
    base = B.summary(fan_s, 3)
    full = not quick
    rows = [
        B.row(
            "goodput --since 30d, local disk (p50)",
            "<= 2 s",
            s["goodput_local"]["p50"],
            "s",
            baseline=base["p50"],
            baseline_what=f"fan-out over {f.nodes} per-node SQLite files, no network",
            met=s["goodput_local"]["p50"] <= 2 if full else None,
            spread=f"max {s['goodput_local']['max']} s",
        ),
        B.row(
            "goodput --since 30d, moto S3 (p50)",
            "<= 10 s",
            s["goodput_s3"]["p50"],
            "s",
            baseline=base["p50"],
            baseline_what=f"fan-out over {f.nodes} per-node SQLite files, no network",
            met=s["goodput_s3"]["p50"] <= 10 if full else None,
            spread=f"max {s['goodput_s3']['max']} s",
        ),
        B.row(
            f"trend over {f.captures:,} captures (p50)",
            "<= 2 s",
            s["trend"]["p50"],
            "s",
            met=s["trend"]["p50"] <= 2 if full else None,
            spread=f"max {s['trend']['max']} s",
        ),
        B.row(
            f"nodes --since 30d, {f.job_minute_days:g} days of job minutes"
            f"{', sealed' if f.sealed else ''}{', merged' if f.merged else ''} (p50)",
            "<= 2 s",
            s["nodes"]["p50"],
            "s",
            met=s["nodes"]["p50"] <= 2 if full and f.job_minute_days >= 30 else None,
            spread=f"max {s['nodes']['max']} s",
        ),
    ]
    details = {
        "objects": made["objects"],
        "sealed_objects": made.get("sealed"),
        "merged_days": made.get("merged"),
        "bytes": made["bytes"],
        "generate_s": {
            k: made[k]["write_s"] for k in ("incidents", "captures", "job_minutes", "rank_minutes")
        },
        "rows": {k: made[k] for k in ("incidents", "captures", "job_minutes", "rank_minutes")},
        "query_s": s,
        "fan_out_s": base,
        "fan_out_rows": fanned_rows,
        "s3_objects": uploaded,
        "s3_upload_s": round(upload_s, 1),
        "answers": {k: len(v) for k, v in answers.items()},
    }
    params = {
        "nodes": f.nodes,
        "ranks_per_node": f.ranks_per_node,
        "jobs": f.jobs,
        "days": f.days,
        "job_minute_days": f.job_minute_days,
        "rank_minute_hours": f.rank_minute_hours,
        "captures": f.captures,
        "capture_ranks": f.capture_ranks,
        "incidents": f.incidents,
        "sealed": f.sealed,
        "merged": f.merged,
        "repeat": n,
    }
    B.write_result("warehouse", args.out, quick, params, rows, details, started)


if __name__ == "__main__":
    main()
