"""Real unprivileged users (``useradd``) and a root daemon in group mode that their
processes attach to: for tests of what profd does across uids. Needs root; the users and
the group are created once and left in place (other runs and files reuse them).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import BIN, Daemon

GROUP = "profd-test"


@dataclass(frozen=True)
class User:
    """An unprivileged user whose processes also belong to ``group`` (the daemon's)."""

    name: str
    uid: int
    gid: int
    group: int
    env: dict[str, str]

    def popen(self, args: list[str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(args, env=kw.pop("env", self.env), user=self.uid, group=self.gid,
                                extra_groups=[self.group], cwd="/tmp", text=True, **kw)  # fmt: skip

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self.env, user=self.uid, group=self.gid,
                              extra_groups=[self.group], cwd="/tmp", text=True,
                              capture_output=True, timeout=60)  # fmt: skip

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(str(BIN / "profctl"), *args)


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create users and run processes as them")


def group_id(name: str = GROUP) -> int:
    """The gid of group ``name``, created if missing."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        subprocess.run(["groupadd", name], check=True)
        return grp.getgrnam(name).gr_gid


def account(name: str) -> pwd.struct_passwd:
    """User ``name`` (no home, no login shell), created if missing."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
        return pwd.getpwnam(name)


@contextmanager
def group_daemon(
    names: tuple[str, ...], config: str = "", prefix: tuple[str, ...] = ()
) -> Iterator[tuple[Daemon, list[User]]]:
    """A root daemon with ``[daemon] group`` (``config`` appended), run through ``prefix``
    (e.g. ``setpriv`` dropping a capability), and the users ``names`` in its group with the
    environment that finds it."""
    need_root()
    gid = group_id()
    # Under /tmp, not pytest's 0700 dirs: the users must reach the runtime dir and spool.
    base = Path(tempfile.mkdtemp(prefix="profd-perm-", dir="/tmp"))
    base.chmod(0o755)
    d = Daemon(base / "profd", prefix=list(prefix))
    d.root.mkdir(mode=0o755)
    d.config = d.root / "profd.toml"
    d.config.write_text(f'[daemon]\ngroup = "{GROUP}"\n{config}')
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
           "PROFD_RUNTIME_DIR": str(d.runtime_dir)}  # fmt: skip
    if "PYTHONPATH" in os.environ:  # a checkout run in place: the users run the same code
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    users = [User(n, (pw := account(n)).pw_uid, pw.pw_gid, gid, env) for n in names]
    d.start()
    try:
        yield d, users
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)
