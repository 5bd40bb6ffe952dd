"""Two live processes that claim one identity (job, role, rank).

A launcher bug, an elastic restart whose old process is still exiting, or two runs sharing
``PROFD_JOB`` register the same job, role and rank with no malice at all. Both were armed,
the second trace replaced the first's file, two index rows pointed at one file and the
session said "done". Now ``ps`` marks them, ``start`` warns, each keeps its own file
(``{role}-r{rank}-p{pid}``) and the session says which processes claim what.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from harness import Daemon, Job
from test_captures import traces, wait_session
from test_work_bounds import spawn_lone

pytestmark = pytest.mark.slow


def test_two_processes_claiming_one_rank_keep_both_traces(daemon: Daemon, tmp_path: Path) -> None:
    jobs: list[Job] = []
    try:
        jobs += [spawn_lone(daemon, tmp_path / f"dup{i}.log", "dup") for i in range(2)]
        jobs.append(spawn_lone(daemon, tmp_path / "solo.log", "solo"))
        rows = daemon.wait_attached(3, min_step=1)
        a, b = sorted(r["pid"] for r in rows if r["job"] == "dup")
        (solo,) = (r["pid"] for r in rows if r["job"] == "solo")

        # ps marks both claimants, and only them.
        marks = {r["pid"]: (r["duplicate"], r["claimed_by"]) for r in rows}
        assert marks == {a: (True, [a, b]), b: (True, [a, b]), solo: (False, [solo])}
        human = daemon.ctl("ps", "--job", "dup")
        assert human.returncode == 0, human.stderr
        lines = human.stdout.splitlines()
        for pid in (a, b):
            (line,) = (ln for ln in lines if f" {pid} " in ln)
            assert f" idle (duplicate: pids {a}, {b}) " in line, human.stdout
        assert "duplicate" not in daemon.ctl("ps", "--job", "solo").stdout

        # start warns on stderr and says so in --json.
        note = (
            f"2 processes claim main rank 0 (pids {a}, {b}):"
            f" their files are main-r0-p{a}, main-r0-p{b}"
        )
        # Two independent processes: --next cannot move one once the other began, so a late
        # arm on a loaded machine would fail it. A step 5 s ahead of both (50 ms steps).
        at = max(r["step"] for r in daemon.ps() if r["job"] == "dup") + 100
        r = daemon.ctl("start", "--job", "dup", "--at-step", str(at), "--json")
        assert r.returncode == 0, r.stderr
        assert r.stderr == f"profctl: warning: job dup: {note}\n"
        res = json.loads(r.stdout)
        assert res["duplicates"] == [
            {
                "job": "dup",
                "role": "main",
                "rank": 0,
                "pids": [a, b],
                "stems": [f"main-r0-p{a}", f"main-r0-p{b}"],
            }
        ]
        sid = res["session"]

        # Both traces are kept, each under its own name, each with its own index row.
        s = wait_session(daemon, sid)
        assert s["state"] == "done", s
        assert s["notes"] == [note]
        rows = traces(daemon, "--session", sid)
        assert sorted(r["pid"] for r in rows) == [a, b], rows
        cycle = daemon.spool / "dup" / sid / "c0"
        for row in rows:
            pid = row["pid"]
            assert Path(row["path"]) == cycle / f"main-r0-p{pid}.pt.trace.json.gz", row
            with gzip.open(row["path"], "rt") as fh:
                assert json.load(fh)["distributedInfo"]["rank"] == 0
        files = [f["path"] for row in rows for f in row["files"]]
        assert len(files) == len(set(files)), files

        # The session says it: show and session.json.
        shown = daemon.ctl("show", sid)
        assert f"\nnote    {note}\n" in shown.stdout, shown.stdout
        manifest = json.loads((daemon.spool / "dup" / sid / "session.json").read_text())
        assert manifest["notes"] == [note]
        assert sorted(t["stem"] for t in manifest["targets"]) == [f"main-r0-p{a}", f"main-r0-p{b}"]

        # A unique identity keeps the name HTA and TensorBoard expect.
        solo_sid = daemon.ctl_json("start", "--job", "solo", "--next")["session"]
        assert wait_session(daemon, solo_sid)["notes"] == []
        (row,) = traces(daemon, "--session", solo_sid)
        assert Path(row["path"]).name == "main-r0.pt.trace.json.gz"
    finally:
        for j in jobs:
            j.kill()
