"""Heartbeat answers: every one at once for a client that asks nothing, one every ``acks``
intervals for a ``quiet`` one (what profd_client says), sent with the daemon's next tick, and
a quiet client's patience to match.

The daemon side runs a real daemon with raw peers (hand-made frames on ``agent.sock``). The
client side runs a real ``profd_client.attach()`` process against a test double of the
daemon, a scripted ZeroMQ ROUTER, which decides exactly when the daemon is silent.
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

from profd.daemon.agent.attach import QUIET_ACKS
from profd_client import protocol as P


def _answers(s: zmq.Socket, wait_s: float) -> list[dict[str, Any]]:
    out = []
    deadline = time.monotonic() + wait_s
    while (m := reply(s, max(1, int((deadline - time.monotonic()) * 1000)))) is not None:
        out.append(m)
        if time.monotonic() >= deadline:
            break
    return out


def test_a_quiet_client_is_answered_once_every_few_intervals_others_every_time(
    daemon: Daemon, ctx: zmq.Context
) -> None:
    plain, quiet = dealer(ctx, daemon, "agent.sock"), dealer(ctx, daemon, "agent.sock")
    plain.send(pack({**HELLO, "host": "plain"}))
    quiet.send(pack({**HELLO, "host": "quiet", "quiet": True}))
    welcomes = {name: reply(s) for name, s in (("plain", plain), ("quiet", quiet))}
    assert welcomes["plain"] is not None and welcomes["quiet"] is not None
    assert welcomes["plain"]["t"] == welcomes["quiet"]["t"] == "welcome"
    hb_interval = welcomes["quiet"]["hb_interval"]
    acks = welcomes["quiet"]["acks"]
    assert "acks" not in welcomes["plain"] and acks == QUIET_ACKS

    # Ten heartbeats each, at once: well within one interval of the first.
    for _ in range(10):
        plain.send(pack({"v": 1, "t": "hb", "step": 0}))
        quiet.send(pack({"v": 1, "t": "hb", "step": 0}))
    # The plain client's at once; the quiet one's with the daemon's next tick, together
    # with every other quiet client's: within one interval.
    got_plain, got_quiet = _answers(plain, 1.0), _answers(quiet, hb_interval + 0.5)
    assert [m["t"] for m in got_plain] == ["hb"] * 10
    assert [m["t"] for m in got_quiet] == ["hb"]

    # acks - 1/2 intervals after the answer, the next heartbeat is answered again.
    time.sleep((acks - 0.5) * hb_interval)
    quiet.send(pack({"v": 1, "t": "hb", "step": 0}))
    assert [m["t"] for m in _answers(quiet, hb_interval + 0.5)] == ["hb"]
    assert sorted(c["host"] for c in daemon.ps()) == ["plain", "quiet"]


JOB = """
import time
import profd_client

profd_client.attach(job="quiet", role="main", rank=0, world_size=1, step="manual")
while True:
    time.sleep(0.05)
    profd_client.step()
"""


def test_a_quiet_client_waits_acks_intervals_before_it_calls_the_daemon_silent(
    tmp_path: Path,
) -> None:
    hb, acks = 0.2, 3
    ctx = zmq.Context()
    router, env = agent_double(ctx, tmp_path, hb)
    proc = subprocess.Popen([str(BIN / "python"), "-c", JOB], env=env)
    hellos: list[tuple[float, dict[str, Any]]] = []
    beats = 0
    answered_at = 0.0
    silent_from: float | None = None
    try:
        for ident, m, now in from_client(router, proc, 60, lambda: len(hellos) >= 2):
            if m["t"] == "hello":
                hellos.append((now, m))
                router.send_multipart([ident, P.encode(P.WELCOME, v=m["v"], spool=str(tmp_path),
                                       hb_interval=hb, daemon="double", acks=acks)])  # fmt: skip
                answered_at = now
            elif m["t"] == "hb":
                beats += 1
                # Answered as the daemon does for 20 heartbeats, then never again.
                if beats <= 20 and now - answered_at >= (acks - 0.5) * hb:
                    router.send_multipart([ident, P.encode(P.HEARTBEAT, v=m["v"])])
                    answered_at = now
                if beats == 20:
                    silent_from = answered_at
    finally:
        proc.kill()
        proc.wait()
        router.close()
        ctx.term()
    assert len(hellos) == 2, f"no second hello after {beats} heartbeats"
    first, again = hellos
    assert first[1]["quiet"] is True
    # Answered once every 3 intervals, it stayed (no hello while beats <= 20) ...
    assert silent_from is not None and again[0] > silent_from
    # ... and took the daemon for silent only 3 answers' worth after the last one, where a
    # client of a daemon answering every heartbeat waits 3 intervals.
    assert again[0] - silent_from >= 3 * acks * hb
