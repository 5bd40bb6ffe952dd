"""A raw ZeroMQ peer of the daemon: hand-made msgpack frames, no profd_client in between.

For tests that must send exactly what a real client would not (bad frames, stale reports).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import msgpack
import zmq
from harness import Daemon

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
