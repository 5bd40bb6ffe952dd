"""Thousands of random messages of real types on both sockets of a real daemon.

Each message has a valid ``v`` and ``t`` and random values in its declared fields (nested
maps and lists included), so it passes the envelope and reaches the schema and the
handlers. Valid requests are interleaved. Afterwards the daemon must be alive, have
answered every control request, have logged no traceback, and still capture a real job's
steps, across a restart.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import zmq
from daemonproc import wait_for
from harness import Daemon, Job
from rawpeer import HELLO, TracePeer, dealer, pack, req
from test_pipeline_faults import wait_end
from test_trace_values import poisoned_trace

from profd import control_schema as C
from profd_client import protocol as P

SEED = 20261122
#: Values that once got through: a 30-digit step (as text: msgpack cannot carry
#: the number, a trace can) and session ids at, and just past, the one bound they have.
HUGE_STEP = "1" * 30
HOSTILE = [
    HUGE_STEP,
    f"ProfilerStep#{HUGE_STEP}",
    f"{HUGE_STEP}:{HUGE_STEP}1",
    "s" * P.MAX_NAME,
    "s" * (P.MAX_NAME + 1),
]
BEYOND = [P.MAX_STEP, P.MAX_STEP + 1, P.MAX_RANK + 1]
#: Start specs within every field's limits whose total work is not (a 49.9 MB
#: reply and a stalled loop), and a heartbeat rate at its allowed maximum (a lying peer).
HUGE_SPECS = [
    {"next": True, "repeat": 1000, "active": 10000},
    {"steps": "1:10001"},
    {"at_step": P.MAX_STEP - 5, "active": 10000, "repeat": 1000},
]
MAX_RATE = 1e9
N_AGENT = 3000
N_CONTROL = 1500


def value(rnd: random.Random, depth: int = 0) -> Any:
    kind = rnd.randrange(12 if depth < 2 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.random() < 0.5
    if kind == 2:
        return rnd.choice(
            [0, 1, -1, 2, 7, 1 << 31, 1 << 53, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1, *BEYOND]
        )
    if kind == 3:
        return rnd.randint(-(10**6), 10**6)
    if kind == 4:
        return rnd.choice([0.0, -0.5, 1e308, float("inf"), float("nan"), 3.25, MAX_RATE])
    if kind == 5:
        return rnd.choice(
            ["", "x", "../..", "a" * 5000, "0:5", "1,2,5", "*", "%", "trainer", *HOSTILE]
        )
    if kind == 6:
        return bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 20)))
    if kind == 7:
        return "".join(chr(rnd.randint(1, 0x2FFF)) for _ in range(rnd.randint(0, 30)))
    if kind == 8:
        return rnd.randint(0, 100)
    if kind == 9:
        return [value(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    if kind == 10:
        return [[rnd.randint(-2, 50) for _ in range(3)] for _ in range(rnd.randint(0, 3))]
    keys = ["path", "kind", "job", "steps", "limit", "rank", "activities", "x"]
    return {rnd.choice(keys): value(rnd, depth + 1) for _ in range(rnd.randint(0, 4))}


def message(rnd: random.Random, types: Mapping[str, P.Struct]) -> dict[str, Any]:
    t = rnd.choice(sorted(types))
    msg: dict[str, Any] = {"v": P.VERSION, "t": t}
    fields = types[t].fields
    for name in fields:
        if rnd.random() < 0.7:
            msg[name] = value(rnd)
    if t == C.C_START and rnd.random() < 0.5:
        keys = sorted(C.START_KEYS)
        msg["spec"] = {rnd.choice(keys): value(rnd) for _ in range(rnd.randint(0, 5))}
    elif t == C.C_START and rnd.random() < 0.3:
        msg["spec"] = dict(rnd.choice(HUGE_SPECS))
    if t == P.HEARTBEAT and rnd.random() < 0.3:
        msg["sps"] = MAX_RATE
    return msg


VALID_CONTROL = [
    {"t": "status"},
    {"t": "ps"},
    {"t": "sessions", "limit": 5},
    {"t": "traces", "filters": {"limit": 3}},
    {"t": "traces", "filters": {"session": "s" * P.MAX_NAME}},
]


def test_fuzzed_messages_on_both_sockets(daemon: Daemon, ctx: zmq.Context, torchrun) -> None:
    rnd = random.Random(SEED)
    agent = dealer(ctx, daemon, "agent.sock")
    agent.setsockopt(zmq.SNDHWM, 0)
    agent.send(pack(HELLO))
    ctl = req(ctx, daemon)
    answered = valid_ok = 0
    for i in range(max(N_AGENT, N_CONTROL)):
        if i < N_AGENT:
            agent.send(pack(message(rnd, P.AGENT_INBOUND)))
        if i < N_CONTROL:
            valid = VALID_CONTROL[i // 5 % len(VALID_CONTROL)]
            m = valid if i % 5 == 0 else message(rnd, C.CONTROL_INBOUND)
            ctl.send(pack({"v": P.VERSION, **m}))
            assert ctl.poll(10_000), f"control request {i} not answered: {m}"
            r = P.decode(ctl.recv(), C.REPLY_INBOUND, reply=True)
            answered += 1
            if i % 5 == 0:
                assert r["t"] == "ok", (m, r)
                valid_ok += 1
            elif r["t"] == "error":
                assert r["code"] != "internal", (m, r)
        # Drain what the daemon pushed to the fuzzing client so its queue stays small.
        while agent.poll(0):
            agent.recv()
    assert answered == N_CONTROL and valid_ok == N_CONTROL // 5
    agent.close()
    ctl.close()
    assert daemon.proc is not None and daemon.proc.poll() is None
    log = daemon.log.read_text()
    assert "Traceback" not in log, log[-4000:]

    # The 30-digit step in a trace, where a peer can put it: listings still answer.
    poisoner = TracePeer(ctx, daemon, "poison")
    sid, _ = poisoner.capture(poisoned_trace)
    poisoner.sock.close(0)
    assert wait_end(daemon, sid)["state"] == "done"
    assert [r["session"] for r in daemon.ctl_json("traces")] == [sid]

    # A real job still gets captured, and the capture is there after a restart.
    job: Job = torchrun("train.py", daemon=daemon, STEPS="100000", STEP_SLEEP="0.02")
    try:
        # (The fuzzing peer sent a bye or stopped heartbeating, and is gone by now.)
        real = wait_for(
            lambda: (lambda rows: rows if len(rows) == 2 else None)(
                [r for r in daemon.ps() if r["job"] != "poison" and r["host"] != HELLO["host"]]
            ),
            90,
            "the job's two ranks",
        )
        res = daemon.ctl_json("start", "--job", real[0]["job"], "--next", "--wait", timeout=180)
        assert res["state"] == "done", res
        daemon.stop()
        daemon.start()
        s = daemon.ctl_json("show", res["session"])
        assert s["state"] == "done" and all(t["traces"] == 1 for t in s["targets"]), s
        rows = daemon.ctl_json("traces", "--session", res["session"])
        assert len(rows) == 2
        daemon.wait_attached(2, timeout=60)  # the job's ranks re-register by themselves
    finally:
        job.kill()
    assert "Traceback" not in daemon.log.read_text()
