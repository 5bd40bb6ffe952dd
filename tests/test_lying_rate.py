"""A peer's step rate is a claim: it cannot move another rank's ``--next`` plan.

A peer reporting 10^9 steps/s (the protocol's maximum) pushed its job's plan to step
1,102,155,150: the real rank stayed armed until it exited, and explicit starts on it were
refused as busy. Plans now use the rate the daemon observes, and one target's report cannot
make another wait beyond a bound: such a plan is refused with the reason.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonproc import wait_for
from harness import Daemon, Job
from lines import read_line
from rawpeer import HELLO, pack
from test_work_bounds import spawn_lone

from profd.scheduling.planner import MAX_NEXT_WAIT_STEPS
from profd_client import protocol as P

JOB = "liars"

#: A raw peer in a process of its own: hello, then a heartbeat every 0.1 s claiming ``sps``
#: at ``step``; it answers an arm with ``armed`` and then says nothing more about it.
_LIAR = """
import os, sys, time
import msgpack, zmq
hello, path = msgpack.unpackb(bytes.fromhex(sys.argv[1])), sys.argv[2]
step, sps = int(sys.argv[3]), float(sys.argv[4])
s = zmq.Context().socket(zmq.DEALER)
s.connect("ipc://" + path)
s.send(msgpack.packb({**hello, "pid": os.getpid()}))
beats = 0
while True:
    if s.poll(100):
        m = msgpack.unpackb(s.recv(), raw=False)
        if m["t"] == "arm":
            s.send(msgpack.packb({"v": 2, "t": "armed", "session": m["session"],
                                  "cycles": m["cycles"], "plan": m.get("plan", 0)}))
        continue
    s.send(msgpack.packb({"v": 2, "t": "hb", "step": step, "sps": sps, "state": "idle"}))
    beats += 1
    if beats == 5:
        print("lying", flush=True)
"""


def spawn_liar(d: Daemon, rank: int, step: int, sps: float) -> subprocess.Popen[str]:
    hello = {**HELLO, "v": 2, "job": JOB, "role": "liar", "rank": rank, "world_size": 3}
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _LIAR,
            pack(hello).hex(),
            str(d.runtime_dir / "agent.sock"),
            str(step),
            str(sps),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert read_line(p, 120).strip() == "lying"
    return p


@pytest.fixture
def real(daemon: Daemon, tmp_path: Path) -> Iterator[Job]:
    job = spawn_lone(daemon, tmp_path / "lone.log", JOB)
    try:
        yield job
    finally:
        job.kill()


def real_row(d: Daemon, job: Job) -> dict[str, Any]:
    [row] = [r for r in d.ps() if r["pid"] == job.proc.pid]
    return row


def test_a_lying_rate_moves_no_other_ranks_plan(daemon: Daemon, real: Job) -> None:
    wait_for(
        lambda: any(r["pid"] == real.proc.pid for r in daemon.polled_ps()), 60, "the real rank"
    )
    liars = [spawn_liar(daemon, 1, 0, P.MAX_RATE)]
    try:
        step = real_row(daemon, real)["step"]
        res = daemon.ctl_json("start", "--job", JOB, "--next")
        assert len(res["targets"]) == 2, res
        first = res["cycles"][0][1]
        # 20 steps/s and a second of lead: within a few hundred steps of where it is.
        assert step < first < step + 500, (step, res["cycles"])

        def real_target() -> dict[str, Any]:
            [t] = [
                t
                for t in daemon.ctl_json("show", res["session"])["targets"]
                if t["pid"] == real.proc.pid
            ]
            return t

        t = wait_for(lambda: (lambda t: t if t["state"] == "done" else None)(real_target()), 60,
                     "the real rank's capture")  # fmt: skip
        assert t["traces"] == 1, t

        # A peer that reports a step a billion ahead: a --next plan with it is refused,
        # naming both, and nothing is armed.
        liars.append(spawn_liar(daemon, 2, 10**9, P.MAX_RATE))
        r = daemon.ctl("start", "--job", JOB, "--next")
        assert r.returncode == 1, (r.stdout, r.stderr)
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and "liar rank 2" in err, err
        assert f"more than {MAX_NEXT_WAIT_STEPS} steps" in err, err

        # The real rank is free for an explicit start: not armed for steps it never reaches.
        step = real_row(daemon, real)["step"]
        ok = daemon.ctl_json("start", "--pid", str(real.proc.pid), "--steps", f"{step + 40}")
        assert ok["steps"] == [step + 40], ok
    finally:
        for p in liars:
            p.kill()
            p.wait()
