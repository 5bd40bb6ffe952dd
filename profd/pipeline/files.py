"""Putting a capture's files into its cycle directory, complete or not at all."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import IO

from profd.fsutil import current_umask, temp_prefix


@dataclass(frozen=True)
class ProcessedFile:
    kind: str  # "trace" | "summary" | "memory_report" | "nsys" | the caller's kind for extras
    path: str
    bytes: int


@dataclass(frozen=True)
class FilePerms:
    """Mode and owner of the files a capture produces (-1: leave the owner as it is)."""

    mode: int
    uid: int = -1
    gid: int = -1


@contextlib.contextmanager
def _temp_in(
    final_dir: str, stem: str, perms: FilePerms | None = None
) -> Iterator[tuple[str, IO[bytes]]]:
    """A temp file next to its destination, removed again unless the caller renamed it away.

    The name is a dotfile ending in ``.tmp-XXXX`` so that neither HTA (which loads every
    ``*.json``/``*.gz`` in a directory) nor torch-tb-profiler (which matches
    ``*.pt.trace.json[.gz]``) picks up a half-written file.
    """
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(stem), dir=final_dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            if perms is None:
                # mkstemp creates 0600; without a say from the daemon the final files are as
                # readable as any other file this process writes.
                os.fchmod(fh.fileno(), 0o666 & ~current_umask())
            else:
                # Owner first: the mode is set on a file nobody else can open yet.
                if perms.uid >= 0 or perms.gid >= 0:
                    os.fchown(fh.fileno(), perms.uid, perms.gid)
                os.fchmod(fh.fileno(), perms.mode)
            yield tmp, fh
            fh.flush()
            # Without fsync a crash shortly after the rename can leave an empty file under
            # the final name, and the raw input will already have been deleted.
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class Batch:
    """Files ``{stem}{suffix}`` that take their final names together, once all are on disk.

    That keeps the window where only some of a capture's files exist as small as possible,
    and an exception inside the ``with`` leaves no temp file and no final name behind.
    """

    def __init__(self, final_dir: str, stem: str, perms: FilePerms | None = None) -> None:
        self.final_dir = final_dir
        self.stem = stem
        self.perms = perms
        self._staged: list[tuple[str, str, str]] = []  # (kind, temp path, final path)
        self.files: list[ProcessedFile] = []  # filled in once the batch is published

    def __enter__(self) -> Batch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            for _, tmp, final in self._staged:
                os.replace(tmp, final)
        except BaseException:
            self._discard()
            raise
        self.files = [
            ProcessedFile(kind, final, os.path.getsize(final)) for kind, _, final in self._staged
        ]

    @contextlib.contextmanager
    def open(self, kind: str, suffix: str) -> Iterator[IO[bytes]]:
        with _temp_in(self.final_dir, self.stem, self.perms) as (tmp, fh):
            yield fh
        self._staged.append((kind, tmp, os.path.join(self.final_dir, self.stem + suffix)))

    def write(self, kind: str, suffix: str, data: bytes) -> None:
        with self.open(kind, suffix) as fh:
            fh.write(data)

    def _discard(self) -> None:
        for _, tmp, _ in self._staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def move_into(src: str, final_dir: str) -> str:
    dest = os.path.join(final_dir, os.path.basename(src))
    if os.path.abspath(src) == os.path.abspath(dest):
        return dest
    if not os.path.exists(src) and os.path.exists(dest):
        return dest  # moved by an earlier attempt that failed later on; keep retries working
    try:
        os.replace(src, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        tmp: str | None = None
        try:
            with _temp_in(final_dir, os.path.basename(src)) as (tmp, fh), open(src, "rb") as inp:
                shutil.copyfileobj(inp, fh, 1 << 20)
            os.replace(tmp, dest)
        except BaseException:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            raise
        os.unlink(src)
    return dest
