"""A start within every per-field limit must not be able to stall the daemon.

``--next --repeat 1000 --active 10000`` was accepted: a 50 MB reply, a 129 MB ``session.json``,
``show`` broken for profctl, and a heartbeating client dropped while the loop was busy. The
session's total is bounded now, and the largest session allowed stays small everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from daemonproc import wait_for
from harness import JOBS, Daemon, Job
from rawpeer import pack, req

from profd import control_schema as C
from profd.scheduling.schedule import SESSION_STEPS
from profd_client import protocol as P


def spawn_lone(d: Daemon, log: Path, job: str) -> Job:
    """``tests/jobs/lone.py``: one real process, attached, stepping every 50 ms."""
    env = d.env()
    for name in [n for n in env if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        env.pop(name)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(PROFD_JOB=job, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return Job.spawn([sys.executable, str(JOBS / "lone.py")], env, log)


@pytest.fixture
def lone(daemon: Daemon, tmp_path: Path) -> Iterator[tuple[Job, dict[str, Any]]]:
    job = spawn_lone(daemon, tmp_path / "lone.log", "big")
    try:
        [row] = daemon.wait_attached(1, min_step=1)
        yield job, row
    finally:
        job.kill()


def raw_request(ctx: zmq.Context, d: Daemon, t: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    """The reply's size on the wire and the reply."""
    s = req(ctx, d)
    s.send(pack({"v": P.VERSION, "t": t, **fields}))
    assert s.poll(30_000), f"no reply to {t}"
    frame = s.recv_multipart()[-1]
    s.close()
    return len(frame), msgpack.unpackb(frame, raw=False)


def test_a_huge_schedule_is_refused_and_the_largest_stays_small(
    daemon: Daemon, lone: tuple[Job, dict[str, Any]], ctx: zmq.Context
) -> None:
    _, row = lone
    r = daemon.ctl("start", "--job", "big", "--next", "--repeat", "1000", "--active", "10000")
    assert r.returncode == 1, (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "--repeat 1000 x --active 10000" in err and f"at most {SESSION_STEPS}" in err, err

    # The largest session allowed: small on the wire, in show and in session.json.
    size, res = raw_request(
        ctx, daemon, C.C_START, spec={"job": "big", "next": True, "repeat": 10, "active": 1000}
    )
    assert res["t"] == "ok", res
    sid = res["data"]["session"]
    assert len(res["data"]["cycles"]) == 10 and size < 100_000, size
    size, show = raw_request(ctx, daemon, C.C_SHOW, session=sid)
    assert show["t"] == "ok" and len(show["data"]["steps"]) == SESSION_STEPS and size < 100_000
    assert daemon.ctl("show", sid).returncode == 0
    assert daemon.ctl("cancel", sid).returncode == 0
    manifest = daemon.spool / "big" / sid / "session.json"
    wait_for(manifest.exists, 30, "session.json")
    assert manifest.stat().st_size < 300_000, manifest.stat().st_size

    # The real process heartbeated throughout and was never dropped nor re-registered.
    [now] = daemon.ps()
    assert (now["pid"], now["attached_at"]) == (row["pid"], row["attached_at"]), (row, now)
    assert "missed heartbeats" not in daemon.log.read_text()


def test_a_reply_over_the_transport_limit_is_an_error() -> None:
    from profd.daemon.control.handler import bounded_reply

    small = C.encode(C.OK, data={"x": 1})
    assert bounded_reply(small, P.VERSION) is small
    big = C.encode(C.OK, data="x" * 5000)
    err = P.decode(bounded_reply(big, P.VERSION, limit=4096), C.REPLY_INBOUND, reply=True)
    assert err["t"] == P.ERROR and err["code"] == "too_large", err
    assert str(len(big)) in err["msg"] and "4096" in err["msg"], err
