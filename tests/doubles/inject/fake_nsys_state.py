"""Shared state of the fake ``nsys`` TEST DOUBLE (stdlib only).

Imported both by ``tests/doubles/nsys`` (the CLI stand-in) and by the ``sitecustomize`` that the
fake ``nsys launch`` injects into the profiled processes. A session is a directory holding:

- ``launch.json``: what ``nsys launch`` was asked to run;
- ``collection.json``: present while a collection (``nsys start``) is running:
  ``{"base", "max_ranges", "ranges", "open"}``, where ``open`` is ``null`` or the capture range
  being recorded, ``{"index", "events"}``;
- ``lock``: ``fcntl.flock`` target guarding every read-modify-write of ``collection.json``.

The reports are JSON, not real ``.nsys-rep`` files; only this double can read them.

Like nsys, the double converts a range's ``.qdstrm`` into the report only when a
``QdstrmImporter`` sits beside it (``tests/doubles/QdstrmImporter``, a stand-in). A copy of
the double without one behaves like the nsys inside Nsight Compute: it prints nsys's importer
error and leaves only the ``.qdstrm``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

COLLECTION = "collection.json"
#: The folder of the ``nsys`` double (this file is in its ``inject/``).
DOUBLE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
IMPORTER = "QdstrmImporter"
#: What nsys 2025.3 (the copy inside Nsight Compute) prints when it cannot import.
IMPORTER_ERROR = (
    "Importer error status: An unknown error occurred.\n"
    "Unable to retrieve the importer version: skipping importation of the QDSTRM file."
)
LOCK = "lock"
REPORT_SUFFIX = ".nsys-rep"

Collection = dict[str, Any]


@contextlib.contextmanager
def locked(session_dir: str) -> Iterator[None]:
    """Hold the session's exclusive lock (raises FileNotFoundError if the session is gone)."""
    with open(os.path.join(session_dir, LOCK), "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def write_json_atomic(path: str, obj: object) -> None:
    """Write ``obj`` to a hidden temporary file next to ``path``, then rename it into place."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def collection_path(session_dir: str) -> str:
    return os.path.join(session_dir, COLLECTION)


def read_collection(session_dir: str) -> Collection | None:
    """The running collection, or None when nsys has not been told to collect."""
    try:
        with open(collection_path(session_dir)) as fh:
            coll: Collection = json.load(fh)
    except FileNotFoundError:
        return None
    return coll


def save_collection(session_dir: str, coll: Collection) -> None:
    write_json_atomic(collection_path(session_dir), coll)


def remove_collection(session_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(collection_path(session_dir))


def report_path(base: str, index: int) -> str:
    """nsys naming for ``repeat:N``: BASE.nsys-rep, then BASE.2.nsys-rep, BASE.3.nsys-rep..."""
    return f"{base}{REPORT_SUFFIX}" if index == 1 else f"{base}.{index}{REPORT_SUFFIX}"


def write_report(session_dir: str, coll: Collection) -> str:
    """Write the open range's report as nsys would: ``.qdstrm`` first, then the ``.nsys-rep``."""
    rng = coll["open"]
    path = report_path(coll["base"], rng["index"])
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    qdstrm = path[: -len(REPORT_SUFFIX)] + ".qdstrm"
    report = {
        "fake_nsys_report": True,
        "session": os.path.basename(os.path.normpath(session_dir)),
        "range": rng["index"],
        "events": rng["events"],
    }
    if not can_import():
        write_json_atomic(qdstrm, report)
        print(IMPORTER_ERROR, file=sys.stderr, flush=True)
        return qdstrm
    open(qdstrm, "w").close()
    write_json_atomic(path, report)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(qdstrm)
    return path


def can_import() -> bool:
    return os.access(os.path.join(DOUBLE_DIR, IMPORTER), os.X_OK)


def close_range(session_dir: str, coll: Collection) -> None:
    """Finalise the open range; the collection ends with its last range. Caller holds the lock."""
    write_report(session_dir, coll)
    coll["open"] = None
    if coll["ranges"] >= coll["max_ranges"]:
        remove_collection(session_dir)
    else:
        save_collection(session_dir, coll)
