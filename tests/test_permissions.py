"""Two users' jobs on one root daemon in group mode.

The wave-1 daemon let the first job's user create ``.incoming`` as itself (every other user's
captures then failed with PermissionError), wrote every file group-writable (any member could
overwrite or delete another user's traces), and let any member start or cancel sessions on
anyone's job. Here a real daemon runs as root with ``[daemon] group``; two real unprivileged
users (``useradd``) in that group run real training processes and their own ``profctl``.
"""

from __future__ import annotations

import json
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonproc import wait_for
from harness import BIN, Daemon
from users import User, group_daemon

from profd.states import TERMINAL

USERS = ("profd-attacker", "profd-victim")
PYTHON = str(BIN / "python")

JOB = r"""
import sys, time, profd_client
profd_client.attach(job=sys.argv[1], step="manual", heartbeat=0.2)
for _ in range(100000):  # killed by the test: never ends before its capture
    profd_client.step()
    time.sleep(0.05)
"""


@pytest.fixture
def setup() -> Iterator[tuple[Daemon, User, User]]:
    with group_daemon(USERS) as (d, (attacker, victim)):
        yield d, attacker, victim


def _ok(r: subprocess.CompletedProcess[str]) -> Any:
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)


def test_each_users_traces_are_theirs(setup: tuple[Daemon, User, User]) -> None:
    d, attacker, victim = setup
    jobs = [u.popen([PYTHON, "-c", JOB, f"{u.name}-job"]) for u in (victim, attacker)]
    try:
        wait_for(lambda: len(d.polled_ps()) == 2, 60, "both users' jobs attached")
        by_job = {r["job"]: r for r in d.ps()}
        assert by_job["profd-victim-job"]["uid"] == victim.uid

        # Another user can neither start on nor cancel the victim's job.
        r = attacker.ctl("start", "--job", "profd-victim-job", "--next")
        assert r.returncode != 0 and "may act only on its own processes" in r.stderr, r
        sid = _ok(victim.ctl("start", "--job", "profd-victim-job", "--next", "--json"))["session"]
        r = attacker.ctl("cancel", sid)
        assert r.returncode != 0 and "may act only on its own" in r.stderr, r

        # Both users capture (the code before: the second user's capture failed with a
        # PermissionError in the first user's .incoming).
        sid2 = _ok(attacker.ctl("start", "--job", "profd-attacker-job", "--next", "--json"))
        for s in (sid, sid2["session"]):
            end = wait_for(
                lambda s=s: (lambda x: x if x["state"] in TERMINAL else None)(
                    d.ctl_json("show", s)
                ),
                90,
                f"session {s}",
            )
            assert end["state"] == "done", end
    finally:
        for j in jobs:
            j.kill()
            j.wait()

    [row] = d.ctl_json("traces", "--session", sid)
    trace = Path(row["path"])
    st = trace.stat()
    # The victim's, readable by the group, writable by nobody else.
    assert (st.st_uid, st.st_gid) == (victim.uid, victim.group), st
    assert stat.S_IMODE(st.st_mode) == 0o640, oct(st.st_mode)
    for p in [trace.parent, trace.parent.parent, d.spool]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert p.stat().st_uid == 0 and not mode & 0o022, (p, oct(mode))
    manifest = trace.parent.parent / "session.json"
    assert manifest.stat().st_uid == victim.uid and not manifest.stat().st_mode & 0o022
    r = attacker.run("/bin/rm", "-f", str(trace))
    assert r.returncode != 0 and trace.is_file(), r
    r = attacker.run("/bin/sh", "-c", f"echo forged > {trace}")
    assert r.returncode != 0, r
    incoming = d.spool / ".incoming"
    if incoming.exists():
        ist = incoming.stat()
        assert ist.st_uid == 0 and stat.S_IMODE(ist.st_mode) == 0o711, oct(ist.st_mode)
    # Every job's metadata is in the index: the daemon's alone.
    assert stat.S_IMODE((d.state_dir / "index.db").stat().st_mode) == 0o600
