"""DDL that makes the warehouse's tables queryable from Athena, Trino (Hive connector) and
Spark, built from :data:`SCHEMAS` so it cannot drift from what the daemon writes.
docs/warehouse.md holds its output (a unit test checks that it is the same text)."""

from __future__ import annotations

import pyarrow as pa

from profd.warehouse.arrow import SCHEMAS

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


def athena(table: str, location: str = "s3://BUCKET/PREFIX") -> str:
    """``CREATE EXTERNAL TABLE`` with partition projection on ``date``: no partitions to
    load, new days are readable at once."""
    cols = ",\n".join(f"  `{f.name}` {_hive(f.type)}" for f in SCHEMAS[table])
    where = f"{location}/{table}/"
    return (
        f"CREATE EXTERNAL TABLE {table} (\n{cols}\n)\n"
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
        ");"
    )


def trino(table: str, location: str = "s3://BUCKET/PREFIX") -> str:
    """A Hive-connector table over the objects, and the call that finds new partitions
    (run it once a day, or after a day's first objects appear)."""
    cols = ",\n".join(f'  "{f.name}" {_trino(f.type)}' for f in SCHEMAS[table])
    return (
        f"CREATE TABLE hive.profd.{table} (\n{cols},\n"
        '  "date" varchar\n'
        ")\nWITH (\n"
        f"  external_location = '{location}/{table}/',\n"
        "  format = 'PARQUET',\n"
        "  partitioned_by = ARRAY['date']\n"
        ");\n"
        f"CALL hive.system.sync_partition_metadata('profd', '{table}', 'FULL');"
    )


def spark(table: str, location: str = "s3a://BUCKET/PREFIX") -> str:
    """A Spark SQL table over the objects; ``MSCK REPAIR TABLE`` picks up new partitions."""
    cols = ",\n".join(f"  `{f.name}` {_hive(f.type)}" for f in SCHEMAS[table])
    return (
        f"CREATE TABLE {table} (\n{cols},\n"
        "  `date` string\n"
        ")\nUSING PARQUET\n"
        "PARTITIONED BY (`date`)\n"
        f"LOCATION '{location}/{table}/';\n"
        f"MSCK REPAIR TABLE {table};"
    )


ENGINES = {"athena": athena, "trino": trino, "spark": spark}
