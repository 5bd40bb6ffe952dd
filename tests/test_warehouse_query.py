"""profctl query, goodput, nodes and trend as real processes over a real warehouse, on local
disk and in moto's S3 server, each answer held against Polars reading the same objects.

The warehouse is a small simulated fleet written with pyarrow and the layout functions
(bench/warehouse_fleet.py, which the benchmark writes at full size), once for the module,
its closed days sealed as the daemons seal them (with two nodes' superseded hourly objects
left in place, as inside a seal's grace period), and once more with the older days merged into
fleet objects; its S3 copy is the same files uploaded under a prefix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import warehouse_polars as WP
from daemonproc import BIN
from s3fixtures import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, MotoServer

from profd.warehouse import queries as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from warehouse_fleet import Fleet, generate

PREFIX = "fleet/warehouse"
#: The window the answers are compared over: inside the fleet's days, so some incidents,
#: minutes and captures fall before it.
SINCE_HOURS = 30
#: What the fleet fixture wrote (rows per table), by its root.
WRITTEN: dict[Path, dict[str, Any]] = {}


@dataclass
class Where:
    url: str
    env: dict[str, str]
    #: Where Polars reads the same objects, and how it reaches them.
    polars_root: str
    storage: dict[str, str]


@pytest.fixture(scope="module", params=["sealed", "merged"])
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Fleet]:
    """Sealed: each node's closed days one object per table. Merged: the days before
    yesterday also merged into fleet objects, two nodes' day objects still beside them (as
    inside their grace period), which every reader reads instead of their rows there."""
    root = tmp_path_factory.mktemp("warehouse")
    # Three days (one object per node and hour of job minutes is what keeps it small):
    # the window below cuts through every table's rows.
    f = Fleet(
        nodes=8,
        jobs=4,
        days=3,
        job_minute_days=2,
        rank_minute_hours=1,
        captures=60,
        incidents=120,
        bad_nodes=(3,),
        sealed=True,
        keep_hours_of=(0, 3),
        merged=request.param == "merged",
    )
    WRITTEN[root] = generate(f, root)
    return root, f


@pytest.fixture(scope="module")
def moto(
    tmp_path_factory: pytest.TempPathFactory, fleet: tuple[Path, Fleet]
) -> Iterator[MotoServer]:
    srv = MotoServer(tmp_path_factory.mktemp("moto")).start()
    try:
        client = srv.client()
        root = fleet[0]
        for p in sorted(root.rglob("*.parquet")):
            client.upload_file(str(p), BUCKET, f"{PREFIX}/{p.relative_to(root)}")
        yield srv
    finally:
        srv.stop()


def base_env(tmp: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PROFD_", "AWS_"))}
    # No daemon here: a runtime dir with nothing in it.
    e["PROFD_RUNTIME_DIR"] = str(tmp / "no-daemon")
    return e


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, fleet: tuple[Path, Fleet], tmp_path: Path) -> Where:
    root = fleet[0]
    env = base_env(tmp_path)
    if request.param == "local":
        return Where(str(root), env, str(root), {})
    srv: MotoServer = request.getfixturevalue("moto")
    env.update(srv.env())
    storage = {
        "aws_endpoint_url": srv.endpoint,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
        "aws_region": REGION,
        "aws_allow_http": "true",
    }
    return Where(f"s3://{BUCKET}/{PREFIX}", env, f"s3://{BUCKET}/{PREFIX}", storage)


def profctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "profctl"), *args], env=env, capture_output=True, text=True, timeout=120
    )


def rows(where: Where, *args: str) -> list[dict[str, Any]]:
    r = profctl(where.env, "--json", *args, "--warehouse", where.url)
    assert r.returncode == 0, r.stderr
    out: list[dict[str, Any]] = json.loads(r.stdout)
    return out


def since() -> datetime:
    # Whole seconds: profctl and Polars get the very same instant.
    return (datetime.now(UTC) - timedelta(hours=SINCE_HOURS)).replace(microsecond=0)


def close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-9, abs=1e-9)
    return bool(a == b)


def same(mine: list[dict[str, Any]], theirs: list[dict[str, Any]], pairs: dict[str, str]) -> None:
    """Row by row, in order: profctl's column ``k`` equals Polars' ``pairs[k]``."""
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine, theirs, strict=True):
        for k, v in pairs.items():
            assert close(a[k], b[v]), (k, a, b)


def test_goodput_matches_polars(where: Where) -> None:
    t = since()
    mine = rows(where, "goodput", "--since", t.isoformat())
    theirs = WP.goodput_by_job(where.polars_root, t, **where.storage)
    same(
        mine, theirs, {"job": "job", "incidents": "incidents", "rank_hours_lost": "rank_hours_lost"}
    )
    everything = rows(where, "goodput", "--since", "400d")
    assert sum(r["incidents"] for r in everything) > sum(r["incidents"] for r in mine)


def test_nodes_matches_polars(where: Where, fleet: tuple[Path, Fleet]) -> None:
    t = since()
    mine = rows(where, "nodes", "--since", t.isoformat())
    theirs = WP.nodes(where.polars_root, t, **where.storage)
    pairs = {"node": "node", "incidents": "incidents", "rank_hours": "rank_hours", "jobs": "jobs"}
    same(mine, theirs, {**pairs, "per_1000_rank_hours": "per_1000"})
    # The node the fleet made a repeat offender comes first.
    assert mine[0]["node"] == fleet[1].node(fleet[1].bad_nodes[0])


def test_trend_matches_polars(where: Where) -> None:
    mine = rows(where, "trend", "--job", "train-*", "--op", "aten::mm")
    theirs = WP.trend(where.polars_root, "train-*", "aten::mm", **where.storage)
    pairs = {k: k for k in ("job", "session", "cycle", "ranks", "ms_per_step", "min_ms", "max_ms")}
    same(mine, theirs, pairs)
    assert [datetime.fromisoformat(r["created"]) for r in mine] == [r["created"] for r in theirs]
    assert all(r["job"].startswith("train-") for r in mine)


def _utc_day(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t))


def test_each_row_is_read_once_across_sealed_days(where: Where, fleet: tuple[Path, Fleet]) -> None:
    root, f = fleet
    out = WRITTEN[root]
    want = {
        **{t: out["captures"][t] for t in ("captures", "operators", "rank_steps")},
        "job_minutes": out["job_minutes"]["rows"],
        "rank_minutes": out["rank_minutes"]["rows"],
    }
    # Sealed days, with the hourly objects a seal superseded still beside some day objects
    # (merged, job minutes are written as fleet objects: the captures' tables have them).
    assert sum(out["sealed"].values()) > 0
    kept = f.stem(3)
    both = [
        d for d in root.glob("*/date=*")
        if (d / f"{kept}.parquet").exists() and list(d.glob(f"{kept}~*.parquet"))
    ]  # fmt: skip
    assert both
    if f.merged:
        # Merged days, the kept nodes' day objects still beside the fleet objects.
        fleets = list(root.glob("*/date=*/~fleet~00000001.parquet"))
        # Rank minutes are the hour before the fleet's end: merged only where that hour is a
        # closed day's (the fleet made in the first hour of a UTC day), else nothing closed.
        merged = set(want) | {"incidents"}
        if _utc_day(f.end - 3600 * f.rank_minute_hours) == _utc_day(f.end):
            merged.discard("rank_minutes")
        assert {p.parent.parent.name for p in fleets} == merged
        assert any((p.parent / f"{kept}.parquet").exists() for p in fleets)
    sql = "SELECT " + ", ".join(f"(SELECT count(*) FROM {t}) AS {t}" for t in want)
    assert rows(where, "query", sql) == [want]
    for t, n in want.items():
        assert WP.scan(where.polars_root, t, where.storage or None).collect().height == n, t


def test_query_from_env_with_table_and_csv(where: Where) -> None:
    env = {**where.env, "PROFD_WAREHOUSE": where.url}
    sql = "SELECT job, count(*) AS n FROM incidents GROUP BY job ORDER BY job"
    r = profctl(env, "query", "--csv", sql)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    everything = WP.goodput_by_job(
        where.polars_root, datetime(2000, 1, 1, tzinfo=UTC), **where.storage
    )
    expect = sorted((x["job"], x["incidents"]) for x in everything)
    assert lines == ["job,n", *(f"{j},{n}" for j, n in expect)]
    r = profctl(env, "query", sql)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0].split() == ["JOB", "N"]


@pytest.mark.parametrize(
    ("sql", "says"),
    [
        ("SELECT * FROM read_parquet('/etc/hostname')", "Permission Error"),
        ("COPY incidents TO '/tmp/out.csv'", "only SELECT or WITH queries, got COPY"),
        ("SELECT 1; SELECT 2", "one statement at a time, got 2"),
        ("ATTACH '/tmp/x.db'", "only SELECT or WITH queries, got ATTACH"),
        ("SELECT id FROM incidents WHERE", 'near "WHERE" (line 1, column 26)'),
        ("SELECT * FROM read_csv('/etc/passwd')", "Permission Error"),
        ("SELECT id\nFROM incidents WHER id = 1", "(line 2, column 21)"),
        ("SET enable_external_access = true", "only SELECT or WITH queries, got SET"),
    ],
)
def test_query_refuses_with_one_line(
    fleet: tuple[Path, Fleet], tmp_path: Path, sql: str, says: str
) -> None:
    r = profctl(base_env(tmp_path), "query", "--warehouse", str(fleet[0]), sql)
    assert r.returncode == 1
    assert r.stdout == ""
    assert says in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


def test_a_missing_bucket_is_an_error_not_an_empty_answer(moto: MotoServer, tmp_path: Path) -> None:
    env = {**base_env(tmp_path), **moto.env()}
    r = profctl(env, "goodput", "--warehouse", f"s3://no-such-{BUCKET}/{PREFIX}")
    assert r.returncode == 1
    assert f"no bucket 'no-such-{BUCKET}'" in r.stderr


def test_without_warehouse_or_daemon_exits_3(tmp_path: Path) -> None:
    r = profctl(base_env(tmp_path), "goodput")
    assert r.returncode == 3
    assert "no profd daemon running" in r.stderr


def test_sql_prints_the_query(tmp_path: Path) -> None:
    for args, sql in (
        (("goodput", "--by", "kind"), Q.goodput_sql("kind")),
        (("nodes",), Q.NODES_SQL),
        (("trend", "--job", "x", "--op", "y"), Q.TREND_SQL),
    ):
        r = profctl(base_env(tmp_path), *args, "--sql")
        assert r.returncode == 0, r.stderr
        assert r.stdout == sql + "\n"
