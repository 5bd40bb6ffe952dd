"""DDL that makes the warehouse's tables queryable from Athena, Trino (Hive connector) and
Spark, built from :data:`SCHEMAS` so it cannot drift from what the daemon writes.
docs/warehouse.md holds its output (a unit test checks that it is the same text).

An hourly table is two statements: ``{table}_objects`` over every object, and the view
``{table}`` that leaves out the hourly objects a writer's day object supersedes (a sealed
day: docs/warehouse.md "Layout"). The view decides from the object names the one scan read,
so a seal landing while a query runs cannot make it read a row twice."""

from __future__ import annotations

import pyarrow as pa

from profd.warehouse.arrow import SCHEMAS
from profd.warehouse.tables import HOURLY

#: A writer's stem in an object's path, and an hourly object's name (``[.]``, not ``\.``:
#: Spark's string literals would take the backslash).
WRITER_RE = "([^/~]+~[^/~]+)(~[0-9][0-9])?[.]parquet$"
HOURLY_RE = "~[0-9][0-9][.]parquet$"


def sealed_view(name: str, source: str, columns: list[str], path: str, matches: str) -> str:
    """``CREATE VIEW name`` over ``source`` with each row once: a row of an hourly object is
    kept only where its writer has no day object in its date. ``path`` is the engine's
    expression for a row's object, ``matches`` its regex test with ``{s}`` and ``{re}``."""
    cols = ", ".join(columns)
    hourly = matches.format(s=path, re=f"'{HOURLY_RE}'")
    return (
        f"CREATE VIEW {name} AS\n"
        f"SELECT {cols} FROM (\n"
        "  SELECT o.*, bool_or(NOT hourly_) OVER (PARTITION BY date_, writer_) AS sealed_\n"
        "  FROM (\n"
        f"    SELECT t.*, t.{columns[-1]} AS date_,\n"
        f"      regexp_extract({path}, '{WRITER_RE}', 1) AS writer_,\n"
        f"      {hourly} AS hourly_\n"
        f"    FROM {source} t\n"
        "  ) o\n"
        ") s\n"
        "WHERE NOT hourly_ OR NOT sealed_;"
    )


_HIVE = {
    pa.string(): "string",
    pa.int32(): "int",
    pa.int64(): "bigint",
    pa.float64(): "double",
    pa.float32(): "float",
}
_TRINO = {
    pa.string(): "varchar",
    pa.int32(): "integer",
    pa.int64(): "bigint",
    pa.float64(): "double",
    pa.float32(): "real",
}


def _hive(t: pa.DataType) -> str:
    """A column type as Athena's and Spark's Hive DDL writes it."""
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_list(t):
        return f"array<{_hive(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ",".join(f"{f.name}:{_hive(f.type)}" for f in t) + ">"
    if pa.types.is_map(t):
        return f"map<{_hive(t.key_type)},{_hive(t.item_type)}>"
    return _HIVE[t]


def _trino(t: pa.DataType) -> str:
    if pa.types.is_timestamp(t):
        return "timestamp(3)"
    if pa.types.is_list(t):
        return f"array({_trino(t.value_type)})"
    if pa.types.is_struct(t):
        return "row(" + ", ".join(f"{f.name} {_trino(f.type)}" for f in t) + ")"
    if pa.types.is_map(t):
        return f"map({_trino(t.key_type)}, {_trino(t.item_type)})"
    return _TRINO[t]


def _names(table: str, quote: str) -> list[str]:
    return [f"{quote}{n}{quote}" for n in [*SCHEMAS[table].names, "date"]]


def athena(table: str, location: str = "s3://BUCKET/PREFIX") -> str:
    """``CREATE EXTERNAL TABLE`` with partition projection on ``date``: no partitions to
    load, new days are readable at once."""
    cols = ",\n".join(f"  `{f.name}` {_hive(f.type)}" for f in SCHEMAS[table])
    where = f"{location}/{table}/"
    name = f"{table}_objects" if table in HOURLY else table
    view = ""
    if table in HOURLY:
        view = "\n" + sealed_view(
            table, name, _names(table, '"'), '"$path"', "regexp_like({s}, {re})"
        )
    return (
        f"CREATE EXTERNAL TABLE {name} (\n{cols}\n)\n"
        "PARTITIONED BY (`date` string)\n"
        "STORED AS PARQUET\n"
        f"LOCATION '{where}'\n"
        "TBLPROPERTIES (\n"
        "  'projection.enabled' = 'true',\n"
        "  'projection.date.type' = 'date',\n"
        "  'projection.date.format' = 'yyyy-MM-dd',\n"
        "  'projection.date.range' = '2024-01-01,NOW',\n"
        "  'projection.date.interval' = '1',\n"
        "  'projection.date.interval.unit' = 'DAYS',\n"
        f"  'storage.location.template' = '{where}date=${{date}}/'\n"
        ");" + view
    )


def trino(table: str, location: str = "s3://BUCKET/PREFIX") -> str:
    """A Hive-connector table over the objects, and the call that finds new partitions
    (run it once a day, or after a day's first objects appear)."""
    cols = ",\n".join(f'  "{f.name}" {_trino(f.type)}' for f in SCHEMAS[table])
    name = f"{table}_objects" if table in HOURLY else table
    view = ""
    if table in HOURLY:
        view = "\n" + sealed_view(
            f"hive.profd.{table}",
            f"hive.profd.{name}",
            _names(table, '"'),
            '"$path"',
            "regexp_like({s}, {re})",
        )
    return (
        f"CREATE TABLE hive.profd.{name} (\n{cols},\n"
        '  "date" varchar\n'
        ")\nWITH (\n"
        f"  external_location = '{location}/{table}/',\n"
        "  format = 'PARQUET',\n"
        "  partitioned_by = ARRAY['date']\n"
        ");\n"
        f"CALL hive.system.sync_partition_metadata('profd', '{name}', 'FULL');" + view
    )


def spark(table: str, location: str = "s3a://BUCKET/PREFIX") -> str:
    """A Spark SQL table over the objects; ``MSCK REPAIR TABLE`` picks up new partitions."""
    cols = ",\n".join(f"  `{f.name}` {_hive(f.type)}" for f in SCHEMAS[table])
    name = f"{table}_objects" if table in HOURLY else table
    view = ""
    if table in HOURLY:
        view = "\n" + sealed_view(
            table, name, _names(table, "`"), "input_file_name()", "{s} RLIKE {re}"
        )
    return (
        f"CREATE TABLE {name} (\n{cols},\n"
        "  `date` string\n"
        ")\nUSING PARQUET\n"
        "PARTITIONED BY (`date`)\n"
        f"LOCATION '{location}/{table}/';\n"
        f"MSCK REPAIR TABLE {name};" + view
    )


ENGINES = {"athena": athena, "trino": trino, "spark": spark}
