"""Values read out of a trace cannot poison the index.

A trace is the client's file: whatever it names (a ``ProfilerStep#`` with 30 digits, a
duration beyond any clock) must be held to the protocol's bounds before the daemon stores
anything derived from it, since everything stored is sent back to profctl in msgpack, which
has no integers beyond 64 bits. And a value that got into the index anyway (an older daemon
stored it) costs its own row, named, never the listing of every user's traces.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from harness import Daemon
from rawpeer import TracePeer, small_trace
from test_pipeline_faults import wait_end

HUGE = "1" * 30  # a step number of 30 digits: beyond int64 and msgpack


def poisoned_trace(path: Path) -> Path:
    """A trace with one good step, one step of 30 digits, and operators in both."""
    path.parent.mkdir(parents=True, exist_ok=True)
    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 50},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#" + HUGE, "ts": 100, "dur": 90},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 110, "dur": 40},
        # A time beyond any clock (1e300 µs): no interval at all.
        {"ph": "X", "cat": "cpu_op", "name": "aten::far", "ts": 1e300, "dur": 1e300},
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def index_dump(d: Daemon) -> str:
    db = sqlite3.connect(f"file:{d.state_dir / 'index.db'}?mode=ro", uri=True)
    try:
        return "\n".join(db.iterdump())
    finally:
        db.close()


@pytest.fixture
def peer(daemon: Daemon, ctx: zmq.Context) -> Iterator[TracePeer]:
    p = TracePeer(ctx, daemon, "poison")
    yield p
    p.sock.close(0)


def test_a_step_beyond_the_protocol_is_no_step_and_is_stored_nowhere(
    daemon: Daemon, peer: TracePeer
) -> None:
    sid, _ = peer.capture(poisoned_trace)
    s = wait_end(daemon, sid)
    assert s["state"] == "done", s
    # The code before: every one of these answered "internal: OverflowError".
    rows = daemon.ctl_json("traces")
    assert [r["session"] for r in rows] == [sid]
    assert "skipped" not in rows[0], rows[0]
    stats = rows[0]["stats"]
    assert stats["steps"]["step"] == [1] and stats["steps_total"] == 1, stats
    assert daemon.ctl("traces").returncode == 0
    assert daemon.ctl_json("show", sid)["state"] == "done"
    report = daemon.ctl("report", sid, "-o", str(daemon.root / "r.html"))
    assert report.returncode == 0, report.stderr
    # Not counted, but not silent either: the capture's result says what was left out.
    [t] = s["targets"]
    [res] = t["results"]
    assert any("ProfilerStep#" in n and "ignored" in n for n in res["notes"]), res
    assert HUGE not in index_dump(daemon)
    # Across a restart too (the reported index stayed broken for good).
    daemon.stop()
    daemon.start()
    assert daemon.ctl("traces").returncode == 0
    assert daemon.ctl("report", sid, "-o", str(daemon.root / "r2.html")).returncode == 0


def test_a_poisoned_row_left_by_an_older_daemon_is_skipped_and_named(
    daemon: Daemon, peer: TracePeer
) -> None:
    good, _ = peer.capture(small_trace)
    bad, _ = peer.capture(small_trace)
    for sid in (good, bad):
        assert wait_end(daemon, sid)["state"] == "done"
    daemon.stop()
    # What the daemon before this fix stored for a 30-digit step: JSON has no limit.
    db = sqlite3.connect(daemon.state_dir / "index.db")
    stats = json.dumps({"v": 1, "steps": {"step": [int(HUGE)]}, "steps_total": 1})
    results = json.dumps([{"cycle": 0, "steps": [1], "step": int(HUGE)}])
    with db:
        db.execute(
            "UPDATE traces SET stats = ?, steps = ? WHERE session = ?",
            (stats, json.dumps([int(HUGE)]), bad),
        )
        db.execute("UPDATE targets SET results = ? WHERE session = ?", (results, bad))
    db.close()
    daemon.start()

    r = daemon.ctl("traces", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["session"]: row for row in json.loads(r.stdout)}
    assert set(rows) == {good, bad}
    assert "skipped" not in rows[good] and rows[good]["stats"] is not None
    # The bad row is named, with what was left out of it; the rest of it is served.
    note = rows[bad]["skipped"]
    assert "steps" in note and "stats" in note, note
    assert rows[bad]["stats"] is None and rows[bad]["steps"] == []
    assert rows[bad]["path"] and rows[bad]["rank"] == 0
    assert daemon.ctl("traces").returncode == 0  # the table, too
    assert daemon.ctl("sessions").returncode == 0

    show = daemon.ctl_json("show", bad)
    [t] = show["targets"]
    assert "results" in t["skipped"] and t["results"] == [], t
    assert daemon.ctl_json("show", good)["targets"][0]["results"]
    # Its statistics were not sent: the report says so in one line, not with a traceback.
    r = daemon.ctl("report", bad, "-o", str(daemon.root / "r.html"))
    assert r.returncode == 1 and "no per-rank statistics" in r.stderr, r.stderr
