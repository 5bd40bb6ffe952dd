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

    @property
    def source(self) -> str:
        """The fleet source (:data:`~profd.warehouse.tables.SOURCE`) of the object it
        stands in for: ``{stem}~{HH}`` for an hour, ``{stem}`` for a day."""
        hour = self.part.partition("/")[2]
        return f"{self.stem}~{hour}" if hour else self.stem


def arrow_table(table: str, cols: dict[str, list[Any]]) -> pa.Table:
    """A partition's columns (:func:`profd.warehouse.build.build`) with ``table``'s schema."""
    schema = SCHEMAS[table]
    return pa.Table.from_arrays([pa.array(cols[f.name], f.type) for f in schema], schema=schema)


def parquet_bytes(table: pa.Table) -> bytes:
    """The table as one Parquet file, zstd-compressed, in memory."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


class DayWriter:
    """One Parquet file written a part at a time (a day object, hour by hour), so that only
    the rows of the part being added and the compressed file are held in memory; rows are
    gathered into row groups of at least :data:`ROW_GROUP` rows (all of them if fewer)."""

    ROW_GROUP = 65536

    def __init__(self, table: str) -> None:
        self.out = pa.BufferOutputStream()
        self.writer = pq.ParquetWriter(self.out, SCHEMAS[table], compression="zstd")
        self.pending: list[pa.Table] = []
        self.held = 0
        self.rows = 0

    def add(self, rows: pa.Table) -> None:
        if not rows.num_rows:
            return
        self.pending.append(rows)
        self.held += rows.num_rows
        self.rows += rows.num_rows
        if self.held >= self.ROW_GROUP:
            self._write()

    def _write(self) -> None:
        if self.pending:
            self.writer.write_table(pa.concat_tables(self.pending), row_group_size=self.held)
            self.pending, self.held = [], 0

    def finish(self) -> bytes:
        """The whole file (a file with no rows, if none were added)."""
        self._write()
        self.writer.close()
        data: bytes = self.out.getvalue().to_pybytes()
        return data
