"""DDL that makes the warehouse's tables queryable from Athena, Trino (Hive connector) and
Spark, built from :data:`SCHEMAS` so it cannot drift from what the daemon writes.
docs/warehouse.md holds its output (a unit test checks that it is the same text).

Each table is two statements: ``{table}_objects`` over every object of the table (its
columns, plus the fleet objects' ``_source``), and the view ``{table}`` that reads each row
once (docs/warehouse.md "Layout"). In each date it leaves out the hourly objects a writer's
day object supersedes (a sealed day), every fleet object but the chosen one (the highest
serial), and the chosen one's rows whose source (``_source``: the writer's object they came
from) an object of the writer's own stands for: the same object (an hour or a day), or the
writer's day object (those are read instead). The view decides from the object paths and
``_source`` values of the one scan it reads, so a seal or a new fleet object landing while a
query runs cannot make it read a row twice."""

from __future__ import annotations

import pyarrow as pa

from profd.warehouse.arrow import SCHEMAS
from profd.warehouse.tables import SOURCE

#: A writer's object's name less ``.parquet`` in its path, as a fleet row's ``_source`` names
#: it (``[.]``, not ``\.``: Spark's string literals would take the backslash; a fleet
#: object's name does not match), and the writer's stem at the start of such a name.
SOURCE_RE = "([^/~]+~[^/~]+(~[0-9][0-9])?)[.]parquet$"
STEM_RE = "^([^~]+~[^~]+)"
HOURLY_RE = "~[0-9][0-9][.]parquet$"
FLEET_RE = "/~fleet~[0-9]{8}[.]parquet$"


def sealed_view(name: str, source: str, columns: list[str], path: str, matches: str) -> str:
    """``CREATE VIEW name`` over ``source`` with each row once. In each date: a row of an
    hourly object is kept only where its writer has no day object; of the fleet objects only
    the chosen one (the greatest path) counts, and of its rows only those whose ``_source``
    object is not there itself and whose writer has no day object there. ``columns`` are the
    view's, quoted, ``date`` last; ``path`` is the engine's expression for a row's object,
    ``matches`` its regex test with ``{s}`` and ``{re}``."""
    cols = ", ".join(columns)
    date = columns[-1]
    src = date.replace("date", SOURCE)
    hourly = matches.format(s=path, re=f"'{HOURLY_RE}'")
    fleet = matches.format(s=path, re=f"'{FLEET_RE}'")
    return (
        f"CREATE VIEW {name} AS\n"
        f"SELECT {cols} FROM (\n"
        "  SELECT o.*,\n"
        "    bool_or(NOT fleet_ AND NOT hourly_) OVER (PARTITION BY date_, who_) AS sealed_,\n"
        "    bool_or(NOT fleet_) OVER (PARTITION BY date_, from_) AS own_,\n"
        "    max(CASE WHEN fleet_ THEN path_ END) OVER (PARTITION BY date_) AS chosen_\n"
        "  FROM (\n"
        "    SELECT p.*, regexp_extract(from_, '" + STEM_RE + "', 1) AS who_\n"
        "    FROM (\n"
        f"      SELECT t.*, t.{date} AS date_, {path} AS path_,\n"
        f"        COALESCE(t.{src}, regexp_extract({path}, '{SOURCE_RE}', 1)) AS from_,\n"
        f"        {hourly} AS hourly_,\n"
        f"        {fleet} AS fleet_\n"
        f"      FROM {source} t\n"
        "    ) p\n"
        "  ) o\n"
        ") s\n"
        "WHERE CASE WHEN fleet_ THEN path_ = chosen_ AND NOT own_ AND NOT sealed_\n"
        "  ELSE NOT (hourly_ AND sealed_) END;"
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


def _fields(table: str) -> list[pa.Field]:
    """The columns of ``{table}_objects`` but ``date``: the table's, then ``_source``."""
    return [*SCHEMAS[table], pa.field(SOURCE, pa.string())]


def athena(table: str, location: str = "s3://BUCKET/PREFIX") -> str:
    """``CREATE EXTERNAL TABLE`` with partition projection on ``date``: no partitions to
    load, new days are readable at once."""
    cols = ",\n".join(f"  `{f.name}` {_hive(f.type)}" for f in _fields(table))
    where = f"{location}/{table}/"
    name = f"{table}_objects"
    view = sealed_view(table, name, _names(table, '"'), '"$path"', "regexp_like({s}, {re})")
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
        ");\n" + view
    )


def trino(table: str, location: str = "s3://BUCKET/PREFIX") -> str:
    """A Hive-connector table over the objects, and the call that finds new partitions
    (run it once a day, or after a day's first objects appear)."""
    cols = ",\n".join(f'  "{f.name}" {_trino(f.type)}' for f in _fields(table))
    name = f"{table}_objects"
    view = sealed_view(
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
        f"CALL hive.system.sync_partition_metadata('profd', '{name}', 'FULL');\n" + view
    )


def spark(table: str, location: str = "s3a://BUCKET/PREFIX") -> str:
    """A Spark SQL table over the objects; ``MSCK REPAIR TABLE`` picks up new partitions."""
    cols = ",\n".join(f"  `{f.name}` {_hive(f.type)}" for f in _fields(table))
    name = f"{table}_objects"
    view = sealed_view(table, name, _names(table, "`"), "input_file_name()", "{s} RLIKE {re}")
    return (
        f"CREATE TABLE {name} (\n{cols},\n"
        "  `date` string\n"
        ")\nUSING PARQUET\n"
        "PARTITIONED BY (`date`)\n"
        f"LOCATION '{location}/{table}/';\n"
        f"MSCK REPAIR TABLE {name};\n" + view
    )


ENGINES = {"athena": athena, "trino": trino, "spark": spark}
