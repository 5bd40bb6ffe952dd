"""The warehouse export of real daemons: rows indexed (a capture through the agent socket;
step minutes and incidents through the index's own repositories, as the loop writes them)
reach the warehouse, on local disk or on a real S3 endpoint (moto), each exactly once, and
stay so across an S3 outage, a full disk, and a daemon killed between writing an object and
unmarking its partition."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zmq
from daemonproc import wait_for
from harness import Daemon
from rawpeer import TracePeer, small_trace
from s3fixtures import BUCKET, MotoServer, moto_server  # noqa: F401  (the fixture)
from test_disk_full import fill, tmpfs  # noqa: F401  (the fixture)

from profd.ctl.connection import Connection, decode_reply
from profd.store.index import Database, IncidentRepo, StepMinuteRepo
from profd.warehouse.arrow import SCHEMAS
from profd.warehouse.reader import overlays_from_reply
from profd.warehouse.tables import fleet_serial

WAIT = 30.0
#: Two daemons' flush processes and a profctl query a look: under a full suite's load each
#: takes seconds, and a merge then its hand-overs take several flushes of each node.
MERGE_WAIT = 120.0
FAST = "[warehouse]\nflush_every = 0.5\n"


def last_minute() -> int:
    return int(time.time()) // 60 * 60 - 60


def feed(
    d: Daemon,
    ranks: int = 3,
    incident: str | None = "inc-1",
    minute: int | None = None,
    **doc: Any,
) -> None:
    """One minute of ``ranks`` ranks of job ``wj`` and an incident, written as the loop
    writes them (the same repositories, so the same triggers). ``minute``: the minute before
    now, unless named (two feeds that must land in one minute name it)."""
    db = Database(d.state_dir / "index.db")
    try:
        minute = last_minute() if minute is None else minute
        StepMinuteRepo(db).add_step_minutes(
            [
                {"job": "wj", "host": "h", "role": "trainer", "rank": r, "pid": 100 + r,
                 "minute": minute, "steps": 10, "sum_s": 1.0 + r, "p50_ms": 100.0 + r,
                 "p90_ms": 120.0 + r, "max_ms": 150.0 + r, "regions": {"fwd": 0.5}}
                for r in range(ranks)
            ]
        )  # fmt: skip
        if incident is not None:
            IncidentRepo(db).save_incident(
                {"id": incident, "kind": "slow_rank", "job": "wj", "role": "trainer",
                 "host": "h", "state": "open", "detected_at": time.time(), "step": 7,
                 "suspects": [{"host": "h", "role": "trainer", "rank": 1}],
                 "evidence": {"why": "rank 1 is\nslow"}, **doc}
            )  # fmt: skip
    finally:
        db.close()


def local_rows(root: Path, table: str) -> pa.Table:
    # Each file read whole at once: pyarrow given a path may open it twice (its footer, then
    # its pages), and a flush replacing it in between hands it the new file's pages.
    files = sorted((root / table).glob("date=*/*.parquet"))
    return _concat(table, [pq.read_table(pa.BufferReader(f.read_bytes())) for f in files])


def s3_rows(srv: MotoServer, prefix: str, table: str) -> pa.Table:
    keys = [k for k in srv.objects(f"{prefix}{table}/") if k.endswith(".parquet")]
    return _concat(table, [pq.read_table(pa.BufferReader(srv.get(k))) for k in keys])


def _concat(table: str, parts: list[pa.Table]) -> pa.Table:
    for p in parts:
        assert p.schema.equals(SCHEMAS[table]), p.schema
    return pa.concat_tables(parts) if parts else SCHEMAS[table].empty_table()


def has_rows(read: Callable[[str], pa.Table], table: str, n: int) -> pa.Table | None:
    t = read(table)
    return t if t.num_rows >= n else None


def status(d: Daemon) -> dict[str, Any]:
    w: dict[str, Any] = d.ctl_json("status")["warehouse"]
    return w


def ask_warehouse(d: Daemon) -> Any:
    conn = Connection(str(d.runtime_dir), 15_000)
    try:
        return decode_reply(conn.exchange("warehouse"), "profd")
    finally:
        conn.close()


def test_rows_reach_the_local_warehouse_once_and_unwritten_rows_come_as_overlays(
    daemon_factory: Callable[..., Daemon], ctx: zmq.Context
) -> None:
    d = daemon_factory(config=FAST)
    root = d.state_dir / "warehouse"
    TracePeer(ctx, d, "wj").capture(small_trace)
    feed(d)

    def read(t: str) -> pa.Table:
        return local_rows(root, t)

    cap = wait_for(lambda: has_rows(read, "captures", 1), WAIT, "the capture's row")
    assert cap.column("job").to_pylist() == ["wj"] and cap.column("node")[0].as_py()
    assert cap.column("trace_key")[0].as_py().startswith("wj/")  # spool-relative: no S3
    ranks = wait_for(lambda: has_rows(read, "rank_minutes", 3), WAIT, "3 rank minutes")
    assert sorted(ranks.column("rank").to_pylist()) == [0, 1, 2]
    assert ranks.column("regions")[0].as_py() == [("fwd", 500.0)]
    job = wait_for(lambda: has_rows(read, "job_minutes", 1), WAIT, "the job's minute")
    assert job.select(["ranks", "steps", "p50_ms", "slowest_rank"]).to_pylist() == [
        {"ranks": 3, "steps": 30, "p50_ms": 101.0, "slowest_rank": 2}
    ]
    inc = wait_for(lambda: has_rows(read, "incidents", 1), WAIT, "the incident")
    assert inc.column("reason").to_pylist() == ["rank 1 is slow"]
    assert inc.column("suspects")[0].as_py() == [{"node": "h", "role": "trainer", "rank": 1}]

    # An update rewrites its partition: still one row, now resolved.
    feed(d, ranks=0, state="resolved", resolved_at=time.time(), lost_rank_s=12.5)
    wait_for(
        lambda: read("incidents").column("state").to_pylist() == ["resolved"], WAIT, "resolved"
    )
    assert read("incidents").column("lost_rank_s").to_pylist() == [12.5]
    wait_for(lambda: status(d)["pending_partitions"] == 0, WAIT, "nothing pending")
    for t in ("captures", "rank_minutes", "job_minutes", "incidents"):
        assert read(t).num_rows == {"rank_minutes": 3}.get(t, 1), t
    stem = status(d)["stem"]
    assert all(f.name.startswith(stem) for f in root.glob("*/date=*/*.parquet"))

    # Restarted with a long flush_every: the same instance, and what it has not written
    # yet comes in the warehouse request, the whole partition, as Arrow IPC.
    d.stop()
    d.config.write_text("[warehouse]\nflush_every = 3600\n")  # type: ignore[union-attr]
    d.start()
    feed(d, ranks=0, incident="inc-2")
    reply = ask_warehouse(d)
    assert (reply["url"], reply["stem"], reply["flush_every"]) == (f"{root}/", stem, 3600.0)
    (ov,) = overlays_from_reply(o for o in reply["overlays"] if o["table"] == "incidents")
    rows = ov.rows
    assert rows.schema.equals(SCHEMAS["incidents"])
    assert sorted(rows.column("id").to_pylist()) == ["inc-1", "inc-2"]
    assert read("incidents").num_rows == 1  # not written yet


def test_a_daemon_killed_after_writing_before_unmarking_rewrites_the_same_object(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(config=FAST, start=False, PROFD_FAULT_KILL="warehouse-written")
    feed(d)  # before the daemon: its first flush writes them, then dies
    d.launch("-v")
    assert d.proc is not None
    d.proc.wait(WAIT)
    d.proc = None
    root = d.state_dir / "warehouse"
    assert len(list(root.glob("*/date=*/*.parquet"))) == 1  # one object, its mark kept
    db = Database(d.state_dir / "index.db")
    assert len(db.conn.execute("SELECT * FROM warehouse_dirty").fetchall()) == 3
    db.close()
    d.extra_env.pop("PROFD_FAULT_KILL")
    d.start()
    wait_for(lambda: status(d)["pending_partitions"] == 0, WAIT, "every partition written")
    assert local_rows(root, "rank_minutes").num_rows == 3
    assert local_rows(root, "job_minutes").num_rows == 1
    assert local_rows(root, "incidents").num_rows == 1


def test_an_s3_outage_loses_and_duplicates_nothing(
    daemon_factory: Callable[..., Daemon],
    moto_server: MotoServer,  # noqa: F811
) -> None:
    d = daemon_factory(config=FAST, PROFD_S3_URL=f"s3://{BUCKET}/pfx", **moto_server.env())
    prefix = "pfx/warehouse/"
    assert status(d)["url"] == f"s3://{BUCKET}/{prefix}"
    minute = last_minute()  # both feeds' minute, however long the outage takes to notice
    feed(d, minute=minute)

    def read(t: str) -> pa.Table:
        return s3_rows(moto_server, prefix, t)

    wait_for(lambda: has_rows(read, "incidents", 1), WAIT, "the incident in S3")
    wait_for(lambda: has_rows(read, "rank_minutes", 3), WAIT, "the rank minutes in S3")
    moto_server.stop()
    feed(d, ranks=3, incident="inc-2", minute=minute)  # ranks 0-2 again: the minute merges them
    wait_for(lambda: status(d)["failing"], WAIT, "the export to notice the outage")
    assert status(d)["pending_partitions"] >= 1 and status(d)["last_error"]
    moto_server.start()  # empty again: only what the index still marks comes back
    inc = wait_for(lambda: has_rows(read, "incidents", 2), WAIT, "both incidents in S3")
    assert sorted(inc.column("id").to_pylist()) == ["inc-1", "inc-2"]
    wait_for(lambda: not status(d)["failing"], WAIT, "the export to recover")
    ranks = read("rank_minutes")
    assert sorted(ranks.column("rank").to_pylist()) == [0, 1, 2]
    assert ranks.column("steps").to_pylist() == [20, 20, 20]
    assert status(d)["pending_partitions"] == 0
    assert "cannot write" in d.log.read_text()


def test_a_full_disk_loses_nothing(
    daemon_factory: Callable[..., Daemon],
    tmpfs: Callable[[str, int], Path],  # noqa: F811
) -> None:
    fs = tmpfs("wh", 1)
    d = daemon_factory(config=f'[warehouse]\nflush_every = 0.5\nurl = "{fs}"\n')
    filler = fill(fs)
    feed(d)
    wait_for(lambda: status(d)["failing"], WAIT, "the export to fail on the full disk")
    assert not list(fs.glob("*/date=*/*.parquet"))
    assert not [p for p in fs.rglob(".tmp-*")]  # nothing half written left behind
    filler.unlink()
    wait_for(lambda: status(d)["pending_partitions"] == 0, WAIT, "the export to recover")
    assert local_rows(fs, "rank_minutes").num_rows == 3
    assert local_rows(fs, "incidents").num_rows == 1


def _maps_pyarrow(pid: int) -> bool:
    return "pyarrow" in Path(f"/proc/{pid}/maps").read_text()


def _children(pid: int) -> list[str]:
    return [
        c
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]


def test_the_daemon_never_loads_pyarrow_export_on_or_off(
    daemon_factory: Callable[..., Daemon],
) -> None:
    on = daemon_factory(config=FAST)
    off = daemon_factory(config="[warehouse]\nenabled = false\n")
    assert on.proc is not None and off.proc is not None
    feed(on)
    # Written by a flush process that has exited since; and the overlays built without it.
    root = on.state_dir / "warehouse"
    wait_for(lambda: local_rows(root, "incidents").num_rows == 1, WAIT, "the incident written")
    # The flush process clears its partitions' marks in the index before it exits, and the
    # daemon counts its objects once it has read the process's report: until then
    # ``pending_partitions`` (counted live) may read 0 beside the last flush's counters.
    wait_for(
        lambda: (lambda s: s["pending_partitions"] == 0 and s["objects_written"] >= 3)(status(on)),
        WAIT,
        "every partition written and counted",
    )
    assert status(on)["last_flush_cpu_s"] > 0
    # The overlays (built on the loop, from the index) need no pyarrow either.
    feed(on, ranks=0, incident="inc-2")
    ask_warehouse(on)
    assert not _maps_pyarrow(on.proc.pid)
    wait_for(lambda: not _children(on.proc.pid), WAIT, "the flush process to exit")  # type: ignore[union-attr]
    feed(off)
    assert status(off) == {"enabled": False}
    r = off.ctl("status")
    assert r.returncode == 0
    with pytest.raises(Exception, match="export is off"):
        ask_warehouse(off)
    assert not _maps_pyarrow(off.proc.pid)
    assert not (off.state_dir / "warehouse").exists()


def test_a_closed_day_is_sealed_in_s3_swept_and_read_once(
    daemon_factory: Callable[..., Daemon],
    moto_server: MotoServer,  # noqa: F811
) -> None:
    # seal_after far beyond the 3 days ever sealed: yesterday's rows go to an hourly object.
    # The seal on its own: no merging (the next test's).
    d = daemon_factory(
        config=FAST + "seal_after = 864000\nmerge = false\n",
        PROFD_S3_URL=f"s3://{BUCKET}/pfx",
        **moto_server.env(),
    )
    url = status(d)["url"]
    stem = status(d)["stem"]
    minute = (int(time.time()) - 30 * 3600) // 60 * 60
    date = time.strftime("%Y-%m-%d", time.gmtime(minute))
    hour = time.strftime("%H", time.gmtime(minute))
    feed(d, incident=None, minute=minute)

    def keys(table: str) -> list[str]:
        found = moto_server.objects(f"pfx/warehouse/{table}/date={date}/")
        return sorted(k.rsplit("/", 1)[1] for k in found)

    wait_for(lambda: keys("rank_minutes") == [f"{stem}~{hour}.parquet"], WAIT, "the hour")

    def count(*where: str) -> int:
        sql = "SELECT count(*) AS n FROM rank_minutes"
        rows: list[dict[str, int]] = d.ctl_json("query", *where, sql)
        return rows[0]["n"]

    assert count() == count("--warehouse", url) == 3
    # Sealed now, and its hourly objects deleted at once after.
    d.stop()
    assert d.config is not None
    d.config.write_text(FAST + "seal_after = 300\nsweep_after = 0\nmerge = false\n")
    d.start()
    wait_for(lambda: status(d)["days_swept"] >= 2, WAIT, "the day sealed and swept")
    assert status(d)["days_sealed"] == 2  # rank_minutes, job_minutes
    assert keys("rank_minutes") == keys("job_minutes") == [f"{stem}.parquet"]
    day = s3_rows(moto_server, "pfx/warehouse/", "rank_minutes")
    assert sorted(day.column("rank").to_pylist()) == [0, 1, 2]
    assert count() == count("--warehouse", url) == 3
    # A row of the sealed day that comes late: into the day object, and read once.
    feed(d, ranks=4, incident=None, minute=minute)
    wait_for(lambda: count("--warehouse", url) == 4, WAIT, "the late row in the day object")
    assert keys("rank_minutes") == [f"{stem}.parquet"] and count() == 4
    assert status(d)["pending_partitions"] == 0


def test_two_nodes_days_merge_into_one_fleet_object_in_s3_read_once_throughout(
    daemon_factory: Callable[..., Daemon],
    moto_server: MotoServer,  # noqa: F811
) -> None:
    """Two daemons writing one S3 warehouse: a closed day of each table is sealed by each,
    merged into one fleet object (by the first node of the table and date's turn, or by both
    once the day is hours late), and handed over by both (their own objects deleted); a late
    row of that day brings a node's day object back, which a second fleet object takes in.
    Every count, from S3 and through a node, is exact at every look."""
    fast = FAST + "seal_after = 300\nsweep_after = 0\nmerge_after = 600\n"
    env = {"PROFD_S3_URL": f"s3://{BUCKET}/fleet", **moto_server.env()}
    nodes = [daemon_factory(config=fast, PROFD_NODE_NAME=n, **env) for n in ("node-a", "node-b")]
    minute = (int(time.time()) - 30 * 3600) // 60 * 60
    date = time.strftime("%Y-%m-%d", time.gmtime(minute))
    for i, d in enumerate(nodes):
        feed(d, ranks=3, incident=f"inc-{i}", minute=minute, detected_at=minute + 10.0)
    url = status(nodes[0])["url"]

    def keys(table: str) -> list[str]:
        found = moto_server.objects(f"fleet/warehouse/{table}/date={date}/")
        return sorted(k.rsplit("/", 1)[1] for k in found)

    sql = (
        "SELECT (SELECT count(*) FROM rank_minutes) AS r, (SELECT count(*) FROM job_minutes)"
        " AS j, (SELECT count(*) FROM incidents) AS i"
    )
    seen: list[dict[str, int]] = []

    def counts() -> dict[str, int]:
        (row,) = nodes[1].ctl_json("query", "--warehouse", url, sql)
        seen.append(row)
        return dict(row)

    def fleets(tables: tuple[str, ...]) -> dict[str, int] | None:
        """Each table's fleet object serial, once its day is that one object only."""
        counts()
        out: dict[str, int] = {}
        for t in tables:
            names = keys(t)
            serial = fleet_serial(names[0]) if len(names) == 1 else None
            if serial is None:
                return None
            out[t] = serial
        return out

    wait_for(lambda: counts() == {"r": 6, "j": 2, "i": 2}, MERGE_WAIT, "both nodes' rows")
    seen.clear()
    first = wait_for(
        lambda: fleets(("rank_minutes", "job_minutes", "incidents")), MERGE_WAIT, "one fleet object"
    )
    # Read as often as the wait looked, from the seals to the last hand-over: exact.
    assert all(r == {"r": 6, "j": 2, "i": 2} for r in seen), seen
    assert all(status(d)["days_handed_to_fleet"] >= 3 for d in nodes)
    # Each table's turn picks its first merger, and a day closed hours ago lets both merge
    # (one more each hour late): count the fleet objects the two wrote together.
    assert sum(status(d)["fleet_objects_written"] for d in nodes) >= 3
    (row,) = nodes[0].ctl_json("query", sql)  # on a node: its unflushed rows too
    assert row == {"r": 6, "j": 2, "i": 2}
    (key,) = moto_server.objects(f"fleet/warehouse/rank_minutes/date={date}/")
    fleet = pq.read_table(pa.BufferReader(moto_server.get(key)))
    assert fleet.schema.names == [*SCHEMAS["rank_minutes"].names, "_source"]
    stems = sorted(status(d)["stem"] for d in nodes)
    assert sorted(zip(fleet["_source"].to_pylist(), fleet["rank"].to_pylist(), strict=True)) == [
        (s, r) for s in stems for r in range(3)
    ]

    # A late row of that day on node-b: its day object is back, then merged again.
    seen.clear()
    feed(nodes[1], ranks=4, incident=None, minute=minute)
    wait_for(lambda: counts()["r"] == 7, MERGE_WAIT, "the late row")
    minutes = ("rank_minutes", "job_minutes")  # the incidents' day did not change

    def again() -> bool:
        now = fleets(minutes)
        return now is not None and all(now[t] > first[t] for t in minutes)

    wait_for(lambda: again() and counts()["r"] == 7, MERGE_WAIT, "the day merged again")
    assert all(r["r"] in (6, 7) and r["j"] == 2 and r["i"] == 2 for r in seen), seen
    assert [r["r"] for r in seen] == sorted(r["r"] for r in seen)  # never back to 6
