"""A CLI that never surprises. Each case as the user meets it: a real daemon, two
real client processes (ranks 0 and 1 of one job), profctl's exact words and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import BIN, JOBS, Daemon, Job, wait_for

from profd.states import TERMINAL

_far = iter(range(900_000, 1 << 40, 10))


def far() -> str:
    """Steps no job here reaches while a test runs (the session stays armed), and no other
    session of the test holds (a rank busy with those steps would refuse)."""
    a = next(_far)
    return f"{a}:{a + 2}"


def ranks_of(d: Daemon, tmp_path: Path, n: int = 2) -> list[Job]:
    """``n`` processes of job ``j`` (ranks 0..n-1) attached to ``d``, stepping 20/s."""
    jobs = []
    for rank in range(n):
        env = d.env()
        env.update(PROFD_JOB="j", RANK=str(rank), WORLD_SIZE=str(n), PYTHONUNBUFFERED="1")
        out = tmp_path / f"rank{rank}.log"
        jobs.append(Job.spawn([sys.executable, str(JOBS / "lone.py")], env, out))
    d.wait_attached(n, min_step=1)
    return jobs


@pytest.fixture
def two_ranks(daemon: Daemon, tmp_path: Path) -> Iterator[Daemon]:
    jobs = ranks_of(daemon, tmp_path)
    try:
        yield daemon
    finally:
        for j in jobs:
            j.kill()


def ended(d: Daemon, sid: str) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        s: dict[str, Any] = d.ctl_json("show", sid)
        return s if s["state"] in TERMINAL else None

    return check


def sessions_of(d: Daemon) -> list[str]:
    return [s["id"] for s in d.ctl_json("sessions")]


def test_ranks_that_match_nothing_warn_and_strict_refuses(two_ranks: Daemon) -> None:
    d = two_ranks
    warning = (
        "profctl: rank 7 matched no attached process: the session runs without it"
        " (--strict refuses instead)\n"
    )
    r = d.ctl("start", "--ranks", "0,7", "--steps", far())
    assert r.returncode == 0, r.stderr
    assert r.stderr == warning
    assert "targets main:0\n" in r.stdout
    r = d.ctl("start", "--ranks", "0,7,9", "--steps", far(), "--json")
    assert r.returncode == 0 and r.stderr == warning.replace("rank 7", "ranks 7,9").replace(
        "without it", "without them"
    )
    res = json.loads(r.stdout)
    assert res["missing_ranks"] == [7, 9]
    assert [t["rank"] for t in res["targets"]] == [0]
    # Nothing is missing: nothing is said.
    r = d.ctl("start", "--ranks", "0,1", "--steps", far(), "--json")
    assert r.returncode == 0 and r.stderr == "" and json.loads(r.stdout)["missing_ranks"] == []

    before = sessions_of(d)
    r = d.ctl("start", "--ranks", "0,7", "--steps", far(), "--strict")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == "profctl: --strict: rank 7 matched no attached process; nothing started\n"
    r = d.ctl("start", "--ranks", "0,7", "--steps", far(), "--strict", "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout) == {
        "error": "--strict: rank 7 matched no attached process; nothing started",
        "code": "no_match",
    }
    assert sessions_of(d) == before
    # --strict with every rank there starts as usual.
    r = d.ctl("start", "--ranks", "0-1", "--steps", far(), "--strict")
    assert r.returncode == 0 and r.stderr == ""


def test_stop_before_the_capture_began_is_cancelled_not_failed(two_ranks: Daemon) -> None:
    d = two_ranks
    sid = d.ctl_json("start", "--steps", far())["session"]
    wait_for(lambda: d.ctl_json("show", sid)["state"] == "armed", 30, "the ranks to be armed")
    r = d.ctl("stop", sid)
    assert (r.returncode, r.stdout) == (0, f"session {sid}: stopping\n")
    s = wait_for(ended(d, sid), 30, "the stopped session to end")
    why = "stopped before its capture began"
    assert (s["state"], s["error"]) == ("cancelled", why)
    assert {(t["state"], t["error"]) for t in s["targets"]} == {("cancelled", why)}
    assert [x["id"] for x in d.ctl_json("sessions", "--state", "cancelled")] == [sid]
    manifest = json.loads((d.spool / "j" / sid / "session.json").read_text())
    assert (manifest["state"], manifest["error"]) == ("cancelled", why)
    assert d.ctl("show", sid).stdout.splitlines()[2] == f"error   {why}"


def test_a_wait_timeout_says_the_session_goes_on(two_ranks: Daemon) -> None:
    d = two_ranks
    r = d.ctl("start", "--steps", far(), "--wait", "--timeout", "1")
    assert r.returncode == 6
    sid = r.stdout.split()[1]
    assert r.stderr.splitlines()[-1] == (
        f"profctl: timed out waiting for session {sid} (state armed); it is still live:"
        f" `profctl show {sid}` shows how it is doing, `profctl stop {sid}` ends it keeping"
        f" what was captured, `profctl cancel {sid}` discards it"
    )
    assert d.ctl_json("show", sid)["state"] == "armed"  # it did go on
    r = d.ctl("start", "--steps", far(), "--wait", "--timeout", "1", "--json")
    assert r.returncode == 6
    doc = json.loads(r.stdout)
    assert doc["code"] == "timeout" and doc["error"].endswith("discards it")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("start", "--at-step", "0"), "--at-step must be at least 1 (got 0)"),
        (("start", "--active", "0"), "--active must be at least 1 (got 0)"),
        (("start", "--repeat", "5000"), "--repeat must be at most 1000 (got 5000)"),
        (
            ("start", "--at-step", str(1 << 50)),
            f"--at-step must be at most 2^48 (got {1 << 50})",
        ),
        (
            ("sessions", "--state", "bogus"),
            "--state 'bogus': must be one of armed, cancelled, capturing, done, failed,"
            " partial, pending, processing",
        ),
        (("sessions", "--limit", "0"), "--limit must be at least 1 (got 0)"),
        (("traces", "--rank", "-1"), "--rank must be at least 0 (got -1)"),
    ],
)
def test_refusals_name_the_flag_and_a_human_limit(
    daemon: Daemon, args: tuple[str, ...], message: str
) -> None:
    r = daemon.ctl(*args)
    assert (r.returncode, r.stdout, r.stderr) == (1, "", f"profctl: {message}\n")
    r = daemon.ctl(*args, "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout) == {"error": message, "code": "bad_request"}


def test_exit_codes_tell_usage_from_no_daemon(daemon: Daemon, tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    env = dict(daemon.env(), PROFD_RUNTIME_DIR=str(nowhere))

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "profctl"), *args], env=env, capture_output=True, text=True
        )

    r = ctl("ps")
    assert r.returncode == 3
    assert r.stderr == f"profctl: no profd daemon running (looked for {nowhere}/control.sock)\n"
    assert json.loads(ctl("ps", "--json").stdout)["code"] == "no_daemon"
    for usage in (("start", "--at-step", "x"), ("no-such-command",), ("show",)):
        r = ctl(*usage)
        assert r.returncode == 2 and "Usage: profctl" in r.stderr, (usage, r.stderr)
    assert daemon.ctl("start", "--steps", "1:2").returncode == 1  # refused: no process


def test_a_session_is_found_by_any_unique_part_of_its_id(two_ranks: Daemon) -> None:
    d = two_ranks
    a = d.ctl_json("start", "--steps", far())["session"]
    b = d.ctl_json("start", "--ranks", "1", "--steps", far())["session"]
    tail = a.rsplit("-", 1)[1]  # the random part a user copies
    assert d.ctl_json("show", tail)["id"] == a
    assert d.ctl_json("show", tail[1:5])["id"] == a
    common = a[: next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)]
    r = d.ctl("show", common)
    assert r.returncode == 1
    assert r.stderr == (
        f"profctl: session {common!r} is ambiguous: it is part of {max(a, b)}, {min(a, b)};"
        " give more of the id\n"
    )
    assert d.ctl("show", "no-such").stderr == "profctl: no session 'no-such'\n"
    r = d.ctl("cancel", tail)
    assert (r.returncode, r.stdout) == (0, f"session {a}: cancelling\n")
    wait_for(ended(d, a), 30, "the cancelled session to end")
    # Found in the index too, once the session has ended.
    assert d.ctl_json("show", tail)["state"] == "cancelled"


def test_attach_says_once_when_no_daemon_is_there(daemon: Daemon, tmp_path: Path) -> None:
    code = (
        "import logging, profd_client\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s %(message)s')\n"
        "profd_client.attach(step='manual')\n"
        "for _ in range(3): profd_client.step()\n"
        "profd_client.detach()\n"
    )
    nowhere = tmp_path / "nowhere"
    env = dict(daemon.env(), PROFD_RUNTIME_DIR=str(nowhere))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        f"profd_client INFO profd_client: no profd daemon in {nowhere}; training goes on, and"
        " this process attaches when one starts there (set PROFD_RUNTIME_DIR to the daemon's"
        " runtime dir)"
    ]
    r = subprocess.run(
        [sys.executable, "-c", code], env=daemon.env(), capture_output=True, text=True
    )
    assert r.returncode == 0 and "no profd daemon" not in r.stderr, r.stderr


def test_ps_is_idle_as_soon_as_wait_says_done(daemon_factory: Any, tmp_path: Path) -> None:
    # Heartbeats every 2 s: one sent while the rank was armed would be what ps shows for up
    # to 2 s after the session ended, had nothing been sent since.
    d = daemon_factory(config="[daemon]\nheartbeat_interval = 2.0\n")
    jobs = ranks_of(d, tmp_path, n=1)
    try:
        for _ in range(2):
            r = d.ctl("start", "--next", "--wait", "--timeout", "60")
            assert r.returncode == 0, r.stderr
            assert r.stdout.splitlines()[-1].endswith(": done")
            assert [x["state"] for x in d.ps()] == ["idle"]
    finally:
        for j in jobs:
            j.kill()
