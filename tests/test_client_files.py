"""The daemon never follows a path a client controls and believes only the
kernel about who a peer is.

Each capture below is reported by a raw peer whose own incoming directory holds something
other than the trace a client writes: a symlinked cycle dir (the swap that made the wave-1
pipeline delete one root-only file and upload another), a symlinked trace, a FIFO (which
blocked both pipeline workers forever), a directory (replayed on every start) and a sparse
file far over the size limit (read into 7 GiB of RSS). Every one fails its session with the
reason, touches nothing outside, and the daemon serves the next capture.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from daemonproc import wait_for
from harness import Daemon
from rawpeer import HELLO, dealer, pack, recv, reply, spawn_peer

from profd.states import TERMINAL

SECRET = "root-only secret\n"


class Peer:
    def __init__(self, ctx: zmq.Context, d: Daemon, job: str) -> None:
        self.d, self.job = d, job
        self.sock = dealer(ctx, d, "agent.sock")
        self.ids = iter(range(1, 1 << 30))
        self.sock.send(pack({**HELLO, "job": job}))
        recv(self.sock, "welcome")

    def send(self, t: str, **fields: Any) -> None:
        self.sock.send(pack({"v": 1, "t": t, "id": next(self.ids), **fields}))
        recv(self.sock, "ack")

    def capture(self, plant: Callable[[Path], None]) -> dict[str, Any]:
        """A session on this peer's job whose cycle-0 trace path gets ``plant``ed; its end."""
        sid = self.d.ctl_json("start", "--job", self.job, "--next")["session"]
        arm = recv(self.sock, "arm")
        trace = Path(arm["incoming"]) / "c0" / "r-r0.pt.trace.json"
        plant(trace)
        self.send("progress", session=sid, state="capturing", step=1)
        self.send("captured", session=sid, job=self.job, cycle=0, steps=[1],
                  files=[{"kind": "trace", "path": str(trace)}],
                  started_at=1.0, ended_at=2.0, stall_ms=1.0)  # fmt: skip
        self.send("progress", session=sid, state="done", step=2)
        s: dict[str, Any] = wait_for(
            lambda: (lambda s: s if s["state"] in TERMINAL else None)(self.d.ctl_json("show", sid)),
            60,
            f"session {sid} to end",
        )
        return s


def _error(s: dict[str, Any]) -> str:
    [t] = s["targets"]
    return str(t["error"])


def test_client_paths_are_never_followed(
    daemon_factory: Callable[..., Daemon], ctx: zmq.Context, tmp_path: Path
) -> None:
    d = daemon_factory(config='[daemon]\nmax_trace_bytes = "1MB"\n')
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "r-r0.pt.trace.json"
    secret.write_text(SECRET)
    secret.chmod(0o600)

    def dir_link(trace: Path) -> None:  # the cycle dir is a link to a root-only dir
        trace.parent.parent.mkdir(parents=True, exist_ok=True)
        trace.parent.symlink_to(outside)

    def file_link(trace: Path) -> None:
        trace.parent.mkdir(parents=True)
        trace.symlink_to(secret)

    def fifo(trace: Path) -> None:
        trace.parent.mkdir(parents=True)
        os.mkfifo(trace)

    def directory(trace: Path) -> None:
        trace.mkdir(parents=True)

    def sparse(trace: Path) -> None:
        trace.parent.mkdir(parents=True)
        with trace.open("wb") as fh:
            fh.truncate(3 << 30)

    expect = {
        dir_link: "is not a directory (a symbolic link?)",
        file_link: "is a symbolic link",
        fifo: "is not a regular file",
        directory: "is not a regular file",
        sparse: "over the 1048576-byte limit",
    }
    for n, (plant, why) in enumerate(expect.items()):
        s = Peer(ctx, d, f"job{n}").capture(plant)
        # The code before: the secret was moved into the spool (and deleted from here), the
        # FIFO blocked the worker (the session never ended), the sparse file was read whole.
        assert s["state"] == "failed" and why in _error(s), (plant.__name__, s)
        assert secret.read_text() == SECRET, plant.__name__
    assert sorted(p.name for p in outside.iterdir()) == [secret.name]
    spooled = [
        p
        for p in d.spool.rglob("*")
        if p.is_file() and p.name != "session.json" and ".incoming" not in p.parts
    ]
    assert spooled == [], spooled

    # The daemon serves on; a good capture goes through.
    ok = Peer(ctx, d, "good").capture(
        lambda t: (t.parent.mkdir(parents=True), t.write_text('{"traceEvents": []}'))
    )
    assert ok["state"] == "done", ok
    # Nothing bad is replayed on the next start: every refused report was closed.
    d.stop()
    d.start()
    wait_for(lambda: d.ctl_json("status")["pipeline"]["in_flight"] == 0, 10, "an idle pipeline")
    assert "is not a regular file" not in d.log.read_text().split("listening on")[-1]


def test_a_hello_claiming_another_pid_is_refused(daemon: Daemon, ctx: zmq.Context) -> None:
    d = daemon
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        s = dealer(ctx, d, "agent.sock")
        s.send(pack({**HELLO, "pid": other.pid, "job": "impostor"}))
        err = recv(s, "error")
        # The code before: welcomed, and armed in that process's place.
        assert err["code"] == "identity", err
        assert (
            f"claims pid {other.pid} but the connection belongs to pid {os.getpid()}"
            in (err["msg"])
        )
        assert [r for r in d.ps() if r["job"] == "impostor"] == []
    finally:
        other.kill()
        other.wait()


def test_a_routing_id_taken_over_is_not_the_client(daemon: Daemon, ctx: zmq.Context) -> None:
    d = daemon
    # A real process attaches under a routing id of its own choosing, then dies ...
    victim = spawn_peer(d, "victim", routing_id="victim-id")
    wait_for(lambda: [r for r in d.polled_ps() if r["job"] == "victim"], 15, "the victim attached")
    victim.kill()
    victim.wait()

    # ... and another process connects under the same id before the daemon dropped it.
    # libzmq's ROUTER ignores a connection whose id is still held by one it has not yet
    # seen close (a loaded machine): connect again until this one is heard.
    def answer() -> dict[str, Any] | None:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"victim-id")
        s.connect(f"ipc://{d.runtime_dir / 'agent.sock'}")
        try:
            s.send(pack({"v": 1, "t": "bye"}))
            return reply(s, 2000)
        finally:
            s.close(0)

    got = wait_for(answer, 30, "an answer to the new connection", every=0)
    # The code before: accepted as the victim (it could report, ack arms, or detach it).
    assert got["t"] == "error" and got["code"] == "unknown_client", got
