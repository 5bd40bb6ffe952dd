"""Replacing files so that a reader, or the machine after a crash, sees either the old file or
the whole new one, never a half-written or empty one."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

StrPath = str | os.PathLike[str]

#: A temporary file's name: ``.{final name}.tmp-{mkstemp's 8 characters, or a pid}``. A dotfile,
#: so that HTA and TensorBoard skip it; recognisable, so that what a killed process left behind
#: can be found again (:func:`is_temp_name`).
_TEMP = re.compile(r"\..+\.tmp-[a-z0-9_]+")


def temp_prefix(name: str) -> str:
    """The start of a temporary name for a file that will be called ``name``."""
    # A long name plus the suffix could pass NAME_MAX; the prefix only has to be recognisable.
    return f".{name[:100]}.tmp-"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one :func:`temp_prefix` made (plus mkstemp's or a pid suffix)."""
    return _TEMP.fullmatch(name) is not None


def atomic_write(path: StrPath, data: bytes | str, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` (``str`` is written as UTF-8).

    ``mode`` sets the permission bits exactly (``0o600`` for a secret); by default they are
    what ``open()`` would create: ``0o666`` less the umask.
    """
    with atomic_path(path, mode) as tmp, open(tmp, "wb") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_path(path: StrPath, mode: int | None = None) -> Iterator[Path]:
    """A temporary file beside ``path`` for the block to fill by name (a copy, a download).

    If the block finishes, the file is flushed to disk, renamed over ``path``, and the rename
    flushed too; if it raises, the file is removed. The temporary name is a dotfile ending in
    ``.tmp-XXXXXXXX``, so tools that load every ``*.json``/``*.gz`` in a directory (HTA,
    TensorBoard) skip a file still being written.
    """
    final = Path(path)
    fd, name = tempfile.mkstemp(prefix=temp_prefix(final.name), dir=final.parent)
    tmp = Path(name)
    try:
        try:
            # mkstemp creates 0600; the result should look like any other file we write.
            os.fchmod(fd, (0o666 & ~current_umask()) if mode is None else mode)
        finally:
            os.close(fd)
        yield tmp
        # Without this, a crash soon after the rename can leave an empty file under the final
        # name while the old contents (or the source of a move) are already gone.
        fsync_path(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_path(final.parent)


def fsync_path(path: StrPath) -> None:
    """Flush a file, or a directory's entries (creations, renames, deletions), to disk.

    fsync acts on the file, not the descriptor, so a fresh read-only one reaches data written
    through any other, including by a writer that replaced the file by renaming its own.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    # os.umask() can only be read by setting it, which races with threads creating files
    # elsewhere in the process; Linux exposes it read-only in /proc instead.
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def boot_id() -> str | None:
    """This kernel's boot id: two processes that report the same one run on one machine,
    so a path one of them names can be tried by the other (profctl pull --cluster)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None
