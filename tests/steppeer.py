"""A raw agent peer that steps, in a process of its own (the daemon believes only kernel pids),
steered by a file: for tests of what the daemon does when a rank stops stepping, comes back
after a daemon restart, or names itself with hostile text.

The peer says hello, then every 0.2 s sends a heartbeat with the steps that fit in the time
since the last one (``step_s`` each), unless its control file says ``stop``: then its step
stays where it is and its heartbeats go on, as a rank stuck in a collective whose agent
thread still runs; ``spike S``: its next ledger holds one more step, of ``S`` seconds (a
stall the rank came out of), and it writes ``step`` back to the file once sent; ``bye``: it
detaches (``bye``) and exits. After a daemon restart (``unknown_client``) it says hello
again, at the step it is at. From protocol 3 its heartbeats carry a step ledger with
``regions``.

On an ``arm``, by ``on_arm``:

* ``capture``: once its step passes the cycle, it reports a small trace of it (capturing,
  captured, done), as a client that captured;
* ``stall``: it acks the arm and stops stepping for good (a rank stuck just before the
  sample's steps);
* ``ignore``: nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness import Daemon
from lines import read_line
from rawpeer import HELLO

_PEER = r"""
import bisect, json, os, sys, time
from pathlib import Path
import msgpack, zmq
from profd_client.protocol import STEP_BUCKETS
cfg = json.loads(sys.argv[1])
hello, v, step_s = cfg["hello"], cfg["hello"]["v"], cfg["step_s"]
control, on_arm, regions = Path(cfg["control"]), cfg["on_arm"], cfg["regions"]
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect("ipc://" + cfg["socket"])
ids = iter(range(1, 1 << 30))
step, last, stalled, pending, seen = 0, time.monotonic(), False, [], set()

def send(t, **f):
    s.send(msgpack.packb({"v": v, "t": t, **f}))

def say_hello():
    s.send(msgpack.packb({**hello, "pid": os.getpid(), "step": step}))

def report(arm):
    sid, (w, a, b) = arm["session"], arm["cycles"][0]
    raw = Path(arm["incoming"]) / "c0" / f"{hello['role']}-r{hello['rank']}.pt.trace.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text('{"traceEvents": [{"name": "op", "ph": "X", "ts": 1, "dur": 1}]}')
    send("progress", id=next(ids), session=sid, state="capturing", step=a)
    send("captured", id=next(ids), session=sid, job=hello["job"], cycle=0,
         steps=list(range(a, b)), files=[{"kind": "trace", "path": str(raw)}],
         started_at=1.0, ended_at=2.0, stall_ms=1.0)
    send("progress", id=next(ids), session=sid, state="done", step=b)

say_hello()
print("started", flush=True)
while True:
    while s.poll(0):
        m = msgpack.unpackb(s.recv(), raw=False)
        if m["t"] == "error" and m.get("code") == "unknown_client":
            say_hello()
        elif m["t"] == "arm" and on_arm == "capture":
            # Acked, and taken once: the daemon sends an arm again until it is acked.
            send("armed", session=m["session"], cycles=m["cycles"])
            if m["session"] not in seen:
                seen.add(m["session"])
                pending.append(m)
        elif m["t"] == "arm" and on_arm == "stall":
            send("armed", session=m["session"], cycles=m["cycles"])
            stalled = True
    time.sleep(0.2)
    now = time.monotonic()
    n = max(1, round((now - last) / step_s))
    word = control.read_text().split() if control.exists() else []
    if word == ["bye"]:
        send("bye")
        s.setsockopt(zmq.LINGER, 5000)  # delivered before the process goes
        s.close()
        break
    stopped = stalled or word == ["stop"]
    hb = {"step": step, "state": "idle"}
    if not stopped:
        ds = [step_s] * n + ([float(word[1])] if word[:1] == ["spike"] else [])
        step += len(ds)
        hb = {"step": step, "sps": n / (now - last), "state": "idle"}
        if v >= 3:
            total, srt = sum(ds), sorted(ds)
            b = [0] * (len(STEP_BUCKETS) + 1)
            for d in ds:
                b[bisect.bisect_left(STEP_BUCKETS, d)] += 1
            q = [srt[min(len(srt) - 1, int(x * len(srt)))] for x in (0.5, 0.9, 0.99)]
            hb["ledger"] = {"at": step, "n": len(ds), "sum": total, "q": [*q, srt[-1]],
                            "b": b, "epoch": 0, "r": [[r, total / 4, len(ds)] for r in regions]}
    last = now
    send("hb", **hb)
    if word[:1] == ["spike"]:
        control.write_text("step")
    for arm in [a for a in pending if step >= a["cycles"][0][2]]:
        pending.remove(arm)
        report(arm)
"""


class StepPeer:
    """One stepping peer (see the module docstring); :meth:`stop` makes it stop stepping,
    :meth:`go` step again."""

    def __init__(self, proc: subprocess.Popen[str], control: Path) -> None:
        self.proc = proc
        self.control = control

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.control.write_text("stop")

    def go(self) -> None:
        self.control.write_text("step")

    def spike(self, seconds: float) -> None:
        """One step of ``seconds`` in the next ledger (protocol 3)."""
        self.control.write_text(f"spike {seconds}")

    def spiked(self) -> bool:
        """Whether the ledger with the spike was sent."""
        return self.control.read_text().strip() == "step"

    def bye(self, timeout: float = 15.0) -> None:
        """Detach as a client does at exit (the daemon closes the rank's minute at once)."""
        self.control.write_text("bye")
        self.proc.wait(timeout)


@contextmanager
def step_peers(tmp: Path) -> Iterator[Any]:
    """``spawn(daemon, job, rank, step_s=0.02, on_arm="ignore", v=1, regions=(), **hello)``:
    a :class:`StepPeer`, started; every one is killed on exit."""
    made: list[StepPeer] = []

    def spawn(
        d: Daemon,
        job: str,
        rank: int = 0,
        step_s: float = 0.02,
        on_arm: str = "ignore",
        v: int = 1,
        regions: tuple[str, ...] = (),
        **fields: Any,
    ) -> StepPeer:
        control = tmp / f"peer-{len(made)}.control"
        hello = {**HELLO, "v": v, "job": job, "role": "r", "rank": rank, "local_rank": rank,
                 "world_size": 2, **fields}  # fmt: skip
        cfg = {
            "hello": hello,
            "socket": str(d.runtime_dir / "agent.sock"),
            "step_s": step_s,
            "control": str(control),
            "on_arm": on_arm,
            "regions": list(regions),
        }
        p = subprocess.Popen(
            [sys.executable, "-c", _PEER, json.dumps(cfg)], stdout=subprocess.PIPE, text=True
        )
        peer = StepPeer(p, control)
        made.append(peer)
        assert read_line(p, 120).strip() == "started"
        return peer

    try:
        yield spawn
    finally:
        for peer in made:
            peer.proc.kill()
            peer.proc.wait()


__all__ = ["StepPeer", "step_peers"]
