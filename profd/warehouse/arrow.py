"""The warehouse's tables in Arrow: their schemas (made from
:data:`~profd.warehouse.tables.COLUMNS`), a partition's columns as an Arrow table, and that
table as Parquet or Arrow IPC bytes.

pyarrow is loaded by whoever imports this module: the export's flush process
(:mod:`profd.warehouse.flush`) and ``profctl warehouse``, never the daemon itself.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from profd.warehouse.tables import COLUMNS

_TS = pa.timestamp("ms", tz="UTC")
_SUSPECT = pa.struct([("node", pa.string()), ("role", pa.string()), ("rank", pa.int32())])
_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "ts": _TS,
    "regions": pa.map_(pa.string(), pa.float32()),
    "suspects": pa.list_(_SUSPECT),
}

SCHEMAS: dict[str, pa.Schema] = {
    table: pa.schema([(name, _TYPES[kind]) for name, kind in cols])
    for table, cols in COLUMNS.items()
}


@dataclass(frozen=True)
class Overlay:
    """Rows a node holds that its objects do not have yet: a reader on that node uses
    ``rows`` in place of the object at ``object_key(table, part, stem)`` (present or not),
    so each row is still seen exactly once."""

    table: str
    part: str
    stem: str
    rows: pa.Table


def arrow_table(table: str, cols: dict[str, list[Any]]) -> pa.Table:
    """A partition's columns (:func:`profd.warehouse.build.build`) with ``table``'s schema."""
    schema = SCHEMAS[table]
    return pa.Table.from_arrays([pa.array(cols[f.name], f.type) for f in schema], schema=schema)


def parquet_bytes(table: pa.Table) -> bytes:
    """The table as one Parquet file, zstd-compressed, in memory."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()
