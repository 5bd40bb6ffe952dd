"""Could one table of a table format (Iceberg, Delta Lake) take every node's flush? Commits a
second from many writers, what a commit costs as they pile up, and one node's day replaced in
one commit.

The warehouse's decision between its own layout and a table format (docs/warehouse.md, "Why
not Iceberg or Delta Lake") turns on one number: 1,024 nodes flushing every 60 s are 17
commits a second on each table. This measures what pyiceberg (the Python Iceberg library, a
SQL catalog; ``--format iceberg``) or delta-rs (``deltalake``; ``--format delta``, which
retries a blind append that lost the race itself) sustains on this machine: ``--writers``
processes each append 8 rows and commit, as fast as they can, for ``--seconds``; an Iceberg
commit that loses the race reloads the table and tries again. Then, on the table they made:
the time to plan a scan (the files a reader must open, Iceberg), and a compaction of one
node's day (its files replaced by one, in one ``overwrite`` commit), checked to keep every
row exactly once.

Not part of ``make bench`` or the smoke test: neither library is a dependency of profd. Run it in
a virtual environment of its own::

    python3 -m venv /tmp/ice
    /tmp/ice/bin/pip install 'pyiceberg[sql-postgres,sql-sqlite,pyarrow]==0.9.1' deltalake==1.6.6
    /tmp/ice/bin/python bench/bench_table_commits.py --writers 1,4,8 --pg-user pgice
    /tmp/ice/bin/python bench/bench_table_commits.py --writers 1,4,8 --format delta

The catalog is a PostgreSQL server this script starts in a temporary directory (``initdb`` and
``pg_ctl`` on ``PATH``; as root, ``--pg-user`` names the user it runs as, who must exist), or
SQLite with ``--sqlite`` (the embedded case); Delta Lake needs none (its log's next entry is
created only if absent, a rename on local disk). Data and metadata files go to local disk: an
upper bound on what S3 would allow, where every metadata read and write is a request. With
``--s3 MOTO_SERVER`` (Delta only) the table lives in a moto S3 server the script starts, each
log entry created by a conditional PUT (``If-None-Match: *``, delta-rs' ``aws_conditional_put
= etag``, no lock table), and the rows read back are checked against the commits made::

    /tmp/ice/bin/python bench/bench_table_commits.py --format delta --s3 .venv/bin/moto_server
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.expressions import And, EqualTo
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import DateType, DoubleType, LongType, NestedField, StringType

TABLE = "fleet.job_minutes"
DAY = datetime.date(2026, 11, 27)
SCHEMA = Schema(
    NestedField(1, "node", StringType(), required=False),
    NestedField(2, "job", StringType(), required=False),
    NestedField(3, "minute", LongType(), required=False),
    NestedField(4, "p50_ms", DoubleType(), required=False),
    NestedField(5, "date", DateType(), required=False),
)
SPEC = PartitionSpec(
    PartitionField(source_id=5, field_id=1000, transform=IdentityTransform(), name="date")
)
ARROW = pa.schema(
    [
        ("node", pa.string()),
        ("job", pa.string()),
        ("minute", pa.int64()),
        ("p50_ms", pa.float64()),
        ("date", pa.date32()),
    ]
)


def catalog(uri: str, warehouse: str) -> SqlCatalog:
    return SqlCatalog("fleet", uri=uri, warehouse=warehouse)


def rows(node: str, n: int = 8) -> pa.Table:
    """One flush of one node: a few minutes of one job."""
    return pa.table(
        {
            "node": [node] * n,
            "job": ["j"] * n,
            "minute": list(range(n)),
            "p50_ms": [random.random() for _ in range(n)],
            "date": [DAY] * n,
        },
        schema=ARROW,
    )


def writer(i: int, uri: str, warehouse: str, seconds: float, q: Any) -> None:
    cat = catalog(uri, warehouse)
    t = cat.load_table(TABLE)
    ok = lost = 0
    latency = []
    end = time.time() + seconds
    while time.time() < end:
        t0 = time.perf_counter()
        while time.time() < end + seconds:  # a writer that keeps losing gives up, counted
            try:
                t.append(rows(f"node{i}"))
            except CommitFailedException:  # another writer committed first: read it, retry
                lost += 1
                t = cat.load_table(TABLE)
                continue
            latency.append(time.perf_counter() - t0)
            ok += 1
            break
    q.put((ok, lost, latency))


def _writers(
    target: Any, args: tuple[Any, ...], writers: int, seconds: float, lost: str
) -> dict[str, Any]:
    """``writers`` processes of ``target(i, *args, seconds, queue)`` at once, and what they
    report: commits, a second, ``lost`` (the commits that lost or gave up), latency."""
    # Spawned, not forked: a forked writer would share the parent's catalog connections.
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    procs = [ctx.Process(target=target, args=(i, *args, seconds, q)) for i in range(writers)]
    t0 = time.time()
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    wall = time.time() - t0
    commits = sum(r[0] for r in results)
    latency = sorted(x for r in results for x in r[2]) or [0.0]
    return {
        "writers": writers,
        "seconds": round(wall, 1),
        "commits": commits,
        "commits_per_s": round(commits / wall, 2),
        lost: sum(r[1] for r in results),
        "commit_s_p50": round(latency[len(latency) // 2], 3),
        "commit_s_p90": round(latency[int(len(latency) * 0.9)], 3),
    }


def one_run(uri: str, warehouse: str, writers: int, seconds: float) -> dict[str, Any]:
    cat = catalog(uri, warehouse)
    try:
        cat.create_namespace("fleet")
    except Exception:  # it exists from the run before
        pass
    try:
        cat.drop_table(TABLE)
    except Exception:  # the first run
        pass
    cat.create_table(TABLE, SCHEMA, partition_spec=SPEC)
    runs = _writers(writer, (uri, warehouse), writers, seconds, "lost_races")
    t = cat.load_table(TABLE)
    meta = Path(t.metadata_location.removeprefix("file://"))
    p0 = time.perf_counter()
    files = list(t.scan().plan_files())
    plan_s = time.perf_counter() - p0
    # Compaction: node0's files of the day become one, in one commit that swaps them.
    c0 = time.perf_counter()
    node0 = t.scan(row_filter=EqualTo("node", "node0")).to_arrow()
    t.overwrite(
        node0, overwrite_filter=And(EqualTo("node", "node0"), EqualTo("date", DAY.isoformat()))
    )
    compact_s = time.perf_counter() - c0
    t = cat.load_table(TABLE)
    after = t.scan(row_filter=EqualTo("node", "node0")).to_arrow()
    node0_files = [f for f in t.scan(row_filter=EqualTo("node", "node0")).plan_files()]
    return {
        "format": "iceberg",
        **runs,
        "snapshots": len(t.metadata.snapshots),
        "metadata_json_bytes": meta.stat().st_size,
        "plan_files_s": round(plan_s, 3),
        "data_files": len(files),
        "compaction_commit_s": round(compact_s, 3),
        "node0_rows_before_after": [node0.num_rows, after.num_rows],
        "node0_same_rows": _same(node0, after),
        "node0_files_after": len(node0_files),
    }


def delta_writer(i: int, path: str, store: dict[str, str] | None, seconds: float, q: Any) -> None:
    from deltalake import write_deltalake

    ok = gave_up = 0
    latency = []
    end = time.time() + seconds
    while time.time() < end:
        t0 = time.perf_counter()
        try:
            write_deltalake(
                path, _delta_rows(f"node{i}"), mode="append", partition_by=["date"],
                storage_options=store,
            )  # fmt: skip
        except Exception:  # lost the race more times than delta-rs retries: counted
            gave_up += 1
            continue
        latency.append(time.perf_counter() - t0)
        ok += 1
    q.put((ok, gave_up, latency))


def _delta_rows(node: str) -> pa.Table:
    t = rows(node)  # Delta partitions by a string column here
    return t.set_column(4, "date", pa.array([DAY.isoformat()] * t.num_rows))


def delta_run(
    root: Path, writers: int, seconds: float, s3: tuple[str, dict[str, str]] | None = None
) -> dict[str, Any]:
    """One run of Delta Lake commits: on local disk, or with ``s3`` (a bucket URL and the
    storage options that reach it) in an S3-compatible store, where each commit is created
    only if absent by a conditional PUT (``If-None-Match``)."""
    from deltalake import DeltaTable, write_deltalake

    path, store = str(root / f"delta{writers}"), None
    if s3 is not None:
        path, store = f"{s3[0]}/delta{writers}", s3[1]
    write_deltalake(
        path, _delta_rows("first"), mode="append", partition_by=["date"], storage_options=store
    )
    runs = _writers(delta_writer, (path, store), writers, seconds, "gave_up")
    dt = DeltaTable(path, storage_options=store)
    files = len(dt.file_uris())
    # Every commit a writer was told succeeded holds its 8 rows, none twice: a store whose
    # conditional PUT let two writers take one log entry would lose one of them here.
    rows_read = dt.to_pyarrow_table().num_rows
    node0 = [("node", "=", "node0")]
    c0 = time.perf_counter()
    before = dt.to_pyarrow_table(filters=node0)
    write_deltalake(
        path, before, mode="overwrite", predicate="node = 'node0'", partition_by=["date"],
        storage_options=store,
    )  # fmt: skip
    compact_s = time.perf_counter() - c0
    dt = DeltaTable(path, storage_options=store)
    after = dt.to_pyarrow_table(filters=node0)
    return {
        "format": "delta",
        "store": "s3" if s3 is not None else "local",
        **runs,
        "rows_committed_read": [8 * (runs["commits"] + 1), rows_read],
        "log_entries": dt.version(),
        "data_files": files,
        "compaction_commit_s": round(compact_s, 3),
        "node0_rows_before_after": [before.num_rows, after.num_rows],
        "node0_same_rows": _same(before, after),
        "data_files_after": len(dt.file_uris()),
    }


def _same(a: pa.Table, b: pa.Table) -> bool:
    return sorted(a.to_pylist(), key=repr) == sorted(b.to_pylist(), key=repr)


def _as(user: str | None, cmd: str) -> None:
    subprocess.run(["su", user, "-c", cmd] if user else ["sh", "-c", cmd], check=True)


def postgres(root: Path, user: str | None, port: int) -> str:
    if user:
        shutil.chown(root, user)
    data = root / "data"
    _as(user, f"initdb -D {data} -A trust -U fleet >/dev/null")
    _as(
        user,
        f"pg_ctl -D {data} -l {root}/log -w start"
        f" -o '-p {port} -k {root} -c listen_addresses=127.0.0.1' >/dev/null",
    )
    _as(user, f"createdb -h 127.0.0.1 -p {port} -U fleet fleet")
    return f"postgresql+psycopg2://fleet@127.0.0.1:{port}/fleet"


def moto_store(
    server: str, port: int
) -> tuple[subprocess.Popen[bytes], tuple[str, dict[str, str]]]:
    """A moto S3 server on 127.0.0.1:``port`` with one bucket; the bucket's URL and the
    delta-rs storage options that reach it (conditional PUT for the log: ``etag``)."""
    from pyarrow import fs

    proc = subprocess.Popen([server, "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    endpoint = f"127.0.0.1:{port}"
    s3fs = fs.S3FileSystem(access_key="bench", secret_key="bench", endpoint_override=endpoint,
                           scheme="http", region="us-east-1",
                           allow_bucket_creation=True)  # fmt: skip
    for _ in range(100):
        try:
            s3fs.create_dir("tables")
            break
        except OSError:  # not listening yet
            time.sleep(0.1)
    store = {
        "AWS_ENDPOINT_URL": f"http://{endpoint}", "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
        "aws_conditional_put": "etag",
    }  # fmt: skip
    return proc, ("s3://tables", store)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--writers", default="1,4,8", help="writer processes, one run each")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--format", choices=("iceberg", "delta"), default="iceberg")
    ap.add_argument("--sqlite", action="store_true", help="a SQLite catalog, no server")
    ap.add_argument("--pg-user", default=None, help="run PostgreSQL as this user (as root)")
    ap.add_argument("--port", type=int, default=55433)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument(
        "--s3",
        metavar="MOTO_SERVER",
        help="Delta only: the table in a moto S3 server this script starts from this"
        " executable (e.g. the repository's .venv/bin/moto_server)",
    )
    args = ap.parse_args()
    if args.s3 and args.format != "delta":
        ap.error("--s3 is for --format delta")
    iceberg = args.format == "iceberg"
    if iceberg and os.geteuid() == 0 and not args.sqlite and not args.pg_user:
        ap.error("PostgreSQL will not run as root: name a user with --pg-user, or use --sqlite")
    root = Path(tempfile.mkdtemp(prefix="profd-iceberg-"))
    root.chmod(0o755)
    runs = []
    moto = None
    try:
        s3 = None
        if args.s3:
            moto, s3 = moto_store(args.s3, args.port + 1)
        uri = f"sqlite:///{root}/catalog.db"
        if iceberg and not args.sqlite:
            (root / "pg").mkdir()
            uri = postgres(root / "pg", args.pg_user, args.port)
        for w in (int(x) for x in args.writers.split(",")):
            if iceberg:
                warehouse = root / f"wh{w}"
                warehouse.mkdir()
                runs.append(one_run(uri, f"file://{warehouse}", w, args.seconds))
            else:
                runs.append(delta_run(root, w, args.seconds, s3))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait()
        if iceberg and not args.sqlite:
            subprocess.run(
                ["su", args.pg_user, "-c", f"pg_ctl -D {root}/pg/data stop -m fast >/dev/null"]
                if args.pg_user
                else ["pg_ctl", "-D", f"{root}/pg/data", "stop", "-m", "fast"],
                check=False,
            )
        shutil.rmtree(root, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    catalog = None if not iceberg else "sqlite" if args.sqlite else "postgresql"
    name = f"table_commits_{args.format}{'_s3' if args.s3 else ''}.json"
    (out / name).write_text(
        json.dumps({"format": args.format, "catalog": catalog, "runs": runs}, indent=1)
    )


if __name__ == "__main__":
    main()
