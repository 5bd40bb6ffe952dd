"""The warehouse's tables: their columns (one Arrow schema each, the only definition; the docs
and the DDL in docs/warehouse.md are checked against it) and where their objects live.

Layout (docs/warehouse.md "Layout"): ``{url}/{table}/date=YYYY-MM-DD/{stem}.parquet``, where
the stem names the writer: ``{node}~{instance}`` (``instance``: a random id the daemon keeps in
its state directory, so a reimaged node with the same name never overwrites the files of the
one before it), plus ``~{HH}`` (the UTC hour) for the hourly tables (all but ``incidents``).
Each writer owns its objects and rewrites one whole object per flush (a single PUT, or a
rename on disk): every row is in exactly one object at every moment, with no compaction,
and a day's files per table are one per writer (24 for the hourly tables).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyarrow as pa

_TS = pa.timestamp("ms", tz="UTC")
_SUSPECT = pa.struct([("node", pa.string()), ("role", pa.string()), ("rank", pa.int32())])

SCHEMAS: dict[str, pa.Schema] = {
    "captures": pa.schema(
        [
            ("job", pa.string()),
            ("session", pa.string()),
            ("node", pa.string()),
            ("host", pa.string()),
            ("role", pa.string()),
            ("rank", pa.int32()),
            ("world_size", pa.int32()),
            ("cycle", pa.int32()),
            ("step_first", pa.int64()),
            ("step_last", pa.int64()),
            ("backend", pa.string()),
            ("label", pa.string()),
            ("state", pa.string()),
            ("bytes", pa.int64()),
            ("stall_ms", pa.float64()),
            ("trace_key", pa.string()),
            ("created", _TS),
        ]
    ),
    "rank_steps": pa.schema(
        [
            ("job", pa.string()),
            ("session", pa.string()),
            ("node", pa.string()),
            ("role", pa.string()),
            ("rank", pa.int32()),
            ("cycle", pa.int32()),
            ("step", pa.int64()),
            ("ms", pa.float64()),
            ("compute_ms", pa.float64()),
            ("collective_ms", pa.float64()),
            ("idle_ms", pa.float64()),
            ("mode", pa.string()),
        ]
    ),
    "operators": pa.schema(
        [
            ("job", pa.string()),
            ("session", pa.string()),
            ("node", pa.string()),
            ("role", pa.string()),
            ("rank", pa.int32()),
            ("cycle", pa.int32()),
            ("name", pa.string()),
            ("kind", pa.string()),  # cpu | gpu | collective
            ("calls", pa.int64()),
            ("self_ms", pa.float64()),
            ("total_ms", pa.float64()),
            ("steps", pa.int32()),  # the steps the capture held: per step = self_ms / steps
        ]
    ),
    "job_minutes": pa.schema(
        [
            ("job", pa.string()),
            ("role", pa.string()),
            ("minute", _TS),
            ("node", pa.string()),
            ("nodes", pa.int32()),
            ("ranks", pa.int32()),
            ("steps", pa.int64()),
            ("p50_ms", pa.float64()),
            ("p90_ms", pa.float64()),
            ("max_ms", pa.float64()),
            ("slowest_rank", pa.int32()),
            ("slowest_node", pa.string()),
            ("vs_baseline", pa.float64()),
        ]
    ),
    "rank_minutes": pa.schema(
        [
            ("job", pa.string()),
            ("node", pa.string()),
            ("role", pa.string()),
            ("rank", pa.int32()),
            ("minute", _TS),
            ("steps", pa.int32()),
            ("p50_ms", pa.float32()),
            ("p90_ms", pa.float32()),
            ("p99_ms", pa.float32()),
            ("max_ms", pa.float32()),
            ("regions", pa.map_(pa.string(), pa.float32())),
        ]
    ),
    "incidents": pa.schema(
        [
            ("id", pa.string()),
            ("kind", pa.string()),
            ("job", pa.string()),
            ("role", pa.string()),
            ("node", pa.string()),
            ("state", pa.string()),
            ("detected", _TS),
            ("resolved", _TS),
            ("step", pa.int64()),
            ("suspects", pa.list_(_SUSPECT)),
            ("session", pa.string()),
            ("reason", pa.string()),
            ("lost_rank_s", pa.float64()),
        ]
    ),
}

TABLES = tuple(SCHEMAS)
#: Tables written one object per writer per UTC hour: a node's day of them is too large to
#: rewrite at every flush (at one capture a second, the day's capture tables cost the export
#: some 1.3 s of CPU per flush for each hour of the day so far: docs/benchmarks.md).
HOURLY = frozenset({"captures", "rank_steps", "operators", "job_minutes", "rank_minutes"})
#: Tables whose rows are kept ``keep_rank_days`` rather than ``keep_days``.
RANK_DAYS = frozenset({"rank_minutes"})

_PART = re.compile(r"^\d{4}-\d{2}-\d{2}(/\d{2})?$")
_STEM_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def check_part(table: str, part: str) -> None:
    """A partition as the export queue names it: ``YYYY-MM-DD``, or ``YYYY-MM-DD/HH`` for
    the hourly tables. ValueError otherwise."""
    if table not in SCHEMAS:
        raise ValueError(f"no warehouse table {table!r}")
    if not _PART.match(part) or (("/" in part) != (table in HOURLY)):
        raise ValueError(f"{table}: bad partition {part!r}")


def writer_stem(node: str, instance: str) -> str:
    """``{node}~{instance}`` with anything unsafe in an object key made ``_``."""
    return f"{_STEM_UNSAFE.sub('_', node)}~{_STEM_UNSAFE.sub('_', instance)}"


def object_key(table: str, part: str, stem: str) -> str:
    """The key, relative to the warehouse's root, of one writer's object for one partition."""
    check_part(table, part)
    date, _, hour = part.partition("/")
    name = f"{stem}~{hour}" if hour else stem
    return f"{table}/date={date}/{name}.parquet"


@dataclass(frozen=True)
class Overlay:
    """Rows a node holds that its objects do not have yet: a reader on that node uses
    ``rows`` in place of the object at ``object_key(table, part, stem)`` (present or not),
    so each row is still seen exactly once."""

    table: str
    part: str
    stem: str
    rows: pa.Table
