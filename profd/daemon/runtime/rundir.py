"""The runtime dir and its sockets: permissions, stale sockets, and one daemon per dir."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path
from typing import Any

from profd import control_schema as C
from profd_client import protocol as P


class RuntimeDirError(RuntimeError):
    pass


def group_id(group: str | None) -> int | None:
    """The gid of a configured group name (None for none); a missing group is an error."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise RuntimeDirError(f"group {group!r} does not exist") from None


def prepare(path: Path, group: str | None) -> int | None:
    """Create the dir 0700 (01770 with a group); returns the gid sockets should get.

    The dir must be a real directory of this uid. Whoever else owns it, or a symlink's
    target, would otherwise get the chmod (a root daemon handed ``/tmp/profd-0 -> /etc``
    makes ``/etc`` 0700) and could swap the daemon's sockets for their own.
    """
    gid = group_id(group)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    # The checks and the chmod go through one descriptor opened without following a link,
    # so the dir cannot be swapped for a symlink between them.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise RuntimeDirError(
            f"runtime dir {path} {_not_a_dir(path, exc)}; refusing to use it"
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise RuntimeDirError(
                f"runtime dir {path} belongs to uid {st.st_uid}, not to this user"
                f" (uid {os.geteuid()}); refusing to use it"
            )
        # With a group, the sticky bit keeps its members from renaming or deleting the
        # daemon's sockets (and from swapping one for a symlink before secure_socket chmods it).
        os.fchmod(fd, 0o1770 if gid is not None else 0o700)
        if gid is not None:
            os.fchown(fd, -1, gid)
    finally:
        os.close(fd)
    return gid


def _not_a_dir(path: Path, exc: OSError) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return f"cannot be opened ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    return f"cannot be opened ({exc.strerror or exc})"


def daemon_alive(path: Path, timeout_ms: int = 500) -> bool:
    """Ask whatever listens on control.sock for its status."""
    import zmq

    sock_path = path / P.CONTROL_SOCKET
    if not sock_path.exists():
        return False
    ctx: Any = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(f"ipc://{sock_path}")
        s.send(C.encode(C.C_STATUS))
        return bool(s.poll(timeout_ms))
    finally:
        s.close(0)


def claim(path: Path) -> None:
    """Refuse a live daemon on this dir; remove the sockets a dead one left behind."""
    if daemon_alive(path):
        raise RuntimeDirError(f"a profd daemon is already running on {path}")
    for name in (P.AGENT_SOCKET, P.CONTROL_SOCKET):
        p = path / name
        if p.exists() or p.is_symlink():
            if not stat.S_ISSOCK(p.lstat().st_mode):
                raise RuntimeDirError(f"{p} exists and is not a socket; refusing to replace it")
            p.unlink()


def secure_socket(p: Path, gid: int | None) -> None:
    """No socket is world-writable: 0600, or 0660 for a configured group."""
    if gid is not None:
        os.chown(p, -1, gid)
        os.chmod(p, 0o660)
    else:
        os.chmod(p, 0o600)
