"""Pipeline workers that die, against a real daemon.

A worker killed by the OOM killer (SIGKILL here) is replaced and the capture it was running
is run once more; a second death fails that capture with the reason and keeps its raw trace
for the next daemon start. Workers die with a SIGKILLed daemon, and multiprocessing's
resource tracker follows them.

Nothing here depends on how fast the machine is: a big trace keeps a worker busy for a second
or more, and every wait is on something the daemon reports, with a generous hang guard.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from daemonproc import wait_for
from harness import Daemon, Job
from rawpeer import TracePeer, big_trace, small_trace

from profd.states import TERMINAL

WAIT = 120.0
DIED_TWICE = "pipeline worker died twice (killed by signal 9?)"


# --- helpers -------------------------------------------------------------------------------------
def children(d: Daemon) -> list[psutil.Process]:
    assert d.proc is not None
    return psutil.Process(d.proc.pid).children()


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def workers(d: Daemon) -> list[psutil.Process]:
    """The daemon's live pipeline workers (multiprocessing spawn children)."""
    return [p for p in children(d) if "multiprocessing.spawn" in cmdline(p) and alive(p)]


def pipeline(d: Daemon) -> dict[str, Any]:
    st: dict[str, Any] = d.ctl_json("status")["pipeline"]
    return st


def restarts(d: Daemon) -> int:
    n: int = pipeline(d).get("restarts", 0)
    return n


def kill(p: psutil.Process) -> None:
    p.send_signal(signal.SIGKILL)
    wait_for(lambda: not alive(p), 30, f"pipeline worker {p.pid} to die")


def wait_end(d: Daemon, sid: str) -> dict[str, Any]:
    s: dict[str, Any] = wait_for(
        lambda: (lambda s: s if s["state"] in TERMINAL else None)(d.ctl_json("show", sid)),
        WAIT,
        f"session {sid} to end",
        every=0.2,
    )
    return s


@pytest.fixture
def peer_of(daemon: Daemon, ctx: zmq.Context) -> Iterator[Callable[[str], TracePeer]]:
    made: list[TracePeer] = []

    def make(job: str) -> TracePeer:
        made.append(TracePeer(ctx, daemon, job))
        return made[-1]

    yield make
    for p in made:
        p.sock.close(0)


# --- tests ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_killed_idle_worker_is_replaced_and_the_next_capture_is_done(
    daemon: Daemon, torchrun: Callable[..., Job]
) -> None:
    torchrun("train.py", nproc=2, daemon=daemon, STEPS="1000000", STEP_SLEEP="0.05")
    daemon.wait_attached(2, timeout=WAIT, min_step=1)
    # --next leads by the ranks' step rates: wait for them (see test_captures' shared job).
    wait_for(
        lambda: all(r["steps_per_s"] > 0 for r in daemon.polled_ps()), WAIT, "step rates", every=0.2
    )

    def capture() -> dict[str, Any]:
        r = daemon.ctl(
            "start", "--next", "--wait", "--timeout", str(WAIT), "--json", timeout=WAIT + 30
        )
        assert r.stdout, r.stderr
        res: dict[str, Any] = json.loads(r.stdout)
        return res

    first = capture()
    assert first["state"] == "done", first
    victim = wait_for(lambda: workers(daemon), 30, "idle pipeline workers")[0]
    kill(victim)

    second = capture()
    # The code before: the pool was broken for good, the capture "pipeline unavailable".
    assert second["state"] == "done", second
    rows = daemon.ctl_json("traces", "--session", second["session"])
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert all(Path(r["path"]).is_file() for r in rows), rows
    st = pipeline(daemon)
    assert st["restarts"] >= 1, st
    death = st["last_worker_death"]
    assert death["pid"] == victim.pid and death["signal"] == 9, st


def test_worker_killed_while_processing_is_retried_once(
    daemon: Daemon, peer_of: Callable[[str], TracePeer]
) -> None:
    sid, raw = peer_of("big").capture(big_trace)
    victim = wait_for(lambda: workers(daemon), WAIT, "the worker processing the capture")[0]
    kill(victim)
    s = wait_end(daemon, sid)
    # The code before: failed with "pipeline error: BrokenProcessPool ...".
    assert s["state"] == "done", s
    [row] = daemon.ctl_json("traces", "--session", sid)
    assert Path(row["path"]).is_file() and not raw.exists()
    st = pipeline(daemon)
    assert st["restarts"] == 1, st
    death = st["last_worker_death"]
    assert death["pid"] == victim.pid and death["signal"] == 9, st
    assert death["capture"].startswith(f"{sid}/"), st


def test_worker_killed_twice_fails_the_capture_keeps_the_raw_trace_and_the_daemon_serves_on(
    daemon: Daemon, peer_of: Callable[[str], TracePeer]
) -> None:
    peer = peer_of("big")
    sid, raw = peer.capture(big_trace)
    for n in (1, 2):
        victim = wait_for(lambda: workers(daemon), WAIT, f"worker {n} processing the capture")[0]
        kill(victim)
        # The code before: no "restarts" in status, so this times out on the first kill.
        wait_for(lambda n=n: restarts(daemon) >= n, WAIT, f"the pipeline to count {n} restarts")
    s = wait_end(daemon, sid)
    assert s["state"] == "failed", s
    [t] = s["targets"]
    assert (t["state"], t["error"]) == ("failed", DIED_TWICE), t
    assert raw.is_file(), "the raw trace must stay until a result is indexed"
    assert daemon.ctl_json("traces", "--session", sid) == []
    assert pipeline(daemon)["last_worker_death"]["capture"].startswith(f"{sid}/")

    # The daemon serves on: a new capture goes through new workers.
    sid2, _ = peer.capture(small_trace)
    assert wait_end(daemon, sid2)["state"] == "done"
    assert len(daemon.ctl_json("traces", "--session", sid2)) == 1

    # The failed capture's inbox row stayed open: the next daemon start indexes it.
    daemon.stop()
    daemon.start()
    [row] = wait_for(
        lambda: daemon.ctl_json("traces", "--session", sid), WAIT, "the retried capture"
    )
    assert Path(row["path"]).is_file() and not raw.exists()


def test_workers_and_resource_tracker_die_with_a_sigkilled_daemon(
    daemon: Daemon, peer_of: Callable[[str], TracePeer]
) -> None:
    peer = peer_of("big")
    sid, _ = peer.capture(small_trace)
    assert wait_end(daemon, sid)["state"] == "done"
    peer.capture(big_trace)  # one worker busy when the daemon dies
    wait_for(lambda: workers(daemon), WAIT, "a pipeline worker")
    kids = children(daemon)
    names = [cmdline(p) for p in kids]
    # What there is to outlive the daemon: workers, and the tracker of their semaphores.
    assert any("multiprocessing.spawn" in n for n in names), names
    assert any("multiprocessing.resource_tracker" in n for n in names), names
    daemon.kill9()
    try:
        # The code before: workers and tracker ran on forever, so this timed out.
        wait_for(
            lambda: not [p for p in kids if alive(p)],
            60,
            "every child of the SIGKILLed daemon to exit",
        )
    finally:
        for p in kids:
            if alive(p):
                p.kill()


def test_status_text_still_shows_the_pipeline(daemon: Daemon) -> None:
    r = daemon.ctl("status")
    assert r.returncode == 0 and "pipeline 0 in flight" in r.stdout, r.stdout + r.stderr
    st = pipeline(daemon)
    assert (st["in_flight"], st["restarts"], st["last_worker_death"]) == (0, 0, None), st


def temp_files(spool: Path) -> list[Path]:
    """The pipeline's and atomic_write's temporaries (``.{name}.tmp-XXXX``) in the sessions'
    directories (not in ``.incoming``, which is the clients')."""
    return [
        Path(root, name)
        for root, _, files in os.walk(spool)
        if ".incoming" not in Path(root).relative_to(spool).parts
        for name in files
        if name.startswith(".") and ".tmp-" in name and not Path(root, name).is_symlink()
    ]


def test_temp_files_of_a_daemon_killed_while_processing_are_removed_at_start(
    daemon: Daemon, peer_of: Callable[[str], TracePeer], tmp_path: Path
) -> None:
    sid, raw = peer_of("big").capture(big_trace)
    cycle = daemon.spool / "big" / sid / "c0"
    wait_for(lambda: temp_files(cycle) if cycle.is_dir() else [], WAIT, "a temp file", every=0.01)
    daemon.kill9()  # its worker dies with it (PR_SET_PDEATHSIG), in the middle of its write
    left = temp_files(daemon.spool)
    # The code before: these stayed in the final directory for good (HTA skips dotfiles, but
    # they cost space and are uploaded by nobody).
    assert left, "the worker finished before the daemon was killed: nothing to test"
    # A link named like a temp file, and a session directory that is a link: never followed.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / ".r-r0.tmp-abcd1234"
    victim.write_text("not the daemon's")
    link = cycle / ".x.tmp-zzzzzzzz"
    link.symlink_to(victim)
    (daemon.spool / "big" / "linked-session").symlink_to(elsewhere, target_is_directory=True)

    daemon.start()
    assert wait_end(daemon, sid)["state"] == "done"
    assert temp_files(daemon.spool) == []
    assert victim.read_text() == "not the daemon's" and link.is_symlink()
    assert (daemon.spool / "big" / "linked-session").is_symlink()
    assert daemon.ctl_json("status")["storage"]["temp_files_removed"] == len(left)
    assert f"{len(left)} temporary file" in daemon.ctl("status").stdout
    [row] = daemon.ctl_json("traces", "--session", sid)
    assert Path(row["path"]).is_file() and not raw.exists()
