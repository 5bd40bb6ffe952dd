"""One capture report, one type: what the inbox stores is what a restarted daemon reads back."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from profd.daemon.captures.record import CaptureReport
from profd_client import protocol as P


@dataclass
class Target:
    host: str
    pid: int
    role: str
    rank: int
    world_size: int
    stem: str = "trainer-r3"


WHO = Target("host-a", 4242, "trainer", 3, 8)


def message(**over: Any) -> P.Captured:
    """A ``captured`` message as a client sends it, validated as the daemon validates it."""
    own = "/spool/.incoming/job/s1/p4242-0/c1"
    m: dict[str, Any] = {
        "id": 7,
        "session": "s1",
        "job": "what-the-client-claims",
        "cycle": 1,
        "steps": [10, 11],
        "files": [
            {"kind": "memory", "path": f"{own}/trainer-r3.memory.pickle"},
            {"kind": "trace", "path": f"{own}/trainer-r3.pt.trace.json"},
        ],
        "started_at": 100.0,
        "ended_at": 101.5,
        "stall_ms": 12.5,
        "region": None,
        "torch": "2.5.0",
        "device": "cuda",
        "notes": ["a note"],
        "plan": 2,
    } | over
    got = P.decode(P.encode(P.CAPTURED, **m), P.AGENT_INBOUND)
    assert isinstance(got, P.Captured)
    return got


def test_a_report_survives_the_inbox_whole() -> None:
    c = CaptureReport.from_message(message(), "job", WHO, 1000, 1001)
    # The row goes through SQLite as JSON.
    back = CaptureReport.from_row(json.loads(json.dumps(c.to_row())))
    assert back == c
    # Errors and an absent revision too.
    c2 = CaptureReport.from_message(message(error="oom", plan=0), "job", WHO, -1, -1)
    assert CaptureReport.from_row(json.loads(json.dumps(c2.to_row()))) == c2


def test_the_training_job_is_the_sessions_not_the_clients() -> None:
    c = CaptureReport.from_message(message(), "job", WHO, 1000, 1001)
    assert c.training_job == "job" and c.session_id == "s1"
    assert c.to_row()["report"]["job"] == "job"
    assert c.key == "s1/host-a/4242/1"
    assert c.target == ("host-a", 4242) and c.stem == "trainer-r3"
    assert c.revision == 2
    assert c.raw_dir == (".incoming", "job", "s1", "plan2", P.target_dir("host-a", 4242), "c1")


def test_the_raw_trace_is_the_first_trace_and_the_rest_are_extras() -> None:
    c = CaptureReport.from_message(message(), "job", WHO, 1000, 1001)
    assert c.raw_trace == "trainer-r3.pt.trace.json"
    assert c.extras == [("memory", "trainer-r3.memory.pickle")]
    assert c.state == "ok"
    bad = replace(c, files=(("memory", "/x/m.pickle"),), error="profiler failed")
    assert bad.raw_trace is None and bad.extras == [("memory", "m.pickle")]
    assert bad.state == "partial"


def test_an_older_daemons_inbox_row_is_read() -> None:
    """Rows written before the record: the whole message, and no kernel uid/gid."""
    m = msgspec.to_builtins(message()) | {"t": P.CAPTURED, "v": 2, "job": "job"}
    del m["plan"]
    row = {
        "report": m,
        "client": {"host": "host-a", "pid": 4242, "role": "trainer", "rank": 3, "world_size": 8},
    }
    c = CaptureReport.from_row(row)
    assert (c.uid, c.gid, c.revision, c.training_job) == (-1, -1, 0, "job")
    assert c.steps == (10, 11) and c.notes == ("a note",) and c.stall_ms == 12.5
    assert c.stem == c.raw_stem == "trainer-r3"  # no stem in the row: the plain name


def test_a_claimed_identity_names_its_outputs_apart_from_its_raw_files() -> None:
    """Another process claims trainer rank 3: the raw files keep the name the client gives
    them in its own dir, the outputs take the target's and the inbox keeps it."""
    c = CaptureReport.from_message(message(), "job", replace(WHO, stem="trainer-r3-p4242"), 1, 1)
    assert (c.stem, c.raw_stem) == ("trainer-r3-p4242", "trainer-r3")
    assert c.raw_trace == "trainer-r3.pt.trace.json"
    assert [c.final_name(n) for _, n in c.extras] == ["trainer-r3-p4242.memory.pickle"]
    assert CaptureReport.from_row(json.loads(json.dumps(c.to_row()))) == c
