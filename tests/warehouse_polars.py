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
    """A table's rows, each once: a writer's hourly objects of a date are left out where
    that writer has a day object there (it sealed the day), told by the objects' names."""
    name = pl.col("_path").str.extract(r"([^/]+)\.parquet$")
    hourly = pl.col("_hourly")
    return (
        pl.scan_parquet(
            f"{root.rstrip('/')}/{table}/**/*.parquet",
            hive_partitioning=True,
            storage_options=storage_options,
            include_file_paths="_path",
        )
        .with_columns(
            _writer=name.str.extract(r"^([^~]*~[^~]*)"), _hourly=name.str.count_matches("~") == 2
        )
        .filter(~hourly | ~(~hourly).any().over(["date", "_writer"]))
        .drop("_path", "_writer", "_hourly")
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
