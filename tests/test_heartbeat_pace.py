"""The heartbeat pace on a real daemon: past ``[daemon] max_heartbeats_per_s`` every attached
process is told a longer interval (a welcome again), ``status`` says so, a process that
heartbeats at the told pace stays attached, and when processes leave the pace comes back
down without dropping one told the longer interval a moment before.

Raw peers (hand-made frames on ``agent.sock``) so that every welcome is seen as it comes; the
client side is a real ``profd_client.attach()`` process against a test double of the daemon
(a scripted ZeroMQ ROUTER), which decides when each new pace is told.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import zmq
from daemonproc import BIN
from harness import Daemon
from rawpeer import HELLO, agent_double, dealer, from_client, pack, reply

from profd_client import protocol as P

# 0.5 s heartbeats, 4 a second: two processes fit, a third doubles the interval.
CONFIG = "[daemon]\nheartbeat_interval = 0.5\nmax_heartbeats_per_s = 4\n"


def hello(ctx: zmq.Context, d: Daemon, name: str) -> zmq.Socket:
    s = dealer(ctx, d, "agent.sock")
    s.send(pack({**HELLO, "host": name, "quiet": True}))
    w = reply(s, 10_000)
    assert w is not None and w["t"] == "welcome", w
    return s


def beat(s: zmq.Socket) -> None:
    s.send(pack({"v": 1, "t": "hb", "step": 0}))


def next_welcome(s: zmq.Socket, wait_s: float, beating: float) -> dict[str, Any]:
    """The next welcome ``s`` gets within ``wait_s``, heartbeating every ``beating`` s."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        beat(s)
        while (m := reply(s, int(beating * 1000))) is not None:
            if m["t"] == "welcome":
                return m
    raise AssertionError(f"no new welcome within {wait_s} s")


def attached(d: Daemon) -> tuple[int, dict[str, Any]]:
    st = d.ctl_json("status")
    return st["clients"], st["heartbeat"]


def test_a_crowded_node_paces_every_process_and_lets_none_go(
    daemon_factory: Any, ctx: zmq.Context
) -> None:
    d = daemon_factory(config=CONFIG)
    a, b = hello(ctx, d, "a"), hello(ctx, d, "b")
    assert attached(d) == (2, {"interval_s": 0.5, "base_s": 0.5, "max_per_s": 4.0})

    c = hello(ctx, d, "c")  # a third: 6 a second at 0.5 s
    told = [next_welcome(s, 5.0, 0.5) for s in (a, b, c)]
    assert {w["hb_interval"] for w in told} == {1.0}, told
    assert {w["acks"] for w in told} == {5}  # answers still every ~5 s
    assert attached(d) == (3, {"interval_s": 1.0, "base_s": 0.5, "max_per_s": 4.0})
    st = d.ctl("status").stdout
    assert "heartbeats every 1 s, not 0.5 s" in st, st

    # At the told pace (1 s: twice the base), for longer than three base intervals.
    for _ in range(4):
        for s in (a, b, c):
            beat(s)
        time.sleep(1.0)
    assert attached(d)[0] == 3

    # Two leave: one left fits three quarters of the base pace's budget, so it comes back
    # down; ``a`` heartbeated at 1 s a moment before, and is not dropped for it.
    for s in (b, c):
        s.send(pack({"v": 1, "t": "bye"}))
    w = next_welcome(a, 5.0, 1.0)
    assert w["hb_interval"] == 0.5 and w["acks"] == 10
    for _ in range(8):
        beat(a)
        time.sleep(0.5)
    assert attached(d) == (1, {"interval_s": 0.5, "base_s": 0.5, "max_per_s": 4.0})
    for s in (a, b, c):
        s.close(0)


JOB = """
import time
import profd_client

profd_client.attach(job="paced", role="main", rank=0, world_size=1, step="manual")
while True:
    time.sleep(0.05)
    profd_client.step()
"""


def test_a_client_told_a_new_pace_takes_it_at_a_phase_of_its_own(tmp_path: Path) -> None:
    """Every client of a node hears a new pace at once. Told right after a heartbeat, a
    client that kept its phase would send its next one a whole new interval later, and all
    of them together; a real client picks a phase of its own in the new interval."""
    base, paced, rounds = 0.2, 0.6, 8
    ctx = zmq.Context()
    router, env = agent_double(ctx, tmp_path, base)
    proc = subprocess.Popen([str(BIN / "python"), "-c", JOB], env=env)
    delays: list[float] = []
    told_at: float | None = None
    at_base = 0

    def welcome(ident: bytes, v: int, interval: float) -> None:
        frame = P.encode(P.WELCOME, v=v, spool=str(tmp_path), hb_interval=interval, daemon="x")
        router.send_multipart([ident, frame])

    try:
        for ident, m, now in from_client(router, proc, 90, lambda: len(delays) >= rounds):
            if m["t"] == "hello":
                welcome(ident, m["v"], base)
                continue
            if m["t"] != "hb":
                continue
            router.send_multipart([ident, P.encode(P.HEARTBEAT, v=m["v"])])
            if told_at is not None:  # the first heartbeat after the new pace
                delays.append(now - told_at)
                told_at = None
                welcome(ident, m["v"], base)  # back to the base pace for the next round
                at_base = 0
            elif at_base == 2:
                welcome(ident, m["v"], paced)  # right after a heartbeat
                told_at = time.monotonic()
            else:
                at_base += 1
    finally:
        proc.kill()
        proc.wait()
        router.close()
        ctx.term()
    assert len(delays) == rounds, f"{len(delays)} rounds of {rounds}"
    # Each within the new interval (and a little scheduling) ...
    assert all(d <= paced + 0.3 for d in delays), delays
    # ... and not a whole interval every time: P(8 uniform phases all in its last fifth) is
    # 0.2 ** 8, about 3e-6.
    assert min(delays) < 0.8 * paced, delays
