"""A full disk under the spool or the state dir, on real tmpfs mounts.

Each place a write can fail says "disk full", leaves nothing half written, keeps the index
and ``session.json`` consistent, shows in ``profctl status``, and recovers by itself when
space comes back. The mounts need root (CI runs as root); elsewhere these tests skip with
that reason.
"""

from __future__ import annotations

import errno
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemonproc import wait_for
from harness import Daemon, Job
from rawpeer import TracePeer, small_trace

from profd.states import TERMINAL

WAIT = 90.0


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, int], Path]]:
    """``tmpfs(name, mib)``: a fresh tmpfs of that size under ``tmp_path``."""
    mounted: list[Path] = []

    def mount(name: str, mib: int) -> Path:
        p = tmp_path / name
        p.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", str(p)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to fill (needs root): {r.stderr.strip()}")
        mounted.append(p)
        return p

    yield mount
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


def fill(fs: Path) -> Path:
    """Take every free byte of ``fs`` with one file (remove it to give the space back)."""
    filler = fs / "filler"
    with filler.open("wb", buffering=0) as fh:
        for chunk in (1 << 20, 4096, 1):
            try:
                while fh.write(b"\0" * chunk):
                    pass
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return filler


def status(d: Daemon) -> dict[str, Any]:
    st: dict[str, Any] = d.ctl_json("status")
    return st


def show(d: Daemon, sid: str) -> dict[str, Any]:
    s: dict[str, Any] = d.ctl_json("show", sid)
    return s


def ended(d: Daemon, sid: str) -> dict[str, Any] | None:
    s = show(d, sid)
    return s if s["state"] in TERMINAL else None


def files_under(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()] if d.exists() else []


@pytest.fixture
def peer(ctx: zmq.Context) -> Iterator[Callable[[Daemon], TracePeer]]:
    made: list[TracePeer] = []

    def make(d: Daemon) -> TracePeer:
        made.append(TracePeer(ctx, d, "diskjob"))
        return made[-1]

    yield make
    for p in made:
        p.sock.close(0)


def test_full_spool_parks_the_pipeline_and_session_json_until_space_returns(
    tmpfs: Callable[[str, int], Path],
    daemon_factory: Callable[..., Daemon],
    peer: Callable[[Daemon], TracePeer],
) -> None:
    fs = tmpfs("spoolfs", 20)
    spool = fs / "spool"
    d = daemon_factory(PROFD_SPOOL_DIR=str(spool))
    p = peer(d)
    filler: list[Path] = []

    def write_then_fill(path: Path) -> Path:
        small_trace(path)
        filler.append(fill(fs))
        return path

    # The raw trace fits; the outputs do not.
    sid, raw = p.capture(write_then_fill)
    st = wait_for(
        lambda: (lambda st: st if st["pipeline"]["waiting_for_space"] == 1 else None)(status(d)),
        WAIT,
        "the capture to wait for space",
    )
    problem = st["storage"]["problems"]["spool"]
    # The code before: "pipeline error: OSError: [Errno 28] ..." and a failed target.
    assert problem["error"].startswith(f"disk full in {spool}"), problem
    assert st["storage"]["free_bytes"]["spool"] < 1 << 20, st["storage"]
    assert "SPOOL NOT WRITABLE" in d.ctl("status").stdout
    [t] = show(d, sid)["targets"]
    assert t["state"] == "processing", t
    # Nothing half written in the spool: no temp files beside the outputs, raw still there.
    assert raw.is_file()
    assert not [f for f in files_under(spool / "diskjob") if ".tmp" in f.name]

    filler[0].unlink()
    s = wait_for(lambda: ended(d, sid), WAIT, "the session to end once space is back")
    assert s["state"] == "done", s
    [row] = d.ctl_json("traces", "--session", sid)
    assert Path(row["path"]).is_file() and not raw.exists()
    manifest = json.loads((spool / "diskjob" / sid / "session.json").read_text())
    assert manifest["targets"][0]["results"][0]["path"] == str(Path(row["path"]).relative_to(spool))
    assert status(d)["storage"]["problems"] == {}

    # A session that ends while the disk is full owes its session.json, and writes it later.
    p.hello()
    sid2 = d.ctl_json("start", "--job", "diskjob", "--next")["session"]
    p.recv("arm")
    filler[0] = fill(fs)
    p.send("progress", session=sid2, state="cancelled", step=1)
    wait_for(lambda: ended(d, sid2), WAIT, "the cancelled session to end")
    st = wait_for(
        lambda: (lambda st: st if st["storage"]["manifests_waiting"] == 1 else None)(status(d)),
        WAIT,
        "the session.json to wait for space",
    )
    assert st["storage"]["problems"]["spool"]["error"].startswith("disk full"), st
    filler[0].unlink()
    manifest2 = wait_for(
        lambda: (spool / "diskjob" / sid2 / "session.json").is_file(),
        WAIT,
        "the owed session.json",
    )
    assert manifest2
    wait_for(
        lambda: status(d)["storage"]["manifests_waiting"] == 0, WAIT, "the manifest to be indexed"
    )


def test_full_state_dir_defers_the_report_unacked_until_space_returns(
    tmpfs: Callable[[str, int], Path],
    daemon_factory: Callable[..., Daemon],
    peer: Callable[[Daemon], TracePeer],
    tmp_path: Path,
) -> None:
    state = tmpfs("statefs", 20)
    d = daemon_factory(PROFD_STATE_DIR=str(state), PROFD_SPOOL_DIR=str(tmp_path / "spool"))
    p = peer(d)
    filler: list[Path] = []

    def write_then_fill(path: Path) -> Path:
        small_trace(path)
        filler.append(fill(state))
        return path

    sid, raw = p.capture(write_then_fill, wait=False)
    st = wait_for(
        lambda: (lambda st: st if st["storage"]["reports_waiting"] == 1 else None)(status(d)),
        WAIT,
        "the report to wait for space",
    )
    # The code before: the report was neither stored nor acked, and status said nothing.
    assert st["storage"]["problems"]["index"]["error"].startswith("disk full"), st
    [t] = show(d, sid)["targets"]
    assert t["state"] in ("capturing", "processing"), t
    assert "INDEX NOT WRITABLE" in d.ctl("status").stdout

    filler[0].unlink()
    p.recv("ack")  # the report, once it is durable
    s = wait_for(lambda: ended(d, sid), WAIT, "the session to end once space is back")
    assert s["state"] == "done", s
    [row] = d.ctl_json("traces", "--session", sid)
    assert Path(row["path"]).is_file() and not raw.exists()
    assert status(d)["storage"]["problems"] == {}


@pytest.mark.slow
def test_a_job_whose_trace_does_not_fit_fails_the_capture_as_disk_full_and_trains_on(
    tmpfs: Callable[[str, int], Path],
    daemon_factory: Callable[..., Daemon],
    torchrun: Callable[..., Job],
) -> None:
    fs = tmpfs("jobfs", 20)
    spool = fs / "spool"
    d = daemon_factory(PROFD_SPOOL_DIR=str(spool))
    job = torchrun("train.py", nproc=1, daemon=d, STEPS="1000000", STEP_SLEEP="0.05")
    d.wait_attached(1, timeout=WAIT, min_step=1)
    wait_for(
        lambda: all(r["steps_per_s"] > 0 for r in d.polled_ps()), WAIT, "step rates", every=0.2
    )
    filler = fill(fs)

    def capture() -> dict[str, Any]:
        r = d.ctl("start", "--next", "--wait", "--timeout", str(WAIT), "--json", timeout=WAIT + 30)
        assert r.stdout, r.stderr
        res: dict[str, Any] = json.loads(r.stdout)
        return res

    res = capture()
    assert res["state"] == "failed", res
    [t] = res["final"]["targets"]
    # The code before: "missing: ..." for a trace kineto never finished, its .tmp left behind.
    assert "disk full" in t["error"], t
    assert files_under(spool / ".incoming") == []
    assert job.proc.poll() is None, "training stopped"

    filler.unlink()
    res = capture()
    assert res["state"] == "done", res
    assert job.proc.poll() is None
