"""The SQLite index (``index.db``), one repository per area over one shared connection.

:mod:`~profd.store.index.db` holds the connection (:class:`Database`: WAL, pragmas, the
schema brought up to date at a writable open) and its transactions; :mod:`.schema` the
tables, the stored version and one migration per version step. Each area is a small
repository over a :class:`Database`: :class:`SessionRepo` (sessions and targets),
:class:`InboxRepo` (captures received, before they are processed), :class:`TraceRepo`
(traces and their files), :class:`FileRepo` (the spool's files, their size and pruning),
:class:`UploadQueueRepo` (the upload columns of files), :class:`StepMinuteRepo` (step
history), :class:`IncidentRepo`, :class:`WarehouseQueueRepo` (what the warehouse export has
still to write). The daemon builds them once over the event loop's
connection and hands each component the ones it uses; upload workers open their own.
"""

from profd.store.index.db import Database, Repo, Transaction
from profd.store.index.files import FileRepo
from profd.store.index.history import (
    HISTORY_MAX_ROWS,
    MinuteRow,
    StepMinuteRepo,
    StoredMinute,
    history_rows,
    merged_figures,
)
from profd.store.index.inbox import INBOX_RAW_LEFT, InboxRepo
from profd.store.index.incidents import IncidentRepo
from profd.store.index.schema import SCHEMA, SCHEMA_VERSION, IndexSchemaError
from profd.store.index.sessions import SessionRepo
from profd.store.index.traces import PathTaken, TraceFilter, TraceRepo
from profd.store.index.upload_queue import UploadQueueRepo
from profd.store.index.warehouse_queue import Mark, WarehouseQueueRepo

__all__ = [
    "HISTORY_MAX_ROWS",
    "INBOX_RAW_LEFT",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Database",
    "FileRepo",
    "InboxRepo",
    "IncidentRepo",
    "IndexSchemaError",
    "Mark",
    "MinuteRow",
    "PathTaken",
    "Repo",
    "SessionRepo",
    "StepMinuteRepo",
    "StoredMinute",
    "TraceFilter",
    "TraceRepo",
    "Transaction",
    "UploadQueueRepo",
    "WarehouseQueueRepo",
    "history_rows",
    "merged_figures",
]
