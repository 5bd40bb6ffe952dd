"""Moving a ``--next`` session when a rank got its steps too late, spoken as a raw client.

The real-job version (a GIL-bound training thread) is in test_captures; here a hand-made
peer sends exactly the reports that race with a re-plan, which a real job produces only by
chance: a late report, then a capture and a failure about the steps that were moved away.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import zmq
from harness import Daemon
from rawpeer import HELLO, dealer, pack, recv

from profd.scheduling.planner import MAX_REPLANS
from profd.store.index import SCHEMA_VERSION


def target(d: Daemon, sid: str) -> dict[str, Any]:
    [t] = d.ctl_json("show", sid)["targets"]
    return dict(t)


def test_late_report_moves_the_steps_and_stale_reports_are_dropped(
    daemon: Daemon, ctx: zmq.Context
) -> None:
    a = dealer(ctx, daemon, "agent.sock")
    a.send(pack({**HELLO, "step": 100}))
    recv(a, "welcome")
    res = daemon.ctl_json("start", "--next")
    arm = recv(a, "arm")
    assert "plan" not in arm and arm["cycles"][0][1] == res["steps"][0] > 100
    old_dir = Path(arm["incoming"]) / "c0"

    a.send(pack({"v": 1, "t": "progress", "id": 1, "session": res["session"], "state": "late",
                 "step": 500, "plan": 0}))  # fmt: skip
    moved = recv(a, "arm")
    assert moved["plan"] == 1 and moved["cycles"][0][1] > 500, moved
    # A protocol-1 arm names the process's own dir, below the new revision's.
    assert Path(moved["incoming"]).parent.name == "plan1"
    assert daemon.ctl_json("show", res["session"])["steps"] == [moved["cycles"][0][1]]
    assert target(daemon, res["session"])["state"] == "pending"

    # What the old plan produced before the move reached the process: acked and dropped.
    old_dir.mkdir(parents=True)
    stale = old_dir / "r-r0.pt.trace.json"
    stale.write_text("{}")
    a.send(pack({"v": 1, "t": "captured", "id": 2, "session": res["session"], "job": "j",
                 "cycle": 0, "steps": res["steps"], "files": [{"kind": "trace",
                 "path": str(stale)}], "started_at": 1.0, "ended_at": 2.0, "stall_ms": 1.0,
                 "plan": 0}))  # fmt: skip
    assert recv(a, "ack")["id"] == 2
    a.send(pack({"v": 1, "t": "progress", "id": 3, "session": res["session"], "state": "failed",
                 "step": 501, "error": "old plan", "plan": 0}))  # fmt: skip
    recv(a, "ack")
    a.send(pack({"v": 1, "t": "armed", "session": res["session"], "cycles": moved["cycles"],
                 "plan": 1}))  # fmt: skip
    deadline = time.monotonic() + 10
    while target(daemon, res["session"])["state"] != "armed" and time.monotonic() < deadline:
        time.sleep(0.05)
    t = target(daemon, res["session"])
    assert t["state"] == "armed" and t["error"] is None, t
    assert not stale.exists()
    assert daemon.ctl_json("traces", "--session", res["session"]) == []

    # Late every time: after MAX_REPLANS moves the rank fails with the step it was at.
    plan, step = 1, 1000
    while plan < MAX_REPLANS:
        a.send(pack({"v": 1, "t": "progress", "id": 10 + plan, "session": res["session"],
                     "state": "late", "step": step, "plan": plan}))  # fmt: skip
        plan, step = recv(a, "arm")["plan"], step * 2
    a.send(pack({"v": 1, "t": "progress", "id": 99, "session": res["session"], "state": "late",
                 "step": step, "plan": plan}))  # fmt: skip
    deadline = time.monotonic() + 10
    while daemon.ctl_json("show", res["session"])["state"] != "failed":
        assert time.monotonic() < deadline, daemon.ctl_json("show", res["session"])
        time.sleep(0.05)
    assert target(daemon, res["session"])["error"] == f"steps already passed: at step {step}"
    a.close()


def test_late_report_fails_explicit_steps(daemon: Daemon, ctx: zmq.Context) -> None:
    """Steps the operator named are never moved."""
    a = dealer(ctx, daemon, "agent.sock")
    a.send(pack({**HELLO, "step": 10}))
    recv(a, "welcome")
    res = daemon.ctl_json("start", "--steps", "50:52")
    recv(a, "arm")
    a.send(pack({"v": 1, "t": "progress", "id": 1, "session": res["session"], "state": "late",
                 "step": 60, "plan": 0}))  # fmt: skip
    deadline = time.monotonic() + 10
    while daemon.ctl_json("show", res["session"])["state"] != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert target(daemon, res["session"])["error"] == "steps already passed: at step 60"
    a.close()


def test_an_index_from_schema_1_gains_the_plan_column(daemon_factory: Any) -> None:
    d = daemon_factory(start=False)
    d.state_dir.mkdir(parents=True)
    db = sqlite3.connect(d.state_dir / "index.db")
    db.executescript(SCHEMA_1_SESSIONS)
    db.execute(
        "INSERT INTO sessions VALUES ('20260101-000000-abcdef', 'j', 'done', 'torch', NULL,"
        " NULL, '{\"next\": true}', '[[5, 5, 6]]', NULL, 1.0, 2.0)"
    )
    db.commit()
    db.close()
    d.start()
    s = d.ctl_json("show", "20260101-000000-abcdef")
    assert s["plan"] == 0 and s["steps"] == [5] and s["state"] == "done"
    with contextlib.closing(sqlite3.connect(d.state_dir / "index.db")) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )


def test_an_index_of_a_newer_profd_stops_the_start_in_one_line(daemon_factory: Any) -> None:
    d = daemon_factory(start=False)
    d.state_dir.mkdir(parents=True)
    path = d.state_dir / "index.db"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(SCHEMA_1_SESSIONS)
        db.execute("UPDATE meta SET value = ?", (str(SCHEMA_VERSION + 1),))
        db.commit()
    d.launch()
    assert d.proc.wait(60) == 1
    assert d.log.read_text().splitlines()[-1] == (
        f"profd: {path} has index schema {SCHEMA_VERSION + 1}, newer than this profd's"
        f" {SCHEMA_VERSION}: run the profd that wrote it, or move the file away to start a"
        " new index"
    )
    with contextlib.closing(sqlite3.connect(path)) as db:  # left as it was
        assert db.execute("SELECT value FROM meta").fetchall() == [(str(SCHEMA_VERSION + 1),)]


# The sessions table as profd 0.1 (index schema 1) wrote it.
SCHEMA_1_SESSIONS = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
INSERT INTO meta VALUES ('schema_version', '1');
CREATE TABLE sessions (
    id TEXT PRIMARY KEY, job TEXT NOT NULL, state TEXT NOT NULL, backend TEXT NOT NULL,
    label TEXT, region TEXT, request TEXT NOT NULL, cycles TEXT NOT NULL, error TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL
);
"""
