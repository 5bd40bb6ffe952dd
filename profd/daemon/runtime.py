"""The runtime dir and its sockets: permissions, stale sockets, and one daemon per dir."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path
from typing import Any

from profd_client import protocol as P


class RuntimeDirError(RuntimeError):
    pass


def prepare(path: Path, group: str | None) -> int | None:
    """Create the dir 0700 (0770 with a group); returns the gid sockets should get."""
    gid = None
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise RuntimeDirError(f"group {group!r} does not exist") from None
    path.mkdir(parents=True, exist_ok=True)
    mode = 0o770 if gid is not None else 0o700
    st = path.stat()
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"{path} belongs to uid {st.st_uid}, not to this user")
    os.chmod(path, mode)
    if gid is not None:
        os.chown(path, -1, gid)
    return gid


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
        s.send(P.encode(P.C_STATUS))
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
