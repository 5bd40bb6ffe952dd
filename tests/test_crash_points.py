"""A daemon SIGKILLed at every point of a capture's way through it loses nothing.

``PROFD_FAULT_KILL=<point>`` (``profd/daemon/runtime/faults.py``) makes the daemon kill itself at
that point; the test restarts it without the switch, and the same session must then end
``done`` with every rank's trace indexed once, its raw trace gone, no inbox row left open and
a ``session.json`` that lists every result. One 2-rank torchrun job lives through all the
crashes: its clients reconnect to each new daemon and resend what was not acked.
"""

from __future__ import annotations

import json
import signal
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemonproc import wait_for
from harness import Daemon, Job

from profd.daemon.runtime.faults import POINTS
from profd.states import TERMINAL

WAIT = 120.0


def open_inbox_rows(d: Daemon) -> int:
    db = sqlite3.connect(f"file:{d.state_dir / 'index.db'}?mode=ro", uri=True)
    try:
        n: int = db.execute("SELECT count(*) FROM inbox WHERE done = 0").fetchone()[0]
        return n
    finally:
        db.close()


def ended(d: Daemon, sid: str) -> dict[str, Any] | None:
    r = d.ctl("show", sid, "--json")
    if r.returncode != 0:
        return None
    s: dict[str, Any] = json.loads(r.stdout)
    return s if s["state"] in TERMINAL else None


@pytest.mark.slow
def test_a_daemon_killed_at_each_point_of_a_capture_loses_nothing(
    daemon_factory: Callable[..., Daemon], torchrun: Callable[..., Job]
) -> None:
    d = daemon_factory()
    torchrun("train.py", nproc=2, daemon=d, STEPS="1000000", STEP_SLEEP="0.05")
    d.wait_attached(2, timeout=WAIT, min_step=1)
    wait_for(
        lambda: all(r["steps_per_s"] > 0 for r in d.polled_ps()), WAIT, "step rates", every=0.2
    )
    for point in POINTS:
        d.stop()
        d.extra_env["PROFD_FAULT_KILL"] = point
        d.start()
        d.wait_attached(2, timeout=WAIT)
        sid = d.ctl_json("start", "--next")["session"]
        assert d.proc is not None
        # Reaching the point is the daemon's SIGKILL; a daemon that never gets there hangs
        # here, and the assertion names the point.
        try:
            code = d.proc.wait(WAIT)
        except Exception as exc:
            raise AssertionError(f"the daemon never reached {point!r}") from exc
        assert code == -signal.SIGKILL, (point, code)
        del d.extra_env["PROFD_FAULT_KILL"]
        d.start()

        s = wait_for(lambda sid=sid: ended(d, sid), WAIT, f"session {sid} ({point}) to end")
        assert s["state"] == "done", (point, s)
        rows = d.ctl_json("traces", "--session", sid)
        assert sorted(r["rank"] for r in rows) == [0, 1], (point, rows)
        assert all(Path(r["path"]).is_file() for r in rows), (point, rows)
        # Raw traces are deleted once indexed, and the session's incoming dirs with them.
        assert not (d.spool / ".incoming" / s["job"] / sid).exists(), point
        manifest = wait_for(
            lambda s=s, sid=sid: (lambda p: p.is_file() and json.loads(p.read_text()))(
                d.spool / s["job"] / sid / "session.json"
            ),
            WAIT,
            f"session.json of {point}",
        )
        assert manifest["state"] == "done", (point, manifest)
        results = [r for t in manifest["targets"] for r in t["results"]]
        assert sorted(Path(r["path"]).name for r in results) == sorted(
            Path(r["path"]).name for r in rows
        ), (point, manifest)
        assert open_inbox_rows(d) == 0, point
    # Each restart re-indexed nothing twice: one trace per rank per session.
    assert len(d.ctl_json("traces", "--limit", "1000")) == 2 * len(POINTS)
