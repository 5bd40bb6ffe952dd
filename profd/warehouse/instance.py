"""This daemon's writer instance: a random id kept in the state directory, part of every
object name it writes (``tables.writer_stem``), so that a reimaged node with the same name
starts objects of its own instead of overwriting its predecessor's. No pyarrow here: the
daemon reads it whether or not the export is on."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

FILE = "warehouse-instance"
_ID = re.compile(r"^[0-9a-f]{8,32}$")


def instance_id(state_dir: Path) -> str:
    """The id stored in ``state_dir``, made (and stored, atomically) on first use. A file
    that does not hold one (damaged) is replaced by a new id."""
    path = state_dir / FILE
    with contextlib.suppress(FileNotFoundError):
        text = path.read_text().strip()
        if _ID.match(text):
            return text
    new = secrets.token_hex(6)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILE}.{os.getpid()}")
    tmp.write_text(new + "\n")
    os.replace(tmp, path)
    return new
