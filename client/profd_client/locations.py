"""Where the daemon's sockets live, resolved the same way by the daemon, profctl and clients.

Flag, else ``PROFD_RUNTIME_DIR``, else ``/run/profd`` under systemd, else
``$XDG_RUNTIME_DIR/profd``, else ``/tmp/profd-$UID``.

Clients and profctl also check who could have put a socket where they look
(:func:`locate_socket`): anyone can create ``/tmp/profd-$UID`` first, and a process that
connects to a socket there would follow whatever arms the listener sends.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NamedTuple

SYSTEMD_RUNTIME_DIR = Path("/run/profd")


def under_systemd() -> bool:
    return "INVOCATION_ID" in os.environ or "RUNTIME_DIRECTORY" in os.environ


def _tmp_default() -> Path:
    return Path(f"/tmp/profd-{os.getuid()}")


def default_runtime_dirs() -> list[Path]:
    """Candidates in order; the first is the default for a daemon started here."""
    dirs: list[Path] = []
    if under_systemd():
        rd = os.environ.get("RUNTIME_DIRECTORY")
        dirs.append(Path(rd.split(":")[0]) if rd else SYSTEMD_RUNTIME_DIR)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        dirs.append(Path(xdg) / "profd")
    dirs.append(_tmp_default())
    if SYSTEMD_RUNTIME_DIR not in dirs:
        # A user process on a node whose daemon runs under systemd finds it here.
        dirs.append(SYSTEMD_RUNTIME_DIR)
    return dirs


def search_dirs() -> list[Path]:
    """Where clients and profctl look for a daemon when no dir is named, in order.

    The daemon's own order, except that an existing ``/run/profd`` comes before
    ``/tmp/profd-$UID``: the node's daemon is there, and a dir in ``/tmp`` is the one another
    user can create first.
    """
    dirs = default_runtime_dirs()
    tmp = _tmp_default()
    if os.path.lexists(SYSTEMD_RUNTIME_DIR) and tmp in dirs:
        dirs.remove(SYSTEMD_RUNTIME_DIR)
        dirs.insert(dirs.index(tmp), SYSTEMD_RUNTIME_DIR)
    return dirs


def runtime_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The runtime dir a daemon started now would use."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("PROFD_RUNTIME_DIR")
    if env:
        return Path(env)
    return default_runtime_dirs()[0]


# Named tuples, not dataclasses: profctl loads this module on every command, and
# ``dataclasses`` with the code it makes per class is milliseconds of its start-up.
class Untrusted(NamedTuple):
    """A runtime dir or socket that someone other than root or this user controls."""

    path: Path
    why: str

    def __str__(self) -> str:
        return f"{self.path}: {self.why}"


class SocketChoice(NamedTuple):
    """The outcome of :func:`locate_socket`."""

    #: Where to connect; None when no place looked at can be trusted.
    path: Path | None
    #: Every socket path looked at, for error messages.
    looked: list[Path]
    #: The first untrusted dir or socket met, reported even when a trusted one was chosen.
    untrusted: Untrusted | None = None


def _owner_problem(st: os.stat_result) -> str | None:
    if st.st_uid in (0, os.geteuid()):
        return None
    return f"owned by uid {st.st_uid}, not root or you"


def dir_problem(st: os.stat_result) -> str | None:
    """Why a runtime dir with this ``lstat`` must not be used, or None when it may.

    Whoever can write to the dir can put a listener in place of the daemon's socket, so
    only root and this user may own it and nobody else may write to it. A group may write
    only to a dir root owns: that is the systemd set-up (``RuntimeDirectoryMode=0770`` with
    ``[daemon] group``), where the group is trusted to attach.
    """
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link, not a directory"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    owner = _owner_problem(st)
    if owner:
        return owner
    if mode & stat.S_IWOTH:
        return f"writable by others (mode {mode:04o})"
    if mode & stat.S_IWGRP and st.st_uid != 0:
        return f"group-writable (mode {mode:04o}) and not owned by root"
    return None


def socket_problem(st: os.stat_result) -> str | None:
    """Why a socket with this ``lstat`` must not be connected to, or None when it may."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link, not a socket"
    if not stat.S_ISSOCK(st.st_mode):
        return "not a socket"
    return _owner_problem(st)


def _lstat(p: Path) -> os.stat_result | None:
    try:
        return os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _inspect(d: Path, name: str) -> tuple[str, Untrusted | None]:
    """``("absent" | "dir" | "socket", problem)`` for the candidate dir ``d``."""
    try:
        dst = _lstat(d)
    except OSError:
        return "absent", None  # cannot even look: nothing could be connected to there
    if dst is None:
        return "absent", None
    why = dir_problem(dst)
    if why:
        return "dir", Untrusted(d, why)
    sock = d / name
    try:
        sst = _lstat(sock)
    except PermissionError:
        # A trusted dir closed to us: the connection reports "permission denied".
        return "socket", None
    except OSError:
        return "dir", None  # nothing there that could be connected to
    if sst is None:
        return "dir", None
    why = socket_problem(sst)
    return "socket", Untrusted(sock, why) if why else None


def _parent_safe(d: Path) -> bool:
    """Whether only root or this user can create ``d``: its nearest existing ancestor is trusted."""
    for parent in d.parents:
        try:
            st = os.stat(parent)  # a symlinked ancestor (/var/run) is the admin's choice
        except FileNotFoundError:
            continue
        except OSError:
            return False
        return dir_problem(st) is None
    return False


def locate_socket(
    name: str, explicit: str | os.PathLike[str] | None = None, *, wait: bool = False
) -> SocketChoice:
    """The socket to connect to, checked so that only root or this user can have put it there.

    With an explicit dir (argument or ``PROFD_RUNTIME_DIR``) only that dir is considered;
    otherwise :func:`search_dirs`, in order: a trusted dir holding the socket wins, then a
    trusted dir without one (its daemon is restarting), then a dir that does not exist yet
    but that nobody else can create. Untrusted places are skipped and the first is reported
    in ``untrusted``.

    ``wait`` is for a caller that connects at once and waits there for a daemon (a client):
    ZeroMQ redoes the connect by path, so a dir that does not exist yet is chosen only if
    nobody else can create it. A missing ``/tmp/profd-$UID`` is created 0700 for that, and
    a missing explicit dir under a parent others can write to is reported and not chosen.
    Never raises ``OSError``.
    """
    explicit_dir = explicit or os.environ.get("PROFD_RUNTIME_DIR")
    dirs = [runtime_dir(explicit)] if explicit_dir else search_dirs()
    looked = [d / name for d in dirs]
    seen = [(d, *_inspect(d, name)) for d in dirs]
    untrusted = next((u for _d, _s, u in seen if u is not None), None)
    for want in ("socket", "dir"):
        for d, state, problem in seen:
            if state == want and problem is None:
                return SocketChoice(d / name, looked, untrusted)
    for d, state, _u in seen:
        if state != "absent":
            continue
        if _parent_safe(d):
            return SocketChoice(d / name, looked, untrusted)
        if wait and not explicit_dir and d == _tmp_default():
            try:
                os.mkdir(d, 0o700)
            except OSError:
                pass  # created by someone else in between: judged below like any other
            state, problem = _inspect(d, name)
            if problem is not None:
                return SocketChoice(None, looked, untrusted or problem)
            if state != "absent":
                return SocketChoice(d / name, looked, untrusted)
    if wait and untrusted is None and explicit_dir:
        untrusted = Untrusted(
            dirs[0], "does not exist, and users other than root and you can create it there"
        )
    return SocketChoice(None, looked, untrusted)


def find_socket(
    name: str, explicit: str | os.PathLike[str] | None = None
) -> tuple[Path, list[Path]]:
    """The socket to connect to, and every place looked at (for error messages).

    :func:`locate_socket`'s choice, or the first place looked at when none can be trusted,
    so a job started as a user still finds a systemd daemon's ``/run/profd``. Callers that
    connect must use :func:`locate_socket`, which says when a place cannot be trusted.
    """
    c = locate_socket(name, explicit)
    return (c.path if c.path is not None else c.looked[0]), c.looked


_warned: set[str] = set()


def warn_untrusted(problem: Untrusted, connecting: Path | None) -> None:
    """Log ``problem`` once per process: a client retries its connect but must not nag."""
    key = str(problem)
    if key in _warned:
        return
    _warned.add(key)
    # Imported here: profctl finds its socket through this module and never logs.
    import logging

    log = logging.getLogger("profd_client")
    if connecting is None:
        log.warning(
            "profd_client: not connecting to profd: %s; training goes on without profiling"
            " (set PROFD_RUNTIME_DIR to the daemon's runtime dir)",
            problem,
        )
    else:
        log.warning("profd_client: ignoring %s; using %s", problem, connecting.parent)
