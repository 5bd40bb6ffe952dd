"""Files that training processes write into the spool, handled without trusting their paths.

The daemon may run as root, and a client owns the directory it writes its raw traces into:
between the daemon's check and its use, the client can swap any name it owns for a symlink
(to make the daemon read, move or delete a root-only file), a FIFO (to block a pipeline
worker), a directory, or a huge sparse file. So nothing here resolves a path once and uses it
later by name: every directory is opened one component at a time relative to the previous
descriptor with ``O_NOFOLLOW``, files are opened the same way and checked with ``fstat`` on
the opened descriptor (regular files only, bounded size), and moves and unlinks go through
the directory descriptors. The spool root itself comes from the daemon's configuration and
is trusted; every directory below it is created here, with explicit modes (``UMask=0007``
would otherwise leave them group-writable) and owners.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from profd.fsutil import temp_prefix

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFile(Exception):
    """A client file the daemon will not use: retrying cannot make it acceptable."""


@dataclass(frozen=True)
class DirSpec:
    """One directory level: its name, mode and owner (-1: the daemon's)."""

    name: str
    mode: int
    uid: int = -1
    gid: int = -1


def _component(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise UnsafeFile(f"bad path component {name[:80]!r}")
    return name


def _open_dir(parent: int | None, name: str, root: Path) -> int:
    try:
        if parent is None:
            return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return os.open(_component(name), _DIR, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeFile(f"{name!r} is not a directory (a symbolic link?)") from None
        raise


@contextlib.contextmanager
def opened_dir(root: Path, parts: Sequence[str]) -> Iterator[int]:
    """A descriptor of ``root/parts...``, no component of ``parts`` followed if a link."""
    fd = _open_dir(None, "", root)
    try:
        for name in parts:
            nxt = _open_dir(fd, name, root)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def made_dir(root: Path, levels: Sequence[DirSpec]) -> Iterator[int]:
    """Like :func:`opened_dir`, creating missing levels; each level gets its mode and owner.

    A level that exists with another owner than asked is refused rather than chowned: it was
    made by someone else (an older profd, or a client), and its contents are not ours to adopt.
    """
    fd = _open_dir(None, "", root)
    try:
        for lv in levels:
            nxt = _made_level(fd, lv, root)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def make_children(root: Path, levels: Sequence[DirSpec], children: Iterable[DirSpec]) -> list[str]:
    """:func:`made_dir` for ``levels``, then each of ``children`` in it: the shared levels
    are walked once for all of them (a start arms a thousand processes). The names made; a
    child that cannot be made is left out (its caller tries it alone, and says why)."""
    made = []
    with made_dir(root, levels) as parent:
        for child in children:
            try:
                os.close(_made_level(parent, child, root))
            except (OSError, UnsafeFile):
                continue
            made.append(child.name)
    return made


def _made_level(fd: int, lv: DirSpec, root: Path) -> int:
    """The descriptor of ``lv`` in ``fd``, made if missing, with its mode and owner."""
    name = _component(lv.name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=fd)
    nxt = _open_dir(fd, name, root)
    try:
        st = os.fstat(nxt)
        want_uid = os.geteuid() if lv.uid < 0 else lv.uid
        if st.st_uid != want_uid:
            if st.st_uid != os.geteuid():
                # Made by someone else: its contents are not ours to hand over.
                raise UnsafeFile(f"{lv.name!r} belongs to uid {st.st_uid}, not {want_uid}")
            os.fchown(nxt, want_uid, -1)
        if lv.gid >= 0 and st.st_gid != lv.gid:
            with contextlib.suppress(PermissionError):  # not a member: keep our group
                os.fchown(nxt, -1, lv.gid)
        if stat.S_IMODE(st.st_mode) != lv.mode:
            os.fchmod(nxt, lv.mode)
    except BaseException:
        os.close(nxt)
        raise
    return nxt


def open_regular(
    dir_fd: int, name: str, max_bytes: int, owner: int = -1
) -> tuple[int, os.stat_result]:
    """Open a regular file ``name`` in ``dir_fd`` for reading; its descriptor and stat.

    ``owner``: the uid that must own it (-1: any). A file of another uid, or one with a
    second hard link, is not something its client wrote (a link to someone else's file).
    """
    try:
        fd = os.open(_component(name), _FILE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(f"{name} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{name} is not a regular file")
        if owner >= 0 and st.st_uid != owner:
            raise UnsafeFile(f"{name} belongs to uid {st.st_uid}, not the process's {owner}")
        if st.st_nlink != 1:
            raise UnsafeFile(f"{name} has {st.st_nlink} hard links")
        if st.st_size > max_bytes:
            raise UnsafeFile(
                f"{name} is {st.st_size} bytes, over the {max_bytes}-byte limit"
                " ([daemon] max_trace_bytes)"
            )
        os.set_blocking(fd, True)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def move(
    src_dir: int,
    name: str,
    opened: tuple[int, os.stat_result],
    dst_dir: int,
    mode: int,
    dst_name: str | None = None,
) -> int:
    """Move the file ``opened`` (descriptor, stat) from ``src_dir/name`` into ``dst_dir``,
    as ``dst_name`` (default: ``name``).

    The rename moves whatever ``name`` is *now*; a client that swapped it after the open
    would have moved a link or another file into the daemon's directory. So the result is
    checked against the opened file and removed again if it is not that file. Returns the
    moved file's size. ``mode`` applies to the moved file (its owner stays the client).
    """
    fd, st = opened
    to = _component(dst_name or name)
    try:
        os.rename(_component(name), to, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        _copy_in(fd, to, dst_dir, mode)
        os.unlink(name, dir_fd=src_dir)
        return st.st_size
    now = os.stat(to, dir_fd=dst_dir, follow_symlinks=False)
    if not same_file(now, st):
        os.unlink(to, dir_fd=dst_dir)
        raise UnsafeFile(f"{name} was replaced while the daemon read it")
    os.fchmod(fd, mode)
    return st.st_size


def _copy_in(fd: int, name: str, dst_dir: int, mode: int) -> None:
    tmp = f"{temp_prefix(name)}{os.getpid()}"
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode, dir_fd=dst_dir)
    try:
        with os.fdopen(out, "wb") as fo, os.fdopen(os.dup(fd), "rb") as fi:
            fi.seek(0)
            shutil.copyfileobj(fi, fo, 1 << 20)
            fo.flush()
            os.fsync(fo.fileno())
        os.rename(tmp, name, src_dir_fd=dst_dir, dst_dir_fd=dst_dir)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dst_dir)
        raise


def unlink(dir_fd: int, name: str) -> None:
    """Remove ``name`` from a directory the daemon opened (a link itself, never its target)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_component(name), dir_fd=dir_fd)


def remove_empty_tree(parent_fd: int, name: str) -> None:
    """Remove ``name`` and the empty directories below it; anything holding a file stays.

    ``fwalk`` never follows a link and every rmdir is relative to the directory it listed,
    so a client that swaps a directory for a link makes the daemon remove nothing elsewhere.
    """
    # The descriptor fwalk yields is open only until the next step: rmdir right away.
    for _, dirs, _files, fd in os.fwalk(_component(name), dir_fd=parent_fd, topdown=False):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(d, dir_fd=fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=parent_fd)
