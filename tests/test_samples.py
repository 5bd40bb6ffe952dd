"""Samples on real daemons: ``[watch] sample_every``.

* A 2-rank gloo DDP job (``tests/jobs/paced.py``) sampled every 20 steps: the samples before
  rank 1 starts sleeping before the all-reduce name nobody; the first sample after names rank
  1 (a ``straggler`` incident, its evidence the sample). The incident comparison on those real
  captures: the suspect against its peer, and the slowed job against its last calm sample.
* A rank that stops stepping just before a sample's steps (a raw stepping peer,
  ``steppeer.py``): the sample ends with what it got once its time is up (the rank that
  captured processed and indexed, the other failed as not reached), and later samples go on.
* Two daemons, a 2-node torchrun job: every sample is one session id on both daemons, with
  the same steps, and ``profctl --cluster report`` over it covers all four ranks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from clusters import Cluster
from harness import Daemon, Job, wait_for
from steppeer import step_peers
from test_cluster_start import launch_two_nodes, stepping, stop_agents

from profd.report.incident_compare import compare
from profd.store.index import Database, SessionRepo
from profd.watch.sampling import LABEL

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("samples")]

WAIT = 120.0
EVERY = 20
#: More than the default 2: the rule is surer of a calm job on more steps (docs/reports.md).
STEPS = 8
CALM = "base_ms=40"
SLOW = "base_ms=40 slow=1 extra_ms=25 extra=sleep"


def samples(d: Daemon, job: str) -> list[dict[str, Any]]:
    """The job's sample sessions on ``d``, by first step."""
    rows = d.ctl_json("sessions", "--job", job, "--limit", "1000")
    out = [r for r in rows if r["label"] == LABEL]
    return sorted(out, key=lambda r: r["cycles"][0][1])


def ended(d: Daemon, job: str) -> list[dict[str, Any]]:
    return [r for r in samples(d, job) if r["state"] in ("done", "partial", "failed")]


def straggler_incidents(d: Daemon) -> dict[str, list[str]]:
    """Sample session -> the suspects its straggler incident named (``profctl incidents``)."""
    rows = d.ctl_json("incidents", "--kind", "straggler")
    return {
        r["evidence"]["session"]: [f"{s['role']}:r{s['rank']}@{s['host']}" for s in r["suspects"]]
        for r in rows
    }


def reported_after(d: Daemon, job: str, since: float, ranks: int) -> int:
    """The highest step the job's ranks reported in heartbeats sent after ``since``
    (monotonic): received later than a client heartbeat interval after it."""

    def fresh() -> int | None:
        before = time.monotonic()
        rows = [r for r in d.ps() if r["job"] == job]
        # A row's step is its last report's, or more (moved on at its rate): either way at
        # least the step it had when the report was sent.
        if len(rows) == ranks and all(before - r["age_s"] > since + d.heartbeat for r in rows):
            return max(int(r["step"]) for r in rows)
        return None

    step: int = wait_for(fresh, WAIT, f"{job}: reports sent after the mode changed", every=0.2)
    return step


def test_the_first_sample_after_a_rank_slows_names_it_and_none_before(
    daemon_factory: Callable[..., Daemon],
    torchrun: Callable[..., Job],
    tmp_path: Path,
) -> None:
    d = daemon_factory(config=f"[watch]\nsample_every = {EVERY}\nsample_steps = {STEPS}\n")
    mode = tmp_path / "mode"
    mode.write_text(CALM)
    torchrun("paced.py", nproc=2, daemon=d, MODE_FILE=str(mode), PROFD_JOB="paced2")
    d.wait_attached(2, timeout=WAIT, min_step=2)

    calm = wait_for(lambda: (e := ended(d, "paced2")) and len(e) >= 3 and e, WAIT, "3 samples")
    for s in calm:
        assert re.fullmatch(r"sample-paced2-\d+", s["id"]), s
        w, a, b = s["cycles"][0]
        assert a % EVERY == 1 and (w, b) == (a - 1, a + STEPS), s  # steps N*k+1 .. N*k+STEPS
    assert all(x["state"] == "done" for x in calm), calm
    written = time.monotonic()
    before = max(max(r["step"] for r in d.ps() if r["job"] == "paced2"), 0)
    mode.write_text(SLOW)
    # Every step from here on read the new mode: a step that began before the write is
    # done by the time a report sent after it says where the rank is.
    slow_from = reported_after(d, "paced2", written, 2) + 2

    def first_after() -> dict[str, Any] | None:
        later = [s for s in ended(d, "paced2") if s["cycles"][0][0] >= slow_from]
        return later[0] if later else None

    first = wait_for(first_after, WAIT, f"a sample from step {slow_from}")
    assert first["state"] == "done", first
    # The slowdown begins somewhere between ``before`` and ``slow_from``: a sample that
    # overlaps that span may name rank 1 already, and then the first sample wholly after it
    # adds no second incident (one open incident per kind, job and rank). Either way one
    # incident, named by the first sample whose steps reach past ``before``, or by ``first``.
    incidents = straggler_incidents(d)
    overlapping = [
        s["id"]
        for s in ended(d, "paced2")
        if s["cycles"][0][2] > before and s["cycles"][0][0] <= first["cycles"][0][0]
    ]
    assert len(incidents) == 1 and next(iter(incidents)) in overlapping, (overlapping, incidents)
    (named,) = incidents.values()
    assert [re.sub(r"@.*", "", x) for x in named] == ["main:r1"], incidents
    # Samples that ended before the slowdown began named nobody.
    calm_ids = [s["id"] for s in ended(d, "paced2") if s["cycles"][0][2] <= before]
    assert len(calm_ids) >= 3 and not set(calm_ids) & set(incidents), (calm_ids, incidents)

    # What differs, from the index alone: rank 1 against rank 0 in the slowed sample (its
    # sleep is time outside any operator), and the slowed job against its last calm sample.
    db = Database(d.state_dir / "index.db", readonly=True)
    try:
        idx = SessionRepo(db)
        cap = idx.session(first["id"])
        base = idx.session(calm_ids[-1])
    finally:
        db.close()
    assert cap is not None and base is not None
    host = cap["targets"][0]["host"]
    role = cap["targets"][0]["role"]
    incident = {
        "id": "x",
        "kind": "straggler",
        "job": "paced2",
        "suspects": [{"host": host, "role": role, "rank": 1}],
    }
    c = compare(incident, cap)
    vs = c["suspect_vs_peer"]
    assert c["peers"] == [[host, role, 0]] and vs["summary"]["idle"]["delta_ms"] > 0, vs
    assert vs["summary"]["collective"]["delta_ms"] < 0, vs  # the peer waits for it
    regression = {**incident, "kind": "regression", "suspects": []}
    c = compare(regression, cap, base)
    assert c["sample"] == base["id"] and c["capture_vs_sample"]["summary"]["step"]["delta_ms"] > 0


def test_a_sample_a_stuck_rank_cannot_complete_ends_with_what_it_got_and_sampling_goes_on(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    # A short sample_timeout: the rate-based part (50 steps of 20 ms per recorded step) is
    # shorter still, so each sample is given its warm-up lead and 3 s.
    d = daemon_factory(
        config="[daemon]\nheartbeat_interval = 0.5\n[watch]\nenabled = false\n"
        "capture = false\nsample_every = 40\nsample_steps = 2\nsample_timeout = 3\n"
    )
    with step_peers(tmp_path) as spawn:
        spawn(d, "stuck", 0, on_arm="capture")
        # Rank 1 stops stepping as soon as a sample is armed on it, before its steps.
        spawn(d, "stuck", 1, on_arm="stall")
        cut = wait_for(
            lambda: (e := ended(d, "stuck")) and len(e) >= 2 and e,
            WAIT / 2,
            "two samples ended although rank 1 stopped stepping",
        )
    first, second = cut[:2]
    assert second["cycles"][0][1] > first["cycles"][0][1], cut
    for s in (first, second):
        shown = d.ctl_json("show", s["id"])
        assert shown["state"] == "partial", shown
        ranks = {t["rank"]: t for t in shown["targets"]}
        assert (ranks[0]["state"], ranks[0]["traces"]) == ("done", 1), ranks[0]
        assert ranks[1]["state"] == "failed", ranks[1]
        assert "not reached" in ranks[1]["error"] and "sample not over in" in ranks[1]["error"]
        # The rank that captured is processed and indexed: its trace is listed.
        traces = d.ctl_json("traces", "--session", s["id"])
        assert [t["rank"] for t in traces] == [0], traces
    assert "ended with what it got; not reached: r rank 1" in d.log.read_text()


def test_a_sample_is_one_session_with_the_same_steps_on_every_node(
    cluster: Cluster, tmp_path: Path
) -> None:
    every = 100
    agents = launch_two_nodes(cluster, tmp_path, config=f"[watch]\nsample_every = {every}\n")
    try:
        stepping(cluster)
        a, b = (cluster.nodes[k][0] for k in (0, 1))

        def common() -> set[str] | None:
            ids = [{s["id"] for s in ended(x, "twonode")} for x in (a, b)]
            both = ids[0] & ids[1]
            return both if len(both) >= 2 else None

        ids = wait_for(common, WAIT * 2, "two samples ended on both nodes", every=0.5)
    finally:
        stop_agents(agents)
    for x in (a, b):
        for s in samples(x, "twonode"):
            first = s["cycles"][0][1]
            assert s["id"] == f"sample-twonode-{first}" and first % every == 1, s
    for sid in sorted(ids):
        shown = cluster.json("show", sid)
        assert {n["host"] for n in shown["nodes"]} == {"node-a", "node-b"}, shown
        first = int(sid.rsplit("-", 1)[1])
        for x in (a, b):
            [mine] = [s for s in samples(x, "twonode") if s["id"] == sid]
            assert mine["cycles"] == [[first - 1, first, first + 2]], mine
        doc = cluster.json("report", sid, "-o", str(tmp_path / f"{sid}.html"))
        assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1, 2, 3], doc["ranks"]
        assert doc["steps"] == [first, first + 1], doc["steps"]
