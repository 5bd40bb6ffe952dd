"""End-to-end captures: real torchrun jobs (gloo, CPU), a real daemon, real profctl.

Explicit step ranges are made deterministic with a gate: the job attaches, then waits for a
file before its first step, and the test opens the gate only once every target reports
``armed``. Everything else uses ``--next``, which the daemon resolves against the steps the
clients report. No test depends on how fast the machine is, only on generous timeouts.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import BIN, JOBS, Daemon, Job, step_markers, wait_for

# torch-tb-profiler's worker/span file-name pattern.
TB_PROFILER_RE = re.compile(r"^(.*?)(\.\d+)?\.pt\.trace\.json(?:\.gz)?$")
TERMINAL = {"done", "partial", "failed", "cancelled"}
TRACE_ROW_KEYS = {
    "session",
    "job",
    "host",
    "pid",
    "role",
    "rank",
    "cycle",
    "steps",
    "path",
    "bytes",
    "state",
    "created_at",
    "files",
}
WAIT = 120.0

pytestmark = pytest.mark.slow


# --- helpers -----------------------------------------------------------------------------------
def event_names(trace: Path) -> set[str]:
    with gzip.open(trace, "rt", encoding="utf-8") as fh:
        return {str(ev.get("name")) for ev in json.load(fh)["traceEvents"]}


def show(d: Daemon, sid: str) -> dict[str, Any]:
    doc: dict[str, Any] = d.ctl_json("show", sid)
    return doc


def wait_session(d: Daemon, sid: str, timeout: float = WAIT) -> dict[str, Any]:
    """The session once it reached a terminal state."""
    s: dict[str, Any] = wait_for(
        lambda: (lambda s: s if s["state"] in TERMINAL else None)(show(d, sid)),
        timeout,
        f"session {sid} to end",
        every=0.2,
    )
    return s


def wait_targets(d: Daemon, sid: str, states: set[str], timeout: float = WAIT) -> dict[str, Any]:
    """The session once every target is in one of ``states``; fails at once if it ended."""

    def reached() -> dict[str, Any] | None:
        s = show(d, sid)
        if s["state"] in TERMINAL - states:
            raise AssertionError(f"session ended before {sorted(states)}: {s}")
        return s if s["targets"] and {t["state"] for t in s["targets"]} <= states else None

    s: dict[str, Any] = wait_for(reached, timeout, f"every target of {sid} in {sorted(states)}")
    return s


def session_ids(d: Daemon) -> set[str]:
    return {s["id"] for s in d.ctl_json("sessions", "--limit", "1000")}


def traces(d: Daemon, *args: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = d.ctl_json("traces", *args)
    return rows


def start(d: Daemon, *args: str) -> dict[str, Any]:
    res: dict[str, Any] = d.ctl_json("start", *args)
    return res


def start_and_wait(d: Daemon, *args: str) -> dict[str, Any]:
    r = d.ctl("start", *args, "--wait", "--timeout", str(WAIT), "--json", timeout=WAIT + 30)
    assert r.returncode == 0, f"start {args} failed ({r.returncode}): {r.stderr}{r.stdout}"
    res: dict[str, Any] = json.loads(r.stdout)
    return res


def by_rank(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for r in rows}


def launch(d: Daemon, log: Path, script: str = "workers.py", nproc: int = 2, **env: str) -> Job:
    """``torchrun`` as the ``torchrun`` fixture does it, usable from module-scoped fixtures."""
    e = d.env()
    # A crash inside torch/kineto shows up in the job log with a Python stack.
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **env)
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(JOBS / script)]
    return Job.spawn(cmd, e, log)


@pytest.fixture
def jobs(torchrun: Callable[..., Job]) -> Iterator[Callable[..., Job]]:
    """``torchrun``, plus a teardown that also kills the workers of a job left running."""
    started: list[Job] = []

    def start_job(script: str, **kw: Any) -> Job:
        kw.setdefault("PYTHONFAULTHANDLER", "1")
        j = torchrun(script, **kw)
        started.append(j)
        return j

    yield start_job
    for j in started:
        j.kill()


def open_gate_when_armed(d: Daemon, gate: Path, *sids: str) -> None:
    for sid in sids:
        wait_targets(d, sid, {"armed"})
    gate.touch()


# --- a running job shared by the tests that only need "some job taking steps" ----------------
#: The tests on :func:`shared` run on one xdist worker (``--dist loadgroup``): otherwise each
#: worker would start its own daemon and DDP job for them.
ON_SHARED = pytest.mark.xdist_group("captures_shared")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    root = tmp_path_factory.mktemp("captures-shared")
    d = Daemon(root / "profd")
    d.root.mkdir()
    d.start()
    job = launch(d, root / "job.log", DDP="1", STEPS="1000000", STEP_SLEEP="0.05")
    try:
        rows = d.wait_attached(2, timeout=WAIT, min_step=1)
        # --next leads by half a second of each rank's reported step rate; until the first
        # rate arrives that lead is only 2 steps, which a loaded machine can overrun.
        wait_for(
            lambda: all(r["steps_per_s"] > 0 for r in d.polled_ps()), WAIT, "step rates", every=0.2
        )
        yield d, rows[0]["job"]
    finally:
        job.kill()
        d.stop()


# --- tests --------------------------------------------------------------------------------------
def test_ranks_and_steps_make_one_hta_readable_trace(
    daemon: Daemon, jobs: Callable[..., Job], tmp_path: Path
) -> None:
    gate = tmp_path / "go"
    job = jobs("workers.py", daemon=daemon, GATE=str(gate), DDP="1", STEPS="8")
    daemon.wait_attached(2, timeout=WAIT)
    waiter = subprocess.Popen(
        [
            str(BIN / "profctl"),
            "start",
            "--ranks",
            "1",
            "--steps",
            "3:5",
            "--wait",
            "--json",
            "--timeout",
            str(WAIT),
        ],
        env=daemon.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        sid = wait_for(lambda: next(iter(session_ids(daemon)), None), 30, "the session")
        open_gate_when_armed(daemon, gate, sid)
        out, err = waiter.communicate(timeout=WAIT + 30)
    finally:
        if waiter.poll() is None:
            waiter.kill()
    assert waiter.returncode == 0, err
    res = json.loads(out)  # stdout holds only the JSON document
    assert res["session"] == sid
    assert res["steps"] == [3, 4]
    assert res["state"] == "done"
    assert [t["rank"] for t in res["targets"]] == [1]
    assert job.wait() == 0, job.output()

    rows = traces(daemon, "--session", sid)
    assert [r["rank"] for r in rows] == [1]
    path = Path(rows[0]["path"])
    cycle_dir = daemon.spool / res["job"] / sid / "c0"
    assert path.parent == cycle_dir
    m = TB_PROFILER_RE.match(path.name)
    assert m and m.group(1) == "main-r1" and path.name.endswith(".gz"), path.name
    assert step_markers(path) == [3, 4]
    assert rows[0]["steps"] == [3, 4]
    # Rank 0 was never profiled: nothing of it anywhere in the session.
    names = [p.name for p in (daemon.spool / res["job"] / sid).rglob("*") if p.is_file()]
    assert not [n for n in names if "-r0." in n], names

    from hta.trace_analysis import TraceAnalysis

    analyzer = TraceAnalysis(trace_dir=str(cycle_dir))
    assert list(analyzer.t.traces) == [1]


@ON_SHARED
def test_next_on_both_ranks_captures_the_same_steps(shared: tuple[Daemon, str]) -> None:
    d, _ = shared
    res = start_and_wait(d, "--next", "--active", "2")
    assert res["state"] == "done"
    assert len(res["steps"]) == 2 and res["steps"][1] == res["steps"][0] + 1
    rows = by_rank(traces(d, "--session", res["session"]))
    assert sorted(rows) == [0, 1]
    m0, m1 = (step_markers(Path(rows[r]["path"])) for r in (0, 1))
    assert m0 == m1 == res["steps"]


@ON_SHARED
def test_repeat_makes_one_cycle_dir_per_cycle(shared: tuple[Daemon, str]) -> None:
    d, job = shared
    res = start_and_wait(d, "--next", "--repeat", "2", "--ranks", "0")
    assert res["state"] == "done" and len(res["cycles"]) == 2
    sdir = d.spool / job / res["session"]
    assert sorted(p.name for p in sdir.iterdir() if p.is_dir()) == ["c0", "c1"]
    for cycle, (_, a, b) in enumerate(res["cycles"]):
        assert step_markers(sdir / f"c{cycle}" / "main-r0.pt.trace.json.gz") == list(range(a, b))
    rows = traces(d, "--session", res["session"])
    assert sorted(r["cycle"] for r in rows) == [0, 1]


@ON_SHARED
def test_region_scoped_session_traces_each_region_entry(shared: tuple[Daemon, str]) -> None:
    d, job = shared
    res = start_and_wait(d, "--next", "--active", "2", "--region", "forward", "--ranks", "0")
    assert res["state"] == "done"
    sdir = d.spool / job / res["session"]
    assert sorted(p.name for p in sdir.iterdir() if p.is_dir()) == ["c0", "c1"]
    for cycle in (0, 1):
        trace = sdir / f"c{cycle}" / "main-r0.pt.trace.json.gz"
        names = event_names(trace)
        # Only the region was recorded, not the rest of the step around it.
        assert "forward" in names and "backward" not in names, sorted(names)[:40]
        assert step_markers(trace) == [res["steps"][cycle]]


@ON_SHARED
def test_queued_session_runs_after_the_busy_one(shared: tuple[Daemon, str]) -> None:
    d, _ = shared
    first = start(d, "--next", "--active", "20")
    second = start(d, "--next")
    assert second["steps"][0] >= first["steps"][-1] + 1, (first["steps"], second["steps"])
    for res in (first, second):
        s = wait_session(d, res["session"])
        assert s["state"] == "done", s
        rows = by_rank(traces(d, "--session", res["session"]))
        assert sorted(rows) == [0, 1]
        for r in rows.values():
            # The session's own steps: --next steps move if a rank got them too late.
            assert step_markers(Path(r["path"])) == s["steps"]


@ON_SHARED
def test_stop_keeps_a_shorter_trace_and_cancel_discards(shared: tuple[Daemon, str]) -> None:
    d, _ = shared
    long = start(d, "--next", "--active", "2000", "--ranks", "0")
    wait_targets(d, long["session"], {"capturing"})
    assert d.ctl_json("stop", long["session"])["session"] == long["session"]
    s = wait_session(d, long["session"])
    assert s["state"] == "done", s
    [row] = traces(d, "--session", long["session"])
    got = step_markers(Path(row["path"]))
    assert got and got[0] == s["steps"][0] and len(got) < 2000, got

    doomed = start(d, "--next", "--active", "2000", "--ranks", "1")
    wait_targets(d, doomed["session"], {"capturing"})
    assert d.ctl_json("cancel", doomed["session"])["session"] == doomed["session"]
    s = wait_session(d, doomed["session"])
    assert s["state"] == "cancelled", s
    assert [t["state"] for t in s["targets"]] == ["cancelled"]
    assert traces(d, "--session", doomed["session"]) == []
    # An ended session cannot be stopped again.
    r = d.ctl("stop", doomed["session"])
    assert r.returncode != 0 and "already ended" in r.stderr


@ON_SHARED
def test_profile_memory_gets_an_html_memory_report(shared: tuple[Daemon, str]) -> None:
    """Modalities' profiler_memory_*.html, made by the daemon from the trace."""
    d, _ = shared
    res = start_and_wait(d, "--next", "--active", "2", "--profile-memory", "--ranks", "1")
    [row] = traces(d, "--session", res["session"])
    kinds = {f["kind"]: f["path"] for f in row["files"]}
    page = Path(kinds["memory_report"])
    assert page.name == "main-r1.memory.html" and page.parent == Path(row["path"]).parent
    text = page.read_text()
    assert "<h2>cpu</h2>" in text and "peak allocated" in text
    steps = [int(n) for n in re.findall(r"<tr><td>(\d+)</td>", text)]
    assert steps == res["steps"]


@ON_SHARED
def test_traces_filters(shared: tuple[Daemon, str]) -> None:
    d, job = shared
    res = start_and_wait(d, "--next")
    sid = res["session"]
    rows = traces(d, "--session", sid)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        assert set(r) >= TRACE_ROW_KEYS, sorted(TRACE_ROW_KEYS - set(r))
        assert r["session"] == sid and r["job"] == job and r["role"] == "main"
        assert r["cycle"] == 0 and r["steps"] == res["steps"] and r["state"] == "ok"
        assert r["bytes"] == Path(r["path"]).stat().st_size > 0
        kinds = {f["kind"]: f["path"] for f in r["files"]}
        assert kinds["trace"] == r["path"] and Path(kinds["summary"]).is_file(), r["files"]
        assert {"kind", "path"} <= set(r["files"][0])

    assert {r["session"] for r in traces(d, "--job", job, "--limit", "1000")} >= {sid}
    assert traces(d, "--job", "no-such-job") == []
    r1 = traces(d, "--session", sid, "--rank", "1")
    assert [r["rank"] for r in r1] == [1]
    assert all(r["rank"] == 0 for r in traces(d, "--rank", "0", "--limit", "1000"))
    assert len(traces(d, "--session", sid, "--role", "ma*")) == 2
    assert traces(d, "--session", sid, "--role", "actor") == []
    assert len(traces(d, "--session", sid, "--since", "1h")) == 2
    future = str(time.time() + 3600)
    assert traces(d, "--session", sid, "--since", future) == []
    bad = d.ctl("traces", "--since", "yesterday")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1


INVALID = [
    (("--steps", "0:3"), "1-indexed"),
    (("--steps", "5:5"), "less than stop"),
    (("--steps", "5:3"), "less than stop"),
    (("--steps", "a:b"), "integers"),
    (("--steps", "1.5:3"), "integers"),
    (("--steps", "3:5", "--next"), "use one of"),
    (("--ranks", "7"), "attached"),
    (("--ranks", "x"), "rank"),
    (("--role", "nomatch*"), "attached"),
]


@ON_SHARED
def test_invalid_requests_are_refused_and_start_nothing(shared: tuple[Daemon, str]) -> None:
    d, job = shared
    before = session_ids(d)
    for args, needle in INVALID:
        r = d.ctl("start", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0, (args, r.stdout)
        assert len(lines) == 1 and needle in lines[0], (args, r.stderr)
        assert r.stdout == "", (args, r.stdout)
    # "matches nothing" names what is attached, so the user can fix the selector.
    r = d.ctl("start", "--ranks", "7")
    assert f"job={job}" in r.stderr and "ranks=0,1" in r.stderr, r.stderr

    # Steps already passed: the refusal carries the target's current step.
    at = min(row["step"] for row in d.wait_attached(2, timeout=WAIT, min_step=50))
    r = d.ctl("start", "--steps", "2:3")
    assert r.returncode != 0
    [line] = r.stderr.strip().splitlines()
    m = re.search(r"at step (\d+)", line)
    assert "already passed" in line and m and int(m.group(1)) >= at, line

    # --json: stdout still holds only one JSON document, with the error.
    r = d.ctl("start", "--steps", "0:3", "--json")
    assert r.returncode != 0 and "1-indexed" in json.loads(r.stdout)["error"]
    assert session_ids(d) == before


def test_role_globs_and_manual_steps(
    daemon: Daemon, jobs: Callable[..., Job], tmp_path: Path
) -> None:
    gate = tmp_path / "go"
    job = jobs(
        "workers.py",
        daemon=daemon,
        GATE=str(gate),
        ROLES="actor,rollout",
        MANUAL_ROLES="rollout",
        STEPS="8",
    )
    rows = by_rank(daemon.wait_attached(2, timeout=WAIT))
    assert (rows[0]["role"], rows[0]["step_mode"]) == ("actor", "optimizer")
    assert (rows[1]["role"], rows[1]["step_mode"]) == ("rollout", "manual")
    actor = start(daemon, "--role", "act*", "--steps", "3:5")
    rollout = start(daemon, "--role", "*out", "--steps", "3:5")
    assert [(t["role"], t["rank"]) for t in actor["targets"]] == [("actor", 0)]
    assert [(t["role"], t["rank"]) for t in rollout["targets"]] == [("rollout", 1)]
    open_gate_when_armed(daemon, gate, actor["session"], rollout["session"])
    for res, stem in ((actor, "actor-r0"), (rollout, "rollout-r1")):
        s = wait_session(daemon, res["session"])
        assert s["state"] == "done", s
        [row] = traces(daemon, "--session", res["session"])
        assert Path(row["path"]).name == f"{stem}.pt.trace.json.gz"
        # The rollout rank counts steps with profd_client.step() and has no optimizer.
        assert step_markers(Path(row["path"])) == [3, 4], stem
    assert [r["role"] for r in traces(daemon, "--role", "roll*")] == ["rollout"]
    assert job.wait() == 0, job.output()
    assert sorted(r["steps"] for r in job.results()) == [8, 8]


def test_auto_rule_arms_rank_as_it_attaches(
    daemon_factory: Callable[..., Daemon], jobs: Callable[..., Job], tmp_path: Path
) -> None:
    d = daemon_factory(config='[[auto]]\nsteps = "3:5"\nranks = "0"\n')
    gate = tmp_path / "go"
    job = jobs("workers.py", daemon=d, GATE=str(gate), DDP="1", STEPS="8")
    d.wait_attached(2, timeout=WAIT)
    sid = wait_for(lambda: next(iter(session_ids(d)), None), WAIT, "the [[auto]] session")
    s = wait_targets(d, sid, {"armed"})
    assert [t["rank"] for t in s["targets"]] == [0] and s["steps"] == [3, 4]
    assert s["label"] == "auto:0"
    gate.touch()
    s = wait_session(d, sid)
    assert s["state"] == "done", s
    [row] = traces(d, "--session", sid)
    assert row["rank"] == 0 and step_markers(Path(row["path"])) == [3, 4]
    assert job.wait() == 0, job.output()
    assert session_ids(d) == {sid}  # one rule, one job: one session


def test_auto_rule_captures_step_1_of_a_job_that_waits_in_attach(
    daemon_factory: Callable[..., Daemon], jobs: Callable[..., Job]
) -> None:
    """verl's ``profile_steps: [1, 2, 5]``: an [[auto]] rule and ``PROFD_ATTACH_WAIT``."""
    d = daemon_factory(config='[[auto]]\nsteps = "1,2,5"\nranks = "0"\n')
    # No gate: the job runs straight into step 1 as soon as attach() returns.
    job = jobs("workers.py", daemon=d, DDP="1", STEPS="6", STEP_SLEEP="0", PROFD_ATTACH_WAIT="30")
    assert job.wait() == 0, job.output()
    [sid] = session_ids(d)
    s = wait_session(d, sid)
    assert s["state"] == "done" and s["steps"] == [1, 2, 5], s
    rows = sorted(traces(d, "--session", sid), key=lambda r: int(r["cycle"]))
    assert [(r["rank"], r["cycle"]) for r in rows] == [(0, 0), (0, 1), (0, 2)]
    assert [step_markers(Path(r["path"])) for r in rows] == [[1], [2], [5]]


def test_auto_rule_on_step_1_without_waiting_says_how(
    daemon_factory: Callable[..., Daemon], jobs: Callable[..., Job]
) -> None:
    d = daemon_factory(config='[[auto]]\nsteps = "1:3"\n')
    job = jobs("workers.py", daemon=d, STEPS="4", STEP_SLEEP="0")
    assert job.wait() == 0, job.output()
    assert session_ids(d) == set()
    wait_for(lambda: "PROFD_ATTACH_WAIT" in d.log.read_text(), 10, "the refusal in the log")


def test_killed_rank_fails_and_the_other_rank_is_kept(
    daemon: Daemon, jobs: Callable[..., Job], tmp_path: Path
) -> None:
    gate = tmp_path / "go"
    # No collectives in the loop, and the survivor rides out torchrun's SIGTERM.
    job = jobs(
        "workers.py",
        daemon=daemon,
        GATE=str(gate),
        KEEP_ON_SIGTERM="1",
        STEPS="70",
        STEP_SLEEP="0.05",
    )
    pids = {r["rank"]: r["pid"] for r in daemon.wait_attached(2, timeout=WAIT)}
    res = start(daemon, "--steps", "5:45")
    sid = res["session"]
    open_gate_when_armed(daemon, gate, sid)
    wait_targets(daemon, sid, {"capturing"})
    os.kill(pids[0], signal.SIGKILL)
    s = wait_session(daemon, sid)
    assert s["state"] == "partial", s
    t = {x["rank"]: x for x in s["targets"]}
    assert t[0]["state"] == "failed" and t[0]["error"], t[0]
    assert t[1]["state"] == "done" and t[1]["traces"] == 1, t[1]
    [row] = traces(daemon, "--session", sid)
    assert row["rank"] == 1 and step_markers(Path(row["path"])) == list(range(5, 45))
    job.wait()
    assert [r["rank"] for r in job.results()] == [1]


def test_next_moves_its_steps_when_a_rank_gets_them_late(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """An arm that reaches the training thread after its first step: every rank moves on."""
    # The job's training thread keeps the GIL, so its agent thread waits 2 s for it each time
    # it wakes up. With a 300 s heartbeat the daemon knows only the step the job attached at:
    # the first plan is surely too early, and every message takes seconds to get through.
    d = daemon_factory("[daemon]\nheartbeat_interval = 300.0\n")
    log = tmp_path / "gilbound.log"
    job = subprocess.Popen(
        [str(BIN / "python"), str(JOBS / "gilbound.py")],
        env={**d.env(), "SWITCH": "2.0", "RUN_S": "170"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        d.wait_attached(1)
        r = d.ctl("start", "--next", "--wait", "--timeout", "150", "--json", timeout=170)
        assert r.returncode == 0, f"{r.stderr}{r.stdout}\n{d.log.read_text()}"
        res = json.loads(r.stdout)
        assert "steps moved to" in r.stderr, r.stderr
        assert "moved to" in d.log.read_text()
        assert res["final"]["plan"] >= 1 and "moved" in d.ctl("show", res["session"]).stdout
        assert res["final"]["state"] == "done" and res["steps"] == res["final"]["steps"]
        [row] = traces(d, "--session", res["session"])
        assert step_markers(Path(row["path"])) == res["steps"]
    finally:
        job.kill()
        job.wait()
