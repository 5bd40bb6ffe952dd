"""The transport's own cost at N clients: the floor under the daemon's CPU.

A bare ZeroMQ ROUTER on a unix socket receives what N DEALER peers send (each its own
connection, as every training process is), one heartbeat-sized frame a second each, spread
over the second; it reads them as the daemon's loop does (frame by frame, the peer's
credentials asked of each message, the socket left to gather for 20 ms between reads) and
answers every third heartbeat of a peer, all answers once a second, as the daemon answers
``quiet`` clients. It does nothing else: no decoding, no registry, no ledger, no detectors.
What the daemon costs above this is profd's own work; this is what any daemon pays to hold
N connections of ZeroMQ at that rate on this machine (libzmq's I/O thread reading each
connection, and a wake-up of the socket for each message from a pipe that was empty).

    python bench/transport_floor.py [--clients 1024] [--window 30]

``bench_daemon.py`` runs it in the same run as the daemon, as the CPU target's baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


#: What the daemon's loop waits between two reads of agent.sock (``AGENT_LINGER_S``), and
#: how many of a ``quiet`` client's heartbeats it answers (one every ``QUIET_ACKS``): the
#: daemon's own settings, read from it (``PROFD_FLOOR_ANSWER_EVERY`` overrides the second,
#: 0: no answers, to see what they cost).
def _settings() -> tuple[float, int]:
    from profd.daemon.agent.attach import QUIET_ACKS
    from profd.daemon.loop import AGENT_LINGER_S

    every = os.environ.get("PROFD_FLOOR_ANSWER_EVERY")
    return AGENT_LINGER_S, QUIET_ACKS if every is None else int(every)


def heartbeat_frame() -> bytes:
    """A heartbeat as a simulated client of ``bench_daemon`` sends it: 10 steps a second,
    no regions."""
    from profd_client import protocol as P

    ledger = {
        "at": 1000,
        "n": 10,
        "sum": 1.0,
        "q": [0.1, 0.102, 0.11, 0.13],
        "b": [0] * 6 + [10] + [0] * 12,
        "r": [],
        "epoch": 0,
    }
    frame: bytes = P.encode(P.HEARTBEAT, step=1000, sps=9.9, state="idle", ledger=ledger)
    return frame


def router(path: str, hb: float) -> None:
    import zmq

    linger, answer_every = _settings()
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    r.setsockopt(zmq.SNDHWM, 100_000)
    r.setsockopt(zmq.RCVHWM, 100_000)
    r.bind(f"ipc://{path}")
    poller = zmq.Poller()
    poller.register(r, zmq.POLLIN)
    seen: dict[bytes, int] = {}
    owed: list[bytes] = []
    answer = b"\x82\xa1v\x03\xa1t\xa2hb"  # a frame of an answer's size; its bytes are not read
    next_tick = time.monotonic() + hb
    print(json.dumps({"ready": True}), flush=True)
    while True:
        now = time.monotonic()
        if poller.poll(max(1, int((next_tick - now) * 1000))):
            while True:
                try:
                    last = r.recv(zmq.NOBLOCK, copy=False)
                    ident = last.bytes
                    while last.more:
                        last = r.recv(zmq.NOBLOCK, copy=False)
                    last.get("Peer-Address")
                except zmq.Again:
                    break
                k = seen.get(ident, 0)
                seen[ident] = k + 1
                if answer_every and k % answer_every == 0:
                    owed.append(ident)
            time.sleep(linger)
        if time.monotonic() >= next_tick:
            for ident in owed:
                r.send_multipart([ident, answer], zmq.NOBLOCK)
            owed = []
            next_tick += hb


def peers(path: str, count: int, hb: float) -> None:
    import zmq

    frame = heartbeat_frame()
    ctx = zmq.Context()
    socks = []
    for _ in range(count):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{path}")
        socks.append(s)
    print(json.dumps({"ready": True}), flush=True)
    t0 = time.monotonic()
    i = 0
    while True:
        for j, s in enumerate(socks):
            delay = t0 + (i + j / count) * hb - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                s.send(frame, zmq.NOBLOCK)
                while s.poll(0):
                    s.recv()
            except zmq.ZMQError:
                pass
        i += 1


class Floor:
    """The ROUTER and its peers as processes: :attr:`pid` is the ROUTER's, to sample."""

    def __init__(self, n: int, procs: int = 4, hb: float = 1.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="profd-floor-"))
        path = str(self.dir / "floor.sock")
        env = dict(os.environ)
        self.procs: list[subprocess.Popen[str]] = []
        try:
            self.router = self._spawn(["router", path, str(hb)], env)
            per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
            for k in per:
                if k:
                    self._spawn(["peers", path, str(k), str(hb)], env)
        except BaseException:
            self.close()  # the processes already started, and the directory
            raise

    def _spawn(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, str(HERE), *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.procs.append(p)
        assert p.stdout is not None
        json.loads(p.stdout.readline())
        return p

    @property
    def pid(self) -> int:
        return self.router.pid

    @property
    def peer_pids(self) -> list[int]:
        return [p.pid for p in self.procs[1:]]

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "router":
        router(sys.argv[2], float(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "peers":
        peers(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--clients", type=int, default=1024)
    ap.add_argument("--window", type=float, default=30.0)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from bench_daemon import sample

    floor = Floor(args.clients)
    try:
        time.sleep(5.0)
        got: dict[str, Any] = sample(floor.pid, args.window)
    finally:
        floor.close()
    print(json.dumps(got, indent=2))


if __name__ == "__main__":
    main()
