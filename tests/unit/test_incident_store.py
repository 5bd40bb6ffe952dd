"""Incidents (profd.daemon.watch.incident_store) on a real SQLite index and a real spool: dedup,
resolution after the hold, the cooldown of a flapping job, and a restart that keeps them and
fires nothing again. The capture is what the loop passes in (its Starter);
here a recorder stands in for it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from incidentstore import incidents_on

from profd import control_schema as C
from profd.config import WatchConfig
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.daemon.watch.incident_store import Incidents
from profd.daemon.watch.sinks import IncidentCounts, record_sinks
from profd.scheduling.refusal import Refused
from profd.store import layout
from profd.store.index import Database, FileRepo, IncidentRepo, SessionRepo
from profd.watch.incident_record import OPEN, RESOLVED, Incident, Suspect, seen_by
from profd_client import protocol as P

CFG = WatchConfig(window=6.0, baseline=12.0, hold=3.0, cooldown=60.0)


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


class Recorder:
    """Arms nothing: says which incidents asked, and answers with a session id."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.refuse: str | None = None

    def __call__(self, inc: Incident) -> str:
        if self.refuse:
            raise Refused(P.ErrorCode.SPOOL_FULL, self.refuse)
        self.asked.append(inc.id)
        return f"sess-{len(self.asked)}"


def repos(path: Path) -> tuple[IncidentRepo, FileRepo, SessionRepo]:
    """What :class:`Incidents` reads and writes, over one connection to ``path``."""
    db = Database(path)
    return IncidentRepo(db), FileRepo(db), SessionRepo(db)


def make(tmp_path: Path, clock: Clock, cfg: WatchConfig = CFG) -> tuple[Incidents, Recorder]:
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    rec = Recorder()
    return incidents_on(
        tmp_path / "index.db", spool, cfg, capture=rec, clock=clock, counts=True
    ), rec


def counts(incidents: Incidents) -> dict[str, int]:
    """What ``/metrics`` counts: the store's counting sink."""
    (counter,) = [s for s in incidents.sinks if isinstance(s, IncidentCounts)]
    return counter.counts


def slow(incidents: Incidents, rank: int = 1, job: str = "j") -> Incident | None:
    return incidents.open(
        "slow_rank", job, "worker", [Suspect("h", "worker", rank)], 100, {"ratio": 1.4}
    )


def regression(incidents: Incidents, job: str = "j") -> Incident | None:
    return incidents.open("regression", job, "main", [], 100, {"ratio": 1.5})


def test_one_open_incident_per_kind_job_and_rank(tmp_path: Path) -> None:
    clock = Clock()
    incidents, rec = make(tmp_path, clock)
    first = slow(incidents)
    assert first is not None and first.state == OPEN and first.session == "sess-1"
    for _ in range(5):
        clock.t += 1.0
        assert slow(incidents) is None  # the rule reports it each tick: still the one
        incidents.tick()
    other = slow(incidents, rank=2)
    assert other is not None and other.id != first.id
    assert slow(incidents, job="k") is not None  # another job
    reg = regression(incidents)
    assert reg is not None and reg.suspects == []
    assert regression(incidents) is None  # job-wide: one per job
    assert counts(incidents)["slow_rank"] == 3 and counts(incidents)["regression"] == 1
    # One capture per job inside the cooldown: j's first incident's, and k's.
    assert len(rec.asked) == 2 and other.session is None and reg.session is None
    rows = incidents.rows()
    assert len(rows) == 4 and {first.id, other.id, reg.id} < {r["id"] for r in rows}
    assert [r["id"] for r in incidents.rows(job="j", kind="regression")] == [reg.id]


def test_it_is_kept_in_the_index_and_as_a_file_queued_like_any_other(tmp_path: Path) -> None:
    clock = Clock()
    incidents, _ = make(tmp_path, clock)
    inc = slow(incidents)
    assert inc is not None
    path = tmp_path.joinpath("spool", *layout.incident_parts("j", inc.id))
    assert path.name == f"{inc.id}.json" and path.parent.name == "incidents"
    doc = json.loads(path.read_text())
    assert doc == inc.to_dict() == incidents.store.incident(inc.id)
    assert doc["suspects"] == [{"host": "h", "role": "worker", "rank": 1}]
    row = incidents.store.conn.execute(
        "SELECT kind, rel, upload_state FROM files WHERE path = ?", (str(path),)
    ).fetchone()
    assert tuple(row) == ("incident", f"j/incidents/{inc.id}.json", "local")
    assert incidents.find(inc.id[-6:])["id"] == inc.id  # any unique part of its id
    # What the control requests answer with passes their reply schemas.
    rows = [{**r, "node": "n1"} for r in incidents.rows()]
    C.reply({"v": P.VERSION, "t": C.C_INCIDENTS}, rows)
    C.reply({"v": P.VERSION, "t": C.C_INCIDENT}, {**rows[0], "session_state": "armed"})
    with pytest.raises(Refused, match="no incident"):
        incidents.find("nope")


def test_resolved_once_its_rule_stops_reporting_it_for_the_hold(tmp_path: Path) -> None:
    clock = Clock()
    incidents, _ = make(tmp_path, clock)
    inc = slow(incidents)
    assert inc is not None
    clock.t += CFG.hold  # not reported for the hold exactly: still open
    incidents.tick()
    assert inc.state == OPEN
    clock.t += 0.5
    incidents.tick()
    assert inc.state == RESOLVED and inc.resolved_at == clock.t
    path = tmp_path.joinpath("spool", *layout.incident_parts("j", inc.id))
    assert json.loads(path.read_text())["state"] == RESOLVED
    assert incidents.store.incident(inc.id)["state"] == RESOLVED  # type: ignore[index]


def test_a_flapping_job_yields_one_incident_and_one_capture_per_cooldown(tmp_path: Path) -> None:
    clock = Clock()
    incidents, rec = make(tmp_path, clock)
    first = slow(incidents)
    assert first is not None
    for _ in range(8):  # fires, clears for longer than the hold, fires again...
        clock.t += CFG.hold + 1.0
        incidents.tick()
        assert first.state == RESOLVED
        clock.t += 1.0
        assert slow(incidents) is None
        assert first.state == OPEN  # the same incident, open again
    assert counts(incidents)["slow_rank"] == 1 and rec.asked == [first.id]
    assert sum("open again" in n for n in first.notes) == 8
    # Another kind in the same job inside the cooldown: an incident, but no capture.
    reg = regression(incidents)
    assert reg is not None and reg.session is None
    assert any("cooldown" in n for n in reg.notes), reg.notes
    # Once the cooldown passed: a new incident and a new capture.
    clock.t = first.detected_at + CFG.cooldown + 1.0
    incidents.tick()
    clock.t += CFG.hold + 1.0
    incidents.tick()
    again = slow(incidents)
    assert again is not None and again.id != first.id and again.session == "sess-2"
    assert rec.asked == [first.id, again.id]


def test_a_refused_capture_is_a_note_and_the_incident_stands(tmp_path: Path) -> None:
    clock = Clock()
    incidents, rec = make(tmp_path, clock)
    rec.refuse = "spool quota full"
    inc = slow(incidents)
    assert inc is not None and inc.session is None
    assert inc.notes == ["no capture: spool quota full"]
    (tmp_path / "off").mkdir()
    off, rec2 = make(tmp_path / "off", clock, WatchConfig(capture=False))
    inc2 = slow(off)
    assert inc2 is not None and inc2.session is None and rec2.asked == []


def test_a_restart_keeps_incidents_and_fires_nothing_again(tmp_path: Path) -> None:
    clock = Clock()
    incidents, _ = make(tmp_path, clock)
    inc = slow(incidents)
    reg = regression(incidents, job="k")
    assert inc is not None and reg is not None
    incidents.store.conn.close()

    clock.t += 5.0
    again, rec2 = make(tmp_path, clock)
    assert again.restore() == 2
    assert again.held[inc.id].state == OPEN
    # Its rule starts afresh: its ranks attach again, then it needs a window and a hold
    # before it reports anything; the incident waits twice that long for it.
    grace = 2 * (CFG.window + CFG.hold)
    clock.t += grace - 1.0
    again.tick()
    assert again.held[inc.id].state == OPEN
    assert slow(again) is None and regression(again, job="k") is None
    assert counts(again)["slow_rank"] == 0 and rec2.asked == []
    assert len(again.rows()) == 2
    # No longer reported: resolved once its grace passed.
    clock.t += grace + 1.0
    again.tick()
    assert again.held[inc.id].state == RESOLVED
    # The job's capture was inside the cooldown: a new incident of it captures nothing.
    other = slow(again, rank=2)
    assert other is not None and other.session is None and rec2.asked == []


def test_a_hangs_stacks_are_the_owners_file_and_withheld_from_other_users(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    clock = Clock()
    # A group-mode spool: files are group-readable, but not stacks.
    incidents = incidents_on(
        tmp_path / "index.db", spool, CFG, SpoolPerms(os.getgid()), clock=clock,
        owner_of={"j": 4242}.get,
    )  # fmt: skip
    frames = [{"function": "secret_fn", "file": "/home/b/train.py", "line": 3}]
    evidence = {
        "stalled_s": 61.0,
        "ranks_here": 1,
        "ranks": [{"host": "h", "role": "w", "rank": 0, "threads": [{"frames": frames}]}],
        "groups": [{"frames": frames, "where": "in secret_fn (train.py:3)"}],
        "summary": ["all  rank 0: in secret_fn (train.py:3)"],
        "verdict": "every rank is in secret_fn (train.py:3)",
        "flight": None,
    }
    hang = incidents.open("hang", "j", "w", [], 7, evidence)
    slow_one = slow(incidents)
    assert hang is not None and slow_one is not None and hang.owner == 4242
    path = spool.joinpath(*layout.incident_parts("j", hang.id))
    assert path.stat().st_mode & 0o777 == 0o600
    if os.geteuid() == 0:  # only root can give a file away
        assert path.stat().st_uid == 4242
    plain = spool.joinpath(*layout.incident_parts("j", slow_one.id))
    assert plain.stat().st_mode & 0o777 == 0o640  # figures only: the group's, as traces
    doc = incidents.find(hang.id)
    assert seen_by(doc, 4242, False) is doc and seen_by(doc, 7, True) is doc
    other = seen_by(doc, 7, False)
    assert "secret_fn" not in json.dumps(other) and other["evidence"]["stalled_s"] == 61.0
    assert other["evidence"]["verdict"].startswith("stacks withheld: they are of uid 4242's")
    assert doc["evidence"]["groups"]  # the owner's copy is untouched
    assert seen_by(incidents.find(slow_one.id), 7, False)["evidence"] == {"ratio": 1.4}
    # It stalls again inside the cooldown: the note says so with figures, not frames.
    clock.t += CFG.hold + 1
    incidents.tick()
    assert incidents.open("hang", "j", "w", [], 9, evidence) is None
    notes = incidents.find(hang.id)["notes"]
    assert notes and "stalled_s" in notes[0] and "secret_fn" not in json.dumps(notes), notes


class FailsOnce:
    """A sink before the record that cannot keep the first incident it is given (a full
    disk where it writes)."""

    def __init__(self) -> None:
        self.saved: list[tuple[str, bool]] = []

    def save(self, inc: Incident, new: bool) -> None:
        self.saved.append((inc.id, new))
        if len(self.saved) == 1:
            raise OSError(28, "No space left on device")


def test_a_sink_that_fails_stops_those_after_it_and_all_are_tried_again_next_tick(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    store, files, sessions = repos(tmp_path / "index.db")
    clock = Clock()
    counter, failing = IncidentCounts(), FailsOnce()
    sinks = [counter, failing, *record_sinks(store, files, spool, SpoolPerms(None), None)]
    incidents = Incidents(store, sessions, "n1", CFG, sinks, clock=clock)
    first = slow(incidents)
    assert first is not None
    path = spool.joinpath(*layout.incident_parts("j", first.id))
    assert not path.exists() and store.incident(first.id) is None
    assert [r["id"] for r in incidents.rows()] == [first.id]  # from memory meanwhile
    clock.t += 1.0
    incidents.tick()
    assert path.exists() and store.incident(first.id) is not None
    assert failing.saved == [(first.id, True), (first.id, False)]
    assert counter.counts["slow_rank"] == 1  # counted once, when it opened
