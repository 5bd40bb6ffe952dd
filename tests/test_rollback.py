"""A daemon rolled back to one that serves protocol version 1 only.

A running version-2 client kept sending version-2 heartbeats, which the older daemon refused
with a ``version`` error; the client ignored that error once welcomed, so it stayed listed as
incompatible with job "?" and logged nothing. It must step down (from the version it speaks
now, through every older one the daemon refuses), say so once, and be served.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import msgpack
import zmq
from harness import JOBS, Job
from rawpeer import agent_double, pack

from profd_client import protocol as P


def test_a_client_steps_down_when_the_daemon_is_rolled_back(tmp_path: Path) -> None:
    ctx = zmq.Context()
    daemon, env = agent_double(ctx, tmp_path, 0.1, PROFD_JOB="rolled")
    job = Job.spawn([sys.executable, str(JOBS / "lone.py")], env, tmp_path / "lone.log")
    welcome = {"spool": str(tmp_path / "spool"), "hb_interval": 0.1, "daemon": "fake"}
    served: list[int] = []  # versions of the hellos welcomed
    refused = 0
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(served) < 2:
            if not daemon.poll(200):
                continue
            ident, frame = daemon.recv_multipart()
            m = msgpack.unpackb(frame, raw=False)
            if not served:
                # The daemon before the rollback: the client's own version.
                if m["t"] == "hello" and m["v"] == P.VERSION:
                    w = {"v": P.VERSION, "t": "welcome", **welcome, "protocol": [1, P.VERSION]}
                    daemon.send_multipart([ident, pack(w)])
                    served.append(P.VERSION)
                continue
            # After it: version 1 only, refusing anything else in the peer's version.
            if m["v"] != 1:
                refused += 1
                daemon.send_multipart(
                    [
                        ident,
                        pack(
                            {
                                "v": m["v"],
                                "t": "error",
                                "code": "version",
                                "msg": f"unsupported protocol version {m['v']}: this side"
                                " speaks 1..1",
                            }
                        ),
                    ]
                )
            elif m["t"] == "hb":
                daemon.send_multipart([ident, pack({"v": 1, "t": "hb"})])
            elif m["t"] == "hello":
                assert m["job"] == "rolled", m
                daemon.send_multipart([ident, pack({"v": 1, "t": "welcome", **welcome})])
                served.append(1)
        assert served == [P.VERSION, 1], (served, refused, job.output())
        # Served in version 1 now: its heartbeats are version 1 and refused no more.
        beats, until = 0, time.monotonic() + 1.5
        while time.monotonic() < until:
            if not daemon.poll(200):
                continue
            ident, frame = daemon.recv_multipart()
            m = msgpack.unpackb(frame, raw=False)
            assert m["v"] == 1, m
            beats += m["t"] == "hb"
            daemon.send_multipart([ident, pack({"v": 1, "t": "hb"})])
        assert beats >= 3, beats
    finally:
        job.kill()
        daemon.close()
        ctx.term()
    lines = [ln for ln in job.output().splitlines() if "protocol version" in ln]
    assert len(lines) == 1 and "version 1" in lines[0], job.output()
