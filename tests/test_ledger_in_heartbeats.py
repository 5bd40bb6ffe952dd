"""A real training process ships its step ledger (protocol 3) in its heartbeats.

The daemon side of the ledger is not this test's subject: the peer here is a test double of
the daemon, a scripted ZeroMQ ROUTER on ``agent.sock`` (as in ``test_rollback.py`` and
``test_defects.py``) that welcomes the process in the versions it is told to serve, answers
heartbeats as the daemon does, and records them, each checked by the daemon's own schema
(``protocol.decode``). The process is real: ``profd_client.attach()``, a manual step loop of
sleeps with a region, and its own clock readings of every step and region, printed at exit,
to compare the ledgers with.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import zmq
from daemonproc import BIN
from rawpeer import agent_double, pack

from profd.watch.stats import weighted_quantile
from profd_client import protocol as P

STEPS = 100

#: 15 ms inside region "fwd", 5 ms outside, per step; the job measures both itself.
JOB = f"""
import json, time
import profd_client

profd_client.attach(job="ledger", role="main", rank=0, world_size=1, step="manual")
steps, fwd = [], []
last = time.perf_counter()
for _ in range({STEPS}):
    t0 = time.perf_counter()
    with profd_client.region("fwd"):
        with profd_client.region("fwd"):  # nested: counted once
            time.sleep(0.015)
    fwd.append(time.perf_counter() - t0)
    time.sleep(0.005)
    profd_client.step()
    now = time.perf_counter()
    steps.append(now - last)
    last = now
print(json.dumps({{"steps": steps, "fwd": fwd}}), flush=True)
"""


def _run_against(tmp_path: Path, serves: tuple[int, int]) -> tuple[list[dict[str, Any]], Any, str]:
    """Run the job against a daemon double serving versions ``serves``; the heartbeats it
    received (validated), what the job measured itself, and its stderr."""
    ctx = zmq.Context()
    router, env = agent_double(ctx, tmp_path, 0.2)
    proc = subprocess.Popen(
        [str(BIN / "python"), "-c", JOB], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    lo, hi = serves
    beats: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if not router.poll(100):
                continue
            ident, frame = router.recv_multipart()
            raw = msgpack.unpackb(frame, raw=False)
            v = raw["v"]
            if not lo <= v <= hi:
                # What a daemon of versions lo..hi answers: in the peer's own version.
                refusal = {"v": v, "t": "error", "code": "version", "msg": f"speaks {lo}..{hi}"}
                router.send_multipart([ident, pack(refusal)])
                continue
            m = P.decode(frame, P.AGENT_INBOUND)
            if m["t"] == P.HELLO:
                welcome = {"spool": str(tmp_path), "hb_interval": 0.2, "daemon": "double"}
                router.send_multipart(
                    [ident, P.encode(P.WELCOME, v=v, protocol=[lo, hi], **welcome)]
                )
            elif m["t"] == P.HEARTBEAT:
                beats.append(msgspec.to_builtins(m))  # a typed message, as a map
                router.send_multipart([ident, P.encode(P.HEARTBEAT, v=v)])
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        router.close()
        ctx.term()
    assert proc.returncode == 0, err.decode()
    return beats, json.loads(out), err.decode()


def test_a_process_ships_its_step_and_region_times(tmp_path: Path) -> None:
    beats, own, _ = _run_against(tmp_path, (1, 3))
    assert all(b["v"] == 3 for b in beats)
    # Epoch 1 starts at step 1's end (step 1, from attach() on, is not timed); a ledger sent
    # before it holds no step.
    assert all(b["ledger"]["n"] == 0 for b in beats if b["ledger"]["epoch"] == 0)
    ledgers = [b["ledger"] for b in beats if b["ledger"]["epoch"] == 1]
    assert len(ledgers) >= 3
    # Each ledger takes up where the one before it ended: no step lost or counted twice.
    start = done = ledgers[0]["at"] - ledgers[0]["n"]  # the count at the hello
    for lg in ledgers:
        assert lg["at"] == done + lg["n"] and sum(lg["b"]) == lg["n"]
        # The same steps as the job timed them itself (clock reads microseconds apart).
        mine = sum(own["steps"][done : lg["at"]])
        assert abs(lg["sum"] - mine) <= 0.05 * mine + 1e-3, (lg, mine)
        done = lg["at"]
    assert done - start >= STEPS // 2
    p50 = weighted_quantile([(lg["q"][0], lg["n"]) for lg in ledgers if lg["n"]], 0.5)
    own_p50 = statistics.median(own["steps"][start:done])
    assert p50 is not None and abs(p50 - own_p50) <= 0.2 * own_p50, (p50, own_p50)
    # Region "fwd": its share of the step time, as the job measured it; nested entries once.
    fwd = [r for lg in ledgers for r in lg["r"]]
    assert {r[0] for r in fwd} == {"fwd"}
    entries, seconds = sum(r[2] for r in fwd), sum(r[1] for r in fwd)
    # Counted once per step, nested entries once. The agent thread reads the step count and
    # the region totals a moment apart (no lock against the training thread), so an entry at
    # either end of the span may ride in the ledger beside it: at the start, one read into
    # the last epoch-0 ledger (-1) or before the hello's count (+1); at the end, the entry of
    # a step not ended yet (+1).
    assert done - start - 1 <= entries <= done - start + 2, (entries, done - start)
    share = seconds / sum(lg["sum"] for lg in ledgers)
    own_share = sum(own["fwd"][start : start + entries]) / sum(own["steps"][start:done])
    assert abs(share - own_share) <= 0.05 * own_share, (share, own_share)


def test_a_version_2_daemon_gets_no_ledger_and_the_job_trains_on(tmp_path: Path) -> None:
    beats, own, err = _run_against(tmp_path, (1, 2))
    assert len(own["steps"]) == STEPS
    assert len(beats) >= 3 and all(b["v"] == 2 and "ledger" not in b for b in beats)
    steps = [b["step"] for b in beats]
    assert steps == sorted(steps) and steps[-1] > 0
    lines = [ln for ln in err.splitlines() if "protocol version" in ln]
    assert len(lines) == 1 and "version 2" in lines[0], err
