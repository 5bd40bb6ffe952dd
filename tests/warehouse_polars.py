"""The three warehouse questions answered a second way: Polars over the same Parquet files
(its own hive-partitioned scan and expressions, none of profd's reading code), so a test
can hold profctl's DuckDB answers against an engine that shares nothing with them.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import polars as pl


def scan(root: str, table: str, storage_options: dict[str, str] | None = None) -> pl.LazyFrame:
    """A table's rows, each once, told by the objects' names and the fleet objects'
    ``_source`` (docs/warehouse.md "Layout"). In each date: a writer's hourly objects are
    left out where it has a day object there (it sealed the day); of the fleet objects
    (``~fleet~{serial:08d}.parquet``) only the greatest name counts, and of its rows only
    those whose ``_source`` object is not there itself and whose writer has no day object
    there (those are read instead)."""
    glob = f"{root.rstrip('/')}/{table}/**/*.parquet"
    # Only fleet objects have ``_source``: the scan's schema is the first object's, plus it.
    first = pl.scan_parquet(glob, storage_options=storage_options, hive_partitioning=False)
    schema = {**first.collect_schema(), "_source": pl.String}
    path = pl.col("_path")
    name = path.str.extract(r"([^/]+)\.parquet$")
    fleet, hourly = pl.col("_fleet"), pl.col("_hourly")
    who, src = ["date", "_who"], ["date", "_from"]
    return (
        pl.scan_parquet(
            glob,
            hive_partitioning=True,
            storage_options=storage_options,
            include_file_paths="_path",
            schema=schema,
            missing_columns="insert",
        )
        .with_columns(
            _fleet=name.str.contains(r"^~fleet~[0-9]{8}$"),
            _hourly=name.str.contains(r"^[^~]+~[^~]+~[0-9]{2}$"),
            _from=pl.coalesce("_source", name),
        )
        .with_columns(_who=pl.col("_from").str.extract(r"^([^~]+~[^~]+)"))
        .filter(
            pl.when(fleet)
            .then(
                (path == pl.when(fleet).then(path).max().over("date"))
                & ~(~fleet).any().over(src)
                & ~(~fleet & ~hourly).any().over(who)
            )
            .otherwise(~(hourly & (~fleet & ~hourly).any().over(who)))
        )
        .drop("_path", "_fleet", "_hourly", "_who", "_from", "_source")
    )


def glob_regex(pattern: str) -> str:
    """A shell glob (``*``, ``?``, ``[...]``) as an anchored regular expression."""
    out = []
    for ch in re.split(r"(\*|\?|\[[^\]]*\])", pattern):
        if ch == "*":
            out.append(".*")
        elif ch == "?":
            out.append(".")
        elif ch.startswith("[") and ch.endswith("]") and len(ch) > 2:
            out.append(ch)
        else:
            out.append(re.escape(ch))
    return "^" + "".join(out) + "$"


def goodput_by_job(root: str, since: datetime, **so: Any) -> list[dict[str, Any]]:
    df = (
        scan(root, "incidents", so or None)
        .filter(pl.col("detected") >= since)
        .group_by("job")
        .agg(
            pl.len().alias("incidents"),
            (pl.col("lost_rank_s").sum() / 3600.0).alias("rank_hours_lost"),
        )
        .sort(["rank_hours_lost", "job"], descending=[True, False])
        .collect()
    )
    return df.to_dicts()


def nodes(root: str, since: datetime, **so: Any) -> list[dict[str, Any]]:
    hosted = (
        scan(root, "job_minutes", so or None)
        .filter(pl.col("minute") >= since)
        .group_by("node")
        .agg((pl.col("ranks").sum() / 60.0).alias("rank_hours"))
    )
    suspected = (
        scan(root, "incidents", so or None)
        .filter(pl.col("detected") >= since)
        .select("id", "job", "suspects")
        .explode("suspects")
        .select("id", "job", pl.col("suspects").struct.field("node").alias("node"))
        .unique()
    )
    hits = suspected.group_by("node").agg(
        pl.len().alias("incidents"),
        pl.col("job").unique().sort().str.join(",").alias("jobs"),
    )
    df = (
        hits.join(hosted, on="node", how="left")
        .with_columns((1000.0 * pl.col("incidents") / pl.col("rank_hours")).alias("per_1000"))
        .sort(
            ["incidents", "per_1000", "node"],
            descending=[True, True, False],
            nulls_last=[False, False, False],
        )
        .collect()
    )
    return df.to_dicts()


def trend(root: str, pattern: str, op: str, **so: Any) -> list[dict[str, Any]]:
    rx = glob_regex(pattern)
    keys = ["job", "session", "cycle"]
    per_rank = (
        scan(root, "operators", so or None)
        .filter((pl.col("name") == op) & pl.col("job").str.contains(rx))
        .group_by([*keys, "node", "role", "rank"])
        .agg((pl.col("self_ms").sum() / pl.col("steps").max()).alias("ms"))
    )
    caps = (
        scan(root, "captures", so or None)
        .filter(pl.col("job").str.contains(rx))
        .group_by(keys)
        .agg(pl.col("created").min())
    )
    df = (
        per_rank.join(caps, on=keys)
        .group_by([*keys, "created"])
        .agg(
            pl.len().alias("ranks"),
            pl.col("ms").mean().alias("ms_per_step"),
            pl.col("ms").min().alias("min_ms"),
            pl.col("ms").max().alias("max_ms"),
        )
        .sort(["created", *keys])
        .collect()
    )
    return df.to_dicts()
