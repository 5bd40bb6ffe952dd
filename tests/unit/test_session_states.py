"""The Target/Session state machine (``profd/daemon/sessions/state.py``) driven through every
transition, with a real index on a SQLite file, and the one rule that combines states
(``profd/states.py``) checked against every place that uses it."""

from __future__ import annotations

import ast
import json
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profd import states
from profd.ctl.cluster import Node
from profd.ctl.clusterstart import _final
from profd.daemon.sessions.state import STOPPED_EARLY, Session, Sessions, Target
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.store.index import Database, SessionRepo
from profd_client import protocol as P

PROFD = Path(__file__).resolve().parents[2] / "profd"
CYCLES = [(8, 10, 12)]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    d = Database(tmp_path / "state" / "index.db")
    yield d
    d.close()


@pytest.fixture
def index(db: Database) -> SessionRepo:
    return SessionRepo(db)


@pytest.fixture
def sessions(tmp_path: Path, index: SessionRepo) -> Sessions:
    spool = tmp_path / "spool"
    spool.mkdir()
    return Sessions(index, spool, SpoolPerms(None), "node-a")


def target(pid: int, rank: int | None = None, **kw: Any) -> Target:
    r = pid - 100 if rank is None else rank
    return Target("host-a", pid, "job", "worker", r, 2, **kw)


def session(sessions: Sessions, *targets: Target, sid: str = "s1", **kw: Any) -> Session:
    s = Session(
        id=sid,
        job="job",
        request={"steps": "10-12"},
        cycles=list(CYCLES),
        backend="torch",
        options={},
        region=None,
        label=None,
        **kw,
    )
    for t in targets or (target(100), target(101)):
        s.targets[t.key] = t
    sessions.add(s)
    return s


def stored(index: SessionRepo, sid: str = "s1") -> dict[str, Any]:
    """The session as the index has it, targets by pid."""
    row = index.session(sid)
    assert row is not None
    row["by_pid"] = {t["pid"]: t for t in row["targets"]}
    return row


def ts(s: Session) -> list[Target]:
    return list(s.targets.values())


def fail_writes(db: Database, table: str) -> None:
    """Make every write of ``table`` fail, as a full disk would: a real SQLite error from the
    real index, raised by a trigger another connection installs."""
    other = sqlite3.connect(db.path)
    for op in ("INSERT", "UPDATE"):
        other.execute(
            f"CREATE TRIGGER full_{table}_{op} BEFORE {op} ON {table}"
            " BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
        )
    other.commit()
    other.close()


def heal(db: Database, table: str) -> None:
    other = sqlite3.connect(db.path)
    for op in ("INSERT", "UPDATE"):
        other.execute(f"DROP TRIGGER full_{table}_{op}")
    other.commit()
    other.close()


# --- the vocabulary ----------------------------------------------------------------------------
def test_the_vocabulary_is_the_wires() -> None:
    assert set(states.LIVE) | states.TERMINAL == states.STATES
    assert not set(states.LIVE) & states.TERMINAL
    assert states.TERMINAL - {"partial"} == states.TARGET_TERMINAL
    # A target ends as a client's report ends it, or cancelled by the daemon.
    assert P.REPORT_TERMINAL - {"stopped"} == states.TARGET_TERMINAL


@pytest.mark.parametrize(
    ("parts", "state"),
    [
        (["pending", "capturing", "done"], "pending"),
        (["armed", "capturing", "processing"], "armed"),
        (["processing", "done", "failed"], "processing"),
        (["done", "done"], "done"),
        (["done", "failed"], "partial"),
        (["done", "cancelled"], "partial"),  # a cancel after some ranks had their traces
        (["partial", "done"], "partial"),
        (["partial", "cancelled"], "partial"),
        (["cancelled", "cancelled"], "cancelled"),
        (["cancelled", "failed"], "failed"),  # a failure the user did not ask for shows
        (["failed"], "failed"),
    ],
)
def test_combine(parts: list[str], state: str) -> None:
    assert states.combine(parts) == state


def test_combine_refuses_nothing_and_strangers() -> None:
    with pytest.raises(ValueError, match="no states"):
        states.combine([])
    with pytest.raises(ValueError, match="not session states"):
        states.combine(["done", "no answer"])


# --- Target: the questions asked of it ---------------------------------------------------------
def test_target_questions_follow_its_life() -> None:
    t = target(100, hold=True)
    assert (t.open, t.terminal, t.finished, t.voidable, t.reportable, t.begun) == (
        True, False, False, True, False, False,
    )  # fmt: skip
    assert not t.awaiting_arm  # held for nsys
    t.hold = False
    assert t.awaiting_arm
    t._armed()
    assert t.state == "armed" and not t.awaiting_arm and t.voidable
    t._reported("capturing", None)
    assert t.reportable and t.begun and not t.voidable
    t.outstanding = 1
    t._reported("done", None)
    assert t.state == "processing" and t.reportable and t.finished and not t.open
    t._processed({"cycle": 0}, True, None)
    assert t.state == "done" and t.terminal and t.finished and t.begun and not t.reportable


def test_a_gone_target_is_finished_while_its_capture_is_still_processed() -> None:
    t = target(100, state="capturing", outstanding=1)
    t._gone("left")
    assert t.state == "processing" and t.open and t.finished


def test_voided_by_asks_for_a_cancel_under_another_identity() -> None:
    t = target(100, state="cancelled")
    assert t.voided_by(("job", "worker", 5, 8))
    assert not t.voided_by(t.identity)
    assert not target(100, state="failed").voided_by(("job", "worker", 5, 8))


def test_begun_counts_traces_and_outstanding_captures() -> None:
    assert target(100, traces=1, state="failed").begun
    assert target(100, outstanding=1, state="armed").begun
    assert not target(100, state="failed").begun


# --- Sessions: every transition, written to a real index ----------------------------------------
def test_add_writes_the_session_pending(sessions: Sessions, index: SessionRepo) -> None:
    session(sessions)
    assert sessions.changed
    assert sessions.flush() == []
    assert not sessions.changed
    row = stored(index)
    assert row["state"] == "pending" and set(row["by_pid"]) == {100, 101}
    assert {t["state"] for t in row["targets"]} == {"pending"}


def test_armed_moves_the_session_as_far_as_its_slowest_target(
    sessions: Sessions, index: SessionRepo
) -> None:
    s = session(sessions)
    a, b = ts(s)
    sessions.armed(s, a)
    sessions.flush()
    assert stored(index)["state"] == "pending"
    assert stored(index)["by_pid"][100]["state"] == "armed"
    sessions.armed(s, b)
    sessions.flush()
    assert stored(index)["state"] == "armed"
    sessions.reported(s, a, "capturing", None)
    sessions.armed(s, a)  # a late ack does not move it back
    sessions.flush()
    assert a.state == "capturing" and stored(index)["state"] == "armed"


def test_reported_terminal_states(sessions: Sessions, index: SessionRepo) -> None:
    t1, t2, t3, t4, t5 = (target(100 + i) for i in range(5))
    s = session(sessions, t1, t2, t3, t4, t5)
    for t in ts(s):
        sessions.reported(s, t, "capturing", None)
    sessions.reported(s, t1, "done", None)  # said done, but nothing came
    sessions.reported(s, t2, "failed", "x" * 5000)
    sessions.reported(s, t3, "cancelled", "cancelled by operator")
    sessions.reported(s, t4, "missed", "cycle 0 start passed")  # not an end
    t5.traces = 1
    sessions.reported(s, t5, "stopped", None)  # stopped early with a trace: done
    sessions.flush()
    by = stored(index)["by_pid"]
    assert (by[100]["state"], by[100]["error"]) == ("failed", "no trace captured")
    assert by[101]["state"] == "failed" and len(by[101]["error"]) == 1000
    assert (by[102]["state"], by[102]["final"]) == ("cancelled", "cancelled")
    assert (by[103]["state"], by[103]["error"]) == ("capturing", "cycle 0 start passed")
    assert by[104]["state"] == "done"
    assert stored(index)["state"] == "capturing"
    sessions.reported(s, t4, "capturing", None)
    sessions.reported(s, t1, "capturing", None)  # after its end: ignored
    assert t1.state == "failed"


def test_a_reported_capture_is_processing_until_the_pipeline_is_through(
    sessions: Sessions, index: SessionRepo
) -> None:
    s = session(sessions, target(100))
    (t,) = ts(s)
    sessions.reported(s, t, "capturing", None)
    sessions.queued(s, t)
    sessions.queued(s, t)
    sessions.reported(s, t, "done", None)
    sessions.flush()
    assert (t.outstanding, t.state, stored(index)["state"]) == (2, "processing", "processing")
    sessions.processed(s, t, {"cycle": 0, "trace": 1}, True, None)
    # Written at once, before any flush, in the caller's transaction.
    assert stored(index)["by_pid"][100]["traces"] == 1
    assert stored(index)["by_pid"][100]["results"] == [{"cycle": 0, "trace": 1}]
    assert t.state == "processing"
    sessions.processed(s, t, {"cycle": 1, "error": "bad"}, False, "bad trace")
    assert (t.state, t.traces, t.outstanding, t.error) == ("done", 1, 0, "bad trace")
    assert [s.id for s in sessions.flush()] == ["s1"]
    assert stored(index)["state"] == "done"


def test_processed_rolls_back_when_the_index_write_fails(
    sessions: Sessions, index: SessionRepo, db: Database
) -> None:
    s = session(sessions, target(100))
    (t,) = ts(s)
    sessions.reported(s, t, "capturing", None)
    sessions.queued(s, t)
    sessions.reported(s, t, "done", None)
    sessions.flush()
    before = (t.state, t.error, t.traces, t.outstanding, list(t.results))
    fail_writes(db, "targets")
    with pytest.raises(sqlite3.DatabaseError, match="disk is full"):
        sessions.processed(s, t, {"cycle": 0}, True, None)
    assert (t.state, t.error, t.traces, t.outstanding, t.results) == before
    heal(db, "targets")
    sessions.processed(s, t, {"cycle": 0}, True, None)  # the caller's retry
    assert (t.state, t.traces) == ("done", 1)
    assert stored(index)["by_pid"][100]["traces"] == 1


def test_flush_keeps_every_change_when_the_index_write_fails(
    sessions: Sessions, index: SessionRepo, db: Database
) -> None:
    s = session(sessions)
    sessions.flush()
    for t in ts(s):
        t.traces = 1
        sessions.reported(s, t, "done", None)
    fail_writes(db, "sessions")
    with pytest.raises(sqlite3.DatabaseError, match="disk is full"):
        sessions.flush()
    # Nothing half-written: the session's state is the one the index still has.
    assert s.state == "pending" and sessions.changed
    assert stored(index)["state"] == "pending"
    assert {t["state"] for t in stored(index)["targets"]} == {"pending"}
    heal(db, "sessions")
    assert sessions.flush() == [s]
    assert stored(index)["state"] == "done"
    assert {t["state"] for t in stored(index)["targets"]} == {"done"}


def test_fail_ends_a_target_with_why(sessions: Sessions, index: SessionRepo) -> None:
    s = session(sessions)
    a, b = ts(s)
    sessions.fail(s, a, "steps already passed", gone=True)
    sessions.reported(s, b, "capturing", None)
    sessions.queued(s, b)
    sessions.fail(s, b, "it said so")
    assert (a.state, a.error, a.gone) == ("failed", "steps already passed", True)
    assert (b.state, b.client_final) == ("processing", "failed")
    sessions.processed(s, b, {"cycle": 0}, True, None)
    # Its client said failed: the trace is kept, the target is not done.
    assert (b.state, b.traces, b.error) == ("failed", 1, "it said so")
    sessions.flush()
    row = stored(index)
    assert (row["state"], row["error"]) == ("failed", "steps already passed")


def test_gone_ends_the_process_in_every_live_session(
    sessions: Sessions, index: SessionRepo
) -> None:
    s1 = session(sessions, target(100), target(101), sid="s1")
    session(sessions, target(100), target(102), sid="s2")
    t = s1.targets[("host-a", 101)]
    t.traces = 1
    sessions.reported(s1, t, "done", None)
    sessions.gone(("host-a", 100), None)
    sessions.gone(("host-a", 101), "killed")  # already over: untouched
    sessions.flush()
    r1, r2 = stored(index, "s1"), stored(index, "s2")
    assert r1["by_pid"][100]["error"] == "process exited before capturing"
    assert r1["by_pid"][100]["state"] == "failed"
    assert (r1["by_pid"][101]["state"], r1["by_pid"][101]["error"]) == ("done", None)
    assert r1["state"] == "partial"
    assert r2["by_pid"][100]["state"] == "failed" and r2["state"] == "pending"
    assert [x.id for x in sessions.live()] == ["s2"]


def test_gone_from_ends_it_in_one_session_only(sessions: Sessions) -> None:
    s1 = session(sessions, target(100), sid="s1")
    s2 = session(sessions, target(100), sid="s2")
    sessions.gone_from(s1, s1.targets[("host-a", 100)], "gone")
    assert s1.targets[("host-a", 100)].state == "failed"
    assert s1.targets[("host-a", 100)].error == "gone"
    assert s2.targets[("host-a", 100)].state == "pending"


def test_release_lets_a_held_target_be_armed(sessions: Sessions, index: SessionRepo) -> None:
    s = session(sessions, target(100, hold=True))
    (t,) = ts(s)
    sessions.flush()
    assert not t.awaiting_arm
    sessions.release(s, t)
    assert t.awaiting_arm and sessions.changed


def test_join_adds_a_later_rank_that_holds_the_session_back(
    sessions: Sessions, index: SessionRepo
) -> None:
    s = session(sessions, target(100))
    sessions.armed(s, s.targets[("host-a", 100)])
    sessions.flush()
    assert stored(index)["state"] == "armed"
    late = target(101)
    sessions.join(s, late)
    sessions.flush()
    assert stored(index)["state"] == "pending"
    assert stored(index)["by_pid"][101]["state"] == "pending"


def test_replan_moves_every_open_target_back_to_pending(
    sessions: Sessions, index: SessionRepo
) -> None:
    t1, t2, t3 = target(100), target(101), target(102)
    s = session(sessions, t1, t2, t3)
    sessions.armed(s, t1)
    sessions.reported(s, t1, "missed", "steps passed")
    sessions.armed(s, t2)
    sessions.fail(s, t3, "too late for good")
    sessions.flush()
    assert s.arm_fields(Path("/in"))["incoming"] == "/in" and "plan" not in s.arm_fields(Path("/"))
    sessions.replan(s, [(40, 42, 44)], 123.0)
    assert (s.revision, s.cycles, s.armed_at) == (1, [(40, 42, 44)], 123.0)
    assert (t1.state, t1.error) == ("pending", None)
    assert t2.state == "pending" and t1.awaiting_arm and t2.awaiting_arm
    assert (t3.state, t3.error) == ("failed", "too late for good")  # over: stays
    fields = s.arm_fields(Path("/in"))
    assert (fields["plan"], fields["incoming"], fields["cycles"]) == (
        1,
        "/in/plan1",
        [[40, 42, 44]],
    )
    sessions.flush()
    row = stored(index)
    assert (row["plan"], row["cycles"], row["state"]) == (1, [[40, 42, 44]], "pending")


def test_a_replanned_session_runs_to_its_end(sessions: Sessions, index: SessionRepo) -> None:
    s = session(sessions)
    for t in ts(s):
        sessions.armed(s, t)
    sessions.replan(s, [(40, 42, 44)], 1.0)
    sessions.flush()
    assert stored(index)["state"] == "pending"
    for t in ts(s):
        sessions.armed(s, t)
        sessions.reported(s, t, "capturing", None)
        sessions.queued(s, t)
        sessions.reported(s, t, "done", None)
    sessions.flush()
    assert stored(index)["state"] == "processing"
    for t in ts(s):
        sessions.processed(s, t, {"cycle": 0}, True, None)
    assert sessions.flush() == [s]
    assert (stored(index)["state"], stored(index)["plan"]) == ("done", 1)


def test_cancel_records_why_and_the_targets_end_it(sessions: Sessions, index: SessionRepo) -> None:
    s = session(sessions)
    a, b = ts(s)
    sessions.cancel(s, "cancelled by operator")
    for t in (a, b):
        sessions.reported(s, t, "cancelled", None)
    assert sessions.flush() == [s]
    row = stored(index)
    assert (row["state"], row["error"]) == ("cancelled", "cancelled by operator")


def test_a_cancel_after_one_rank_has_its_trace_is_partial(
    sessions: Sessions, index: SessionRepo
) -> None:
    s = session(sessions)
    a, b = ts(s)
    a.traces = 1
    sessions.reported(s, a, "done", None)
    sessions.cancel(s, "cancelled by operator")
    sessions.reported(s, b, "cancelled", None)
    sessions.flush()
    assert stored(index)["state"] == "partial"


def test_a_cancel_with_a_process_gone_is_failed(sessions: Sessions, index: SessionRepo) -> None:
    s = session(sessions)
    a, b = ts(s)
    sessions.cancel(s, "cancelled by operator")
    sessions.reported(s, a, "cancelled", None)
    sessions.gone_from(s, b, None)
    sessions.flush()
    row = stored(index)
    assert (row["state"], row["error"]) == ("failed", "cancelled by operator")


def test_a_stop_before_any_capture_is_cancelled_not_failed(
    sessions: Sessions, index: SessionRepo
) -> None:
    s = session(sessions)
    a, b = ts(s)
    sessions.armed(s, a)  # b never got its arm acked: still pending
    for t in (a, b):
        sessions.stopping(s, t)
        sessions.reported(s, t, "stopped", None)
    assert sessions.flush() == [s]
    row = stored(index)
    assert (row["state"], row["error"]) == ("cancelled", STOPPED_EARLY)
    assert {(t["state"], t["error"]) for t in row["targets"]} == {("cancelled", STOPPED_EARLY)}


def test_a_stop_after_one_rank_has_its_trace_is_partial(
    sessions: Sessions, index: SessionRepo
) -> None:
    s = session(sessions)
    a, b = ts(s)
    sessions.reported(s, a, "capturing", None)
    a.traces = 1
    for t in (a, b):
        sessions.stopping(s, t)
        sessions.reported(s, t, "stopped", None)
    sessions.flush()
    row = stored(index)
    assert row["state"] == "partial"
    assert (row["by_pid"][100]["state"], row["by_pid"][101]["state"]) == ("done", "cancelled")


def test_a_stop_nobody_asked_for_is_still_a_failure(sessions: Sessions, index: SessionRepo) -> None:
    """A client stops its sessions itself when its process exits: no trace is a failure; so
    is a stopped capture that began and left nothing."""
    s = session(sessions)
    a, b = ts(s)
    sessions.reported(s, a, "stopped", None)  # its process is exiting
    sessions.reported(s, b, "capturing", None)
    sessions.stopping(s, b)
    sessions.reported(s, b, "stopped", None)
    sessions.flush()
    row = stored(index)
    assert row["state"] == "failed"
    assert {t["error"] for t in row["targets"]} == {"no trace captured"}


def test_finished_sessions_owe_their_manifest(sessions: Sessions, tmp_path: Path) -> None:
    s = session(sessions, target(100))
    (t,) = ts(s)
    sessions.cancel(s, "cancelled by operator")
    sessions.reported(s, t, "cancelled", None)
    assert sessions.flush() == [s]
    assert sessions.exact("s1") is None and sessions.manifests_owed == 1
    written: list[Path] = []
    assert sessions.write_manifests(lambda _s, p: written.append(p)) is None
    assert written == [tmp_path / "spool" / "job" / "s1" / "session.json"]
    manifest = json.loads(written[0].read_text())
    assert (manifest["state"], manifest["node"]) == ("cancelled", "node-a")
    assert sessions.manifests_owed == 0


def test_restore_and_settle_after_a_restart(
    sessions: Sessions, index: SessionRepo, tmp_path: Path
) -> None:
    s = session(sessions)
    a, b = ts(s)
    sessions.reported(s, a, "capturing", None)
    sessions.queued(s, a)
    sessions.processed(s, a, {"cycle": 0}, True, None)
    sessions.reported(s, a, "done", None)
    sessions.reported(s, b, "capturing", None)
    sessions.flush()
    # A daemon killed now: a is done (its state was derived already), b is capturing.
    again = Sessions(index, tmp_path / "spool", SpoolPerms(None), "node-a")
    (r,) = again.restore()
    ra, rb = r.targets[a.key], r.targets[b.key]
    assert (r.id, r.state, ra.state, ra.traces, ra.results) == (
        "s1", "capturing", "done", 1, [{"cycle": 0}],
    )  # fmt: skip
    assert (rb.state, rb.client_final) == ("capturing", None)
    assert again.busy_until(b.key) == CYCLES[-1][2]
    assert again.busy_until(a.key) == 0  # over in that session
    again.settle_restored()
    assert rb.state == "capturing"  # its client has not said anything final: it still may
    again.reported(r, rb, "done", None)
    assert rb.state == "failed"
    assert again.flush() == [r] and stored(index)["state"] == "partial"


def test_settle_restored_ends_a_target_whose_client_said_done(
    sessions: Sessions, index: SessionRepo, tmp_path: Path
) -> None:
    s = session(sessions, target(100))
    (t,) = ts(s)
    sessions.reported(s, t, "capturing", None)
    sessions.queued(s, t)
    sessions.queued(s, t)
    sessions.processed(s, t, {"cycle": 0}, True, None)
    sessions.reported(s, t, "done", None)
    sessions.flush()
    assert (t.state, t.outstanding) == ("processing", 1)
    # Killed now; the second capture never reached the inbox, so no replay brings it back.
    again = Sessions(index, tmp_path / "spool", SpoolPerms(None), "node-a")
    (r,) = again.restore()
    rt = r.targets[t.key]
    assert (r.state, rt.state, rt.client_final, rt.outstanding) == (
        "processing", "processing", "done", 0,
    )  # fmt: skip
    again.settle_restored()
    assert rt.state == "done"
    assert again.flush() == [r] and stored(index)["state"] == "done"


# --- one rule everywhere -----------------------------------------------------------------------
TARGET_STATES = st.sampled_from(sorted({*states.LIVE, *states.TARGET_TERMINAL}))
NODE_STATES = st.sampled_from(sorted(states.STATES))
NODES = st.lists(st.lists(TARGET_STATES, min_size=1, max_size=6), min_size=1, max_size=5)


def _daemon_state(parts: list[str]) -> str:
    """What a daemon's Session says of targets in these states."""
    s = Session("s", "job", {}, list(CYCLES), "torch", {}, None, None)
    for i, state in enumerate(parts):
        t = target(100 + i, state=state)
        s.targets[t.key] = t
    s.recompute()
    return s.state


@given(NODES)
def test_a_cluster_combines_node_by_node_as_one_node_would_all_targets(
    nodes: list[list[str]],
) -> None:
    """profctl combines each node's session state; a node combines its targets. The two
    orders give one answer, so no node and the cluster can tell different stories."""
    every = [s for node in nodes for s in node]
    assert states.combine(_daemon_state(n) for n in nodes) == _daemon_state(every)
    assert _daemon_state(every) == states.combine(every)


def _follow_result(node_states: list[str], missing: int = 0, ranks: bool = False) -> str:
    """The cluster --wait final state of nodes that ended in these states."""
    nodes = [Node(f"10.0.0.{i}", 7717) for i in range(len(node_states) + missing)]
    res = {
        "session": "s",
        "job": "job",
        "steps": [10],
        "cycles": [[10, 10, 10]],
        "missing_ranks": [7] if ranks else [],
        "nodes": [
            {"address": n.address, "host": n.address, "state": "started", "error": None}
            for n in nodes[: len(node_states)]
        ]
        + [
            {"address": n.address, "host": n.address, "state": "not started", "error": "refused"}
            for n in nodes[len(node_states) :]
        ],
    }
    last = {
        n.address: {"state": state, "targets": [], "error": None}
        for n, state in zip(nodes, node_states, strict=False)
    }
    return str(_final(res, last, [])["state"])


@given(st.lists(st.sampled_from(sorted(states.TERMINAL)), min_size=1, max_size=6))
def test_cluster_wait_gives_the_same_final_state(node_states: list[str]) -> None:
    assert _follow_result(node_states) == states.combine(node_states)
    # A node that did not start, or ranks no node had: a part that failed.
    assert _follow_result(node_states, missing=1) == states.combine([*node_states, "failed"])
    assert _follow_result(node_states, ranks=True) == states.combine([*node_states, "failed"])


def test_cluster_wait_counts_a_node_lost_while_live_as_failed() -> None:
    nodes = [Node("10.0.0.1", 7717), Node("10.0.0.2", 7717)]
    res = {
        "session": "s", "job": "job", "steps": [10], "cycles": [[10, 10, 10]],
        "missing_ranks": [],
        "nodes": [{"address": n.address, "host": n.address, "state": "started", "error": None}
                  for n in nodes],
    }  # fmt: skip
    last = {
        nodes[0].address: {"state": "done", "targets": [], "error": None},
        nodes[1].address: {"state": "capturing", "targets": [], "error": None},
    }
    out = _final(res, last, [nodes[1].address])
    assert out["state"] == "partial"
    assert out["nodes"][1]["state"] == "no answer"


@settings(max_examples=30, deadline=None)
@given(st.lists(NODE_STATES, min_size=1, max_size=len(states.STATES)))
def test_the_index_sql_asks_what_the_rule_calls_ended(session_states: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = Database(Path(tmp) / "index.db")
        ix = SessionRepo(db)
        try:
            for i, state in enumerate(session_states):
                ix.save_session(
                    {
                        "id": f"s{i}", "job": "job", "state": state, "backend": "torch",
                        "label": None, "region": None, "request": {}, "cycles": [],
                        "plan": 0, "error": None, "created_at": 0.0, "updated_at": 0.0,
                    }
                )  # fmt: skip
            opened = {s["id"] for s in ix.open_sessions()}
            owed = {s["id"] for s in ix.unwritten_manifests()}
        finally:
            db.close()
    for i, state in enumerate(session_states):
        assert (f"s{i}" in owed) == states.is_terminal(state) == (f"s{i}" not in opened)


def test_no_other_module_spells_the_states_out() -> None:
    """The terminal set and the live order are written in profd/states.py (and on the wire in
    profd_client/protocol/vocabulary.py) only: a literal naming three or more of them elsewhere
    is a second copy."""
    names = states.STATES
    offenders = []
    for path in PROFD.rglob("*.py"):
        if path.name == "states.py" and path.parent == PROFD:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            found: set[str] = set()
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                found = {e.value for e in node.elts if isinstance(e, ast.Constant)} & names
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found = {n for n in names if f"'{n}'" in node.value}
            if len(found) >= 3:
                offenders.append(f"{path.relative_to(PROFD)}:{node.lineno} {sorted(found)}")
    assert not offenders, offenders


def test_processes_claiming_one_rank_are_named_apart_and_stay_so(
    sessions: Sessions, index: SessionRepo, tmp_path: Path
) -> None:
    s = session(sessions, target(100, rank=0), target(101, rank=0), target(102, rank=1))
    assert [t.stem for t in ts(s)] == ["worker-r0-p100", "worker-r0-p101", "worker-r1"]
    note = "2 processes claim worker rank 0 (pids 100, 101): their files are worker-r0-p100,"
    assert s.notes == [note + " worker-r0-p101"]
    assert s.summary()["notes"] == s.notes
    sessions.flush()
    assert [t["stem"] for t in stored(index)["targets"]] == [t.stem for t in ts(s)]
    # A restarted daemon names their files as the one that armed them did.
    (r,) = Sessions(index, tmp_path / "spool", SpoolPerms(None), "node-a").restore()
    assert [t.stem for t in r.targets.values()] == [t.stem for t in ts(s)]


def test_a_later_claimant_is_named_apart_from_the_one_already_armed(sessions: Sessions) -> None:
    s = session(sessions, target(100, rank=0))
    assert s.targets[("host-a", 100)].stem == "worker-r0" and s.notes == []
    sessions.join(s, target(101, rank=0))
    assert [t.stem for t in ts(s)] == ["worker-r0", "worker-r0-p101"]
    assert s.notes == [
        "2 processes claim worker rank 0 (pids 100, 101): their files are worker-r0, worker-r0-p101"
    ]


def test_an_older_daemons_target_row_keeps_the_plain_name(
    sessions: Sessions, index: SessionRepo, tmp_path: Path
) -> None:
    session(sessions, target(100, rank=0))
    sessions.flush()
    index.conn.execute("UPDATE targets SET stem = NULL")
    (r,) = Sessions(index, tmp_path / "spool", SpoolPerms(None), "node-a").restore()
    assert [t.stem for t in r.targets.values()] == ["worker-r0"]
