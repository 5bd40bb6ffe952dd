"""A raw ZeroMQ peer of the daemon: hand-made msgpack frames, no profd_client in between.

For tests that must send exactly what a real client would not (bad frames, stale reports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import zmq
from harness import Daemon
from lines import read_line as read_line

from profd_client import protocol as P

HELLO = {
    "v": 1,
    "t": "hello",
    "pid": os.getpid(),
    "host": "hostile-test",
    "job": "j",
    "role": "r",
    "rank": 0,
    "local_rank": 0,
    "world_size": 1,
    "step": 0,
    "step_mode": "manual",
    "allowed": True,
    "client_version": "test",
}


def agent_double(
    ctx: zmq.Context, tmp_path: Path, heartbeat: float, **env: str
) -> tuple[zmq.Socket, dict[str, str]]:
    """A test double of the daemon's ``agent.sock``: a ROUTER bound in a fresh runtime dir
    under ``tmp_path``, and the environment a training process finds it with (no PROFD_,
    SLURM_ or torchelastic variables of the test's own; heartbeats every ``heartbeat`` s)."""
    rdir = tmp_path / "run"
    rdir.mkdir(mode=0o700)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{rdir / P.AGENT_SOCKET}")
    out = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PROFD_", "SLURM_", "TORCHELASTIC_"))
    }
    out.update(PROFD_RUNTIME_DIR=str(rdir), PROFD_HEARTBEAT=str(heartbeat), **env)
    return router, out


def from_client(
    router: zmq.Socket, proc: subprocess.Popen[Any], timeout: float, done: Callable[[], bool]
) -> Iterator[tuple[bytes, dict[str, Any], float]]:
    """What a training process sends a daemon double (``agent_double``): (routing id, the
    message, when it came, monotonic) until ``done()`` or ``timeout`` s; the process must
    stay alive meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done():
        assert proc.poll() is None, "the training process died"
        if not router.poll(100):
            continue
        ident, frame = router.recv_multipart()
        yield ident, msgpack.unpackb(frame, raw=False), time.monotonic()


def pack(m: object) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def dealer(ctx: zmq.Context, d: Daemon, name: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{d.runtime_dir / name}")
    return s


def req(ctx: zmq.Context, d: Daemon) -> zmq.Socket:
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{d.runtime_dir / 'control.sock'}")
    return s


def reply(s: zmq.Socket, timeout_ms: int = 3000) -> dict | None:
    if not s.poll(timeout_ms):
        return None
    return msgpack.unpackb(s.recv_multipart()[-1], raw=False)


def recv(s: zmq.Socket, t: str, timeout: float = 10.0) -> dict[str, Any]:
    """The next message of type ``t`` from the daemon (anything else, heartbeat replies
    included, is skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = reply(s, 500)
        if m is not None and m["t"] == t:
            return m
    raise AssertionError(f"no {t!r} from the daemon within {timeout}s")


_CHILD = """
import os, sys
import msgpack, zmq
hello, path = msgpack.unpackb(bytes.fromhex(sys.argv[1])), sys.argv[2]
s = zmq.Context().socket(zmq.DEALER)
if sys.argv[3]:
    s.setsockopt(zmq.ROUTING_ID, sys.argv[3].encode())
s.connect("ipc://" + path)
s.send(msgpack.packb({**hello, "pid": os.getpid()}))
while True:
    m = msgpack.unpackb(s.recv(), raw=False)
    if m["t"] == "arm":
        s.send(msgpack.packb({"v": hello["v"], "t": "progress", "id": 1,
                              "session": m["session"], "state": "capturing", "step": 1}))
        print("capturing", flush=True)
"""


def spawn_peer(d: Daemon, job: str, routing_id: str = "", **fields: Any) -> subprocess.Popen[bytes]:
    """A raw peer in a process of its own (the daemon believes only kernel pids): it says
    hello, and on an ``arm`` reports ``capturing`` and prints that line; then nothing."""
    hello = {**HELLO, "job": job, **fields}
    sock = str(d.runtime_dir / "agent.sock")
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, pack(hello).hex(), sock, routing_id],
        stdout=subprocess.PIPE,
    )


_MANY = """
import json, os, sys
import msgpack, zmq
hello = msgpack.unpackb(bytes.fromhex(sys.argv[1]), raw=False)
path, n = sys.argv[2], int(sys.argv[3])
ctx = zmq.Context()
def ask(s, m):
    s.send(msgpack.packb(m))
    if not s.poll(15000):
        return ["none", None, None]
    r = msgpack.unpackb(s.recv(), raw=False)
    return [r["t"], r.get("code"), r.get("msg")]
socks, out = [], []
for i in range(n):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect("ipc://" + path)
    socks.append(s)
    me = {**hello, "pid": os.getpid(), "host": f"{hello['host']}-{i}", "job": f"{hello['job']}-{i}",
          "role": f"role-{i}"}
    out.append(ask(s, me))
# The first again, on its own socket: saying hello again is no new peer.
out.append(ask(socks[0], {**hello, "pid": os.getpid(), "host": hello["host"] + "-0",
                          "job": hello["job"] + "-0", "role": "role-0"}))
print(json.dumps(out), flush=True)
sys.stdin.read()  # its peers stay attached (alive, so never dropped) until the test ends
"""


def _text_popen(args: list[str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(args, text=True, **kw)


def spawn_peers(
    d: Daemon, n: int, name: str, popen: Callable[..., subprocess.Popen[str]] = _text_popen
) -> tuple[subprocess.Popen[str], list[list[Any]]]:
    """One process that registers ``n`` peers, each on its own socket with its own host, job
    and role (``name-i``), then says hello again as the first: the process and the daemon's
    answer to each hello, ``[t, code, msg]`` (``n + 1`` of them). It stays until its stdin
    is closed. ``popen``: how to start it in text mode (e.g. ``User.popen``, as another
    user)."""
    hello = {**HELLO, "v": P.VERSION, "host": name, "job": name}
    sock = str(d.runtime_dir / "agent.sock")
    proc = popen(
        [sys.executable, "-c", _MANY, pack(hello).hex(), sock, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    line = read_line(proc, 120)
    assert line, f"the peers process {name} said nothing (exit {proc.poll()})"
    return proc, json.loads(line)


def big_trace(path: Path, events: int = 300_000) -> Path:
    """A valid ~40 MB kineto-like trace: a second or more of work for a worker."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pad = "x" * 40
    with path.open("w") as fh:
        fh.write('{"traceEvents": [')
        fh.write(
            ",".join(
                f'{{"name": "op{i % 500}", "ph": "X", "ts": {i}, "dur": 1, "pid": 1, "tid": 1,'
                f' "args": {{"pad": "{pad}"}}}}'
                for i in range(events)
            )
        )
        fh.write("]}")
    return path


class TracePeer:
    """A raw agent peer (rank 0 of role ``r`` in ``job``) that reports hand-made traces."""

    def __init__(self, ctx: zmq.Context, d: Daemon, job: str) -> None:
        self.d = d
        self.job = job
        self.sock = dealer(ctx, d, "agent.sock")
        self.ids = iter(range(1, 1 << 30))
        self.hello()

    def hello(self) -> None:
        """(Re-)register: it sends no heartbeats, so the daemon drops it after a few seconds."""
        self.sock.send(pack({**HELLO, "job": self.job, "host": f"node-of-{self.job}"}))
        self.recv("welcome")

    def recv(self, t: str) -> dict[str, Any]:
        while True:
            m = reply(self.sock, 10_000)
            assert m is not None, f"no {t!r} from the daemon"
            if m["t"] == t:
                return m

    def send(self, t: str, wait: bool = True, **fields: Any) -> None:
        """Send a report; unless ``wait`` is false, until the daemon acks it."""
        self.sock.send(pack({"v": P.VERSION, "t": t, "id": next(self.ids), **fields}))
        if wait:
            self.recv("ack")

    def capture(self, write: Callable[[Path], Path], wait: bool = True) -> tuple[str, Path]:
        """Start a ``--next`` session on this peer's job, report ``write(path)`` as cycle 0's
        trace; the session id and the raw trace. ``wait=False``: the report and the final
        progress are sent without waiting for acks (a daemon that cannot store them)."""
        sid = self.d.ctl_json("start", "--job", self.job, "--next")["session"]
        arm = self.recv("arm")
        assert arm["session"] == sid
        raw = write(Path(arm["incoming"]) / "c0" / "r-r0.pt.trace.json")
        self.send("progress", session=sid, state="capturing", step=1)
        self.send(
            "captured",
            wait,
            session=sid,
            job=self.job,
            cycle=0,
            steps=[1],
            files=[{"kind": "trace", "path": str(raw)}],
            started_at=1.0,
            ended_at=2.0,
            stall_ms=1.0,
        )
        self.send("progress", wait, session=sid, state="done", step=2)
        return sid, raw


def small_trace(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"traceEvents": [{"name": "op", "ph": "X", "ts": 1, "dur": 1}]}')
    return path
