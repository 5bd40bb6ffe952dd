"""Two index rows never name one file: a capture whose outputs are already another's is an
error on that capture, not a second row (nor a silent replacement of the first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from profd.daemon.captures.record import CaptureReport, Outcome
from profd.daemon.results import Results
from profd.daemon.sessions.state import Session, Sessions, Target
from profd.daemon.spool.incoming import Incoming
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.pipeline.files import ProcessedFile
from profd.pipeline.process import ProcessedTrace
from profd.store.index import (
    Database,
    FileRepo,
    InboxRepo,
    PathTaken,
    SessionRepo,
    TraceRepo,
    UploadQueueRepo,
)


def trace_row(pid: int, path: str, cycle: int = 0, session: str = "s1") -> dict[str, Any]:
    return {
        "session": session, "job": "job", "host": "h", "pid": pid, "role": "main", "rank": 0,
        "cycle": cycle, "region": None, "steps": [1], "path": path, "bytes": 1, "state": "ok",
        "stall_ms": 1.0, "step_ms_p50": None, "step_ms_max": None, "torch": None,
        "device": None, "created_at": 1.0, "stats": None,
    }  # fmt: skip


def file_row(path: str, kind: str = "trace") -> dict[str, Any]:
    return {
        "session": "s1", "job": "job", "kind": kind, "path": path, "rel": path, "bytes": 1,
        "upload_state": "local",
    }  # fmt: skip


def test_add_trace_refuses_another_captures_file(tmp_path: Path) -> None:
    db = Database(tmp_path / "index.db")
    ix = TraceRepo(db)
    ix.add_trace(trace_row(1, "/c0/main-r0.gz"), [file_row("/c0/main-r0.gz")])
    with pytest.raises(PathTaken, match=r"main-r0.gz is already the capture of main rank 0"):
        ix.add_trace(trace_row(2, "/c0/main-r0.gz"), [file_row("/c0/main-r0.gz")])
    # One of its other files is enough.
    with pytest.raises(PathTaken, match=r"\(pid 1\) in session s1 cycle 0"):
        ix.add_trace(trace_row(2, "/c0/x.gz"), [file_row("/c0/main-r0.gz", "summary")])
    # The same capture indexed again (a daemon killed before its commit) replaces itself.
    ix.add_trace(trace_row(1, "/c0/main-r0.gz"), [file_row("/c0/main-r0.gz")])
    # An nsys report of several ranks is indexed once for each, by design.
    ix.add_trace(trace_row(3, "/c0/main-r0.gz"), [file_row("/c0/main-r0.gz")], shared=True)
    paths = db.conn.execute("SELECT pid FROM traces ORDER BY pid").fetchall()
    assert [p[0] for p in paths] == [1, 3]
    db.close()


def test_a_capture_whose_file_is_taken_fails_saying_whose(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    db = Database(tmp_path / "index.db")
    perms = SpoolPerms(None)
    sessions = Sessions(SessionRepo(db), spool, perms, "node-a")
    results = Results(
        sessions,
        TraceRepo(db),
        FileRepo(db),
        InboxRepo(db),
        UploadQueueRepo(db),
        Incoming(spool, perms),
        None,
        "node-a",
    )
    s = Session("s1", "job", {"next": True}, [(1, 1, 2)], "torch", {}, None, None)
    a, b = (Target("h", pid, "job", "main", 0, 1) for pid in (1, 2))
    s.targets = {a.key: a, b.key: b}
    sessions.add(s)
    path = str(spool / "job" / "s1" / "c0" / "same.pt.trace.json.gz")
    for t in (a, b):
        sessions.reported(s, t, "capturing", None)
        sessions.queued(s, t)
        sessions.reported(s, t, "done", None)
    for t in (a, b):
        c = CaptureReport("s1", "job", "h", t.pid, "main", 0, 1, 0, 0, 0, 0, (1,), (), 1, 2, 1)
        trace = ProcessedTrace((ProcessedFile("trace", path, 9),), path, (1,), 1, 1, 1, 9)
        results.commit(Outcome(c, trace))
    assert (a.state, a.traces, b.state, b.traces) == ("done", 1, "failed", 0)
    assert b.error == (
        "not indexed: same.pt.trace.json.gz is already the capture of main rank 0 (pid 1)"
        " in session s1 cycle 0"
    )
    rows = db.conn.execute("SELECT pid FROM traces").fetchall()
    assert [r[0] for r in rows] == [1]
    db.close()
