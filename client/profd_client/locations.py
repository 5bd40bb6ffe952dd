"""Where the daemon's sockets live, resolved the same way by the daemon, profctl and clients.

Flag, else ``PROFD_RUNTIME_DIR``, else ``/run/profd`` under systemd, else
``$XDG_RUNTIME_DIR/profd``, else ``/tmp/profd-$UID``.
"""

from __future__ import annotations

import os
from pathlib import Path

SYSTEMD_RUNTIME_DIR = Path("/run/profd")


def under_systemd() -> bool:
    return "INVOCATION_ID" in os.environ or "RUNTIME_DIRECTORY" in os.environ


def default_runtime_dirs() -> list[Path]:
    """Candidates in order; the first is the default for a daemon started here."""
    dirs: list[Path] = []
    if under_systemd():
        rd = os.environ.get("RUNTIME_DIRECTORY")
        dirs.append(Path(rd.split(":")[0]) if rd else SYSTEMD_RUNTIME_DIR)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        dirs.append(Path(xdg) / "profd")
    dirs.append(Path(f"/tmp/profd-{os.getuid()}"))
    if SYSTEMD_RUNTIME_DIR not in dirs:
        # A user process on a node whose daemon runs under systemd finds it here.
        dirs.append(SYSTEMD_RUNTIME_DIR)
    return dirs


def runtime_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The runtime dir a daemon started now would use."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("PROFD_RUNTIME_DIR")
    if env:
        return Path(env)
    return default_runtime_dirs()[0]


def find_socket(
    name: str, explicit: str | os.PathLike[str] | None = None
) -> tuple[Path, list[Path]]:
    """The socket to connect to, and every place looked at (for error messages).

    With no explicit dir, the first candidate whose socket exists wins, so a training job
    started as a user still finds a systemd daemon's ``/run/profd``.
    """
    if explicit or os.environ.get("PROFD_RUNTIME_DIR"):
        path = runtime_dir(explicit) / name
        return path, [path]
    looked = [d / name for d in default_runtime_dirs()]
    for p in looked:
        if p.exists():
            return p, looked
    return looked[0], looked
