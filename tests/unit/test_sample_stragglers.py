"""The straggler detector over processed samples, the incident comparison and the aging of
sample files, on a real SQLite index holding per-rank statistics (``stats_synth``: what the
pipeline stores). The same paths on real captures: ``tests/test_samples.py``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from incidentstore import incidents_on
from stats_synth import OPS, synthetic_session
from stats_synth import store_session as store

from profd.config import WatchConfig
from profd.daemon.sessions.samples import SampleAging, SampleStragglers, straggler_findings
from profd.report.incident_compare import compare, comparison_from_index, comparison_text
from profd.report.model import build_report
from profd.report.renderers import renderers
from profd.store.index import Database, FileRepo, SessionRepo
from profd.watch.incident_record import Incident, Suspect
from profd.watch.sampling import LABEL


def test_a_processed_sample_naming_a_straggler_opens_one_incident(tmp_path: Path) -> None:
    db = Database(tmp_path / "index.db")
    idx = SessionRepo(db)
    calm = synthetic_session(4, steps=4, session="sample-synthetic-101")
    slow = synthetic_session(4, steps=4, straggler=2, session="sample-synthetic-201")
    store(idx, calm, LABEL, 1.0)
    store(idx, slow, LABEL, 2.0)
    # The daemon's own incidents store on the same index (no capture armed: none is wired).
    spool = tmp_path / "spool"
    spool.mkdir()
    incidents = incidents_on(db, spool, WatchConfig())
    det = SampleStragglers(idx, incidents.open, incidents.clear_ranks)
    assert det.processed("sample-synthetic-101") == [] and incidents.rows() == []
    [opened] = det.processed("sample-synthetic-201")
    [row] = incidents.rows()
    assert row["id"] == opened.id and row["state"] == "open"
    assert (row["kind"], row["job"], row["role"], row["step"]) == (
        "straggler", "synthetic", "trainer", 103,
    )  # fmt: skip
    assert opened.suspects == [Suspect("node0000", "trainer", 2)]
    ev = row["evidence"]
    assert ev["session"] == "sample-synthetic-201" and ev["steps"] == [100, 103]
    assert ev["why"].startswith("rank 2 ") and ev["lead_ms"][0] > ev["threshold_ms"]
    assert incidents.referenced_sessions(["sample-synthetic-201", "sample-synthetic-101"]) == {
        "sample-synthetic-201"
    }
    assert det.processed("no-such-session") == []

    # A later sample that names rank 2 again keeps its incident open; a clean one resolves
    # it at once (the condition cleared), and a later straggler opens a new incident.
    again = synthetic_session(4, steps=4, straggler=2, session="sample-synthetic-301")
    clean = synthetic_session(4, steps=4, session="sample-synthetic-401", seed=7)
    store(idx, again, LABEL, 3.0)
    store(idx, clean, LABEL, 4.0)
    assert det.processed("sample-synthetic-301") == []
    assert [r["state"] for r in incidents.rows()] == ["open"]
    assert det.processed("sample-synthetic-401") == []
    [row] = incidents.rows()
    assert row["state"] == "resolved" and row["resolved_at"] is not None


def test_ranks_are_compared_within_their_role() -> None:
    s = synthetic_session(6, steps=6, straggler=4)
    # Ranks 0-2 another role, whose work differs: alone they name nobody, and rank 4 is
    # named among its own role's ranks.
    for t in s["targets"][:3]:
        t["role"] = "rollout"
    found = straggler_findings(s)
    # Every role is judged: one that names nobody is reported clean (its open stragglers
    # resolve).
    assert [(role, [x.rank for x in sus]) for role, sus, _, _ in found] == [
        ("rollout", []),
        ("trainer", [4]),
    ]


def test_the_comparison_names_what_the_suspect_spends_more_than_its_peer(tmp_path: Path) -> None:
    db = Database(tmp_path / "index.db")
    idx = SessionRepo(db)
    cap = synthetic_session(2, steps=6, straggler=1, extra_ms=30.0, session="cap-1")
    store(idx, cap, "incident:i1", 5.0)
    incident = Incident(
        "i1", "straggler", "synthetic", "trainer", "node0000",
        [Suspect("node0000", "trainer", 1)], 0.0, 103, {"why": "rank 1 ..."},
    )  # fmt: skip
    c = comparison_from_index(idx, incident, "cap-1")
    assert c["suspects"] == [["node0000", "trainer", 1]]
    assert c["peers"] == [["node0000", "trainer", 0]]
    d = c["suspect_vs_peer"]
    # The op the straggler runs 30 ms more of leads, and its compute is up by about that.
    assert d["ops"][0]["name"] == OPS[3] and 25 < d["ops"][0]["delta_ms"] < 35, d["ops"][:3]
    assert 25 < d["summary"]["compute"]["delta_ms"] < 35
    assert {x["a_step"] for x in d["steps"]} == set(range(100, 106))
    assert c["capture_vs_sample"] is None and c["notes"] == []
    text = comparison_text(c)
    assert "suspect against peer" in text and OPS[3] in text and "peer trainer r0" in text

    # The HTML page of the capture leads with the incident.
    rep = build_report(idx.session("cap-1") or {})
    rep.incident = {**incident.to_dict(), "comparison": c}
    page = renderers()["html"].render(rep)
    assert page.index("Incident i1") < page.index("common steps")
    assert "Suspect against peer" in page and OPS[3] in page


def test_a_regression_is_compared_with_the_jobs_last_sample_before_it(tmp_path: Path) -> None:
    db = Database(tmp_path / "index.db")
    idx = SessionRepo(db)
    incident = {"id": "i2", "kind": "regression", "job": "synthetic", "suspects": []}
    cap = synthetic_session(2, steps=4, compute_ms=130.0, session="cap-2", seed=1)
    store(idx, cap, "incident:i2", 10.0)
    c = comparison_from_index(idx, incident, "cap-2")
    assert c["capture_vs_sample"] is None and "no sample" in c["notes"][0]

    store(idx, synthetic_session(2, steps=4, session="sample-old"), LABEL, 3.0)
    store(idx, synthetic_session(2, steps=4, session="sample-last"), LABEL, 6.0)
    store(idx, synthetic_session(2, steps=4, session="sample-after"), LABEL, 11.0)
    store(idx, synthetic_session(2, steps=4, session="sample-failed"), LABEL, 7.0, "failed")
    c = comparison_from_index(idx, incident, "cap-2")
    assert c["sample"] == "sample-last", c
    d = c["capture_vs_sample"]
    assert d["a"] == "sample sample-last" and d["b"] == "capture cap-2"
    assert 25 < d["summary"]["compute"]["delta_ms"] < 35, d["summary"]
    assert c["suspect_vs_peer"] is None
    assert "capture against the job's last sample" in comparison_text(c)
    # The same map from the sessions themselves (show --json, session.json).
    again = compare(incident, idx.session("cap-2") or {}, idx.session("sample-last"))
    assert again == c


def test_sample_files_age_out_unless_an_incident_refers_to_them(tmp_path: Path) -> None:
    db = Database(tmp_path / "index.db")
    idx, file_repo = SessionRepo(db), FileRepo(db)
    now = time.time()
    spool = tmp_path / "spool"
    files: dict[str, list[Path]] = {}
    cases = [
        ("sample-old", LABEL, now - 7200, "local"),
        ("sample-kept", LABEL, now - 7200, "uploaded"),
        ("sample-uploading", LABEL, now - 7200, "pending"),
        ("sample-new", LABEL, now - 60, "local"),
        ("operator", None, now - 7200, "local"),
    ]
    for sid, label, at, upload in cases:
        store(idx, synthetic_session(2, steps=2, session=sid), label, at)
        d = spool / "j" / sid
        (d / "c0").mkdir(parents=True)
        files[sid] = [d / "c0" / "main-r0.pt.trace.json.gz", d / "c0" / "main-r0.summary.txt"]
        files[sid].append(d / "session.json")
        for p, kind in zip(files[sid], ("trace", "summary", "session"), strict=True):
            p.write_text("x")
            file_repo.add_file(
                {"session": sid, "job": "j", "kind": kind, "path": str(p),
                 "rel": str(p.relative_to(spool)), "bytes": 1, "upload_state": upload}
            )  # fmt: skip
    asked: list[list[str]] = []

    def referenced(ids: Any) -> set[str]:
        asked.append(sorted(ids))
        return {"sample-kept"} & set(ids)

    aging = SampleAging(file_repo, 3600.0, referenced)
    assert aging.tick(now) == 2  # the old sample's trace and summary
    assert asked == [["sample-kept", "sample-old", "sample-uploading"]]
    assert [p.exists() for p in files["sample-old"]] == [False, False, True]  # manifest stays
    assert not (spool / "j" / "sample-old" / "c0").exists()
    for sid in ("sample-kept", "sample-uploading", "sample-new", "operator"):
        assert all(p.exists() for p in files[sid]), sid
    assert file_repo.capture_files("sample-old") == []
    # Statistics stay in the index: the sample's report still builds.
    assert len(build_report(idx.session("sample-old") or {}).ranks) == 2
    assert aging.tick(now + 1) == 0 and len(asked) == 1  # not due before EVERY
