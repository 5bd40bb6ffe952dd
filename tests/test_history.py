"""``profctl history`` against a real daemon: raw protocol-3 peers send step ledgers, leave
(a rank that leaves closes its minute, so no test waits for the wall clock's next minute),
and the minute is in the index; it is still there after the daemon restarts, with the open
minute of a rank that was still attached when the daemon stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

import msgspec
from clusters import Cluster
from harness import Daemon, wait_for
from lines import read_line
from rawpeer import HELLO, pack

from profd_client import protocol as P

JOB = "hist-job"

# A rank in a process of its own (the daemon believes only kernel pids): hello, then each
# message, waiting for the daemon's answer to every heartbeat; then, with "stay", plain
# heartbeats until it is killed.
_PEER = """
import os, sys, time
import msgpack, zmq
msgs, path, stay = msgpack.unpackb(bytes.fromhex(sys.argv[1]), raw=False), sys.argv[2], sys.argv[3]
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 5000)
s.connect("ipc://" + path)
def expect(t):
    while msgpack.unpackb(s.recv(), raw=False)["t"] != t:
        pass
s.send(msgpack.packb({**msgs[0], "pid": os.getpid()}))
expect("welcome")
for m in msgs[1:]:
    s.send(msgpack.packb(m))
    if m["t"] == "hb":
        expect("hb")
print("sent", flush=True)
if stay:
    while True:
        s.send(msgpack.packb({"v": 3, "t": "hb", "step": msgs[-1]["step"]}))
        time.sleep(0.2)
s.close()
ctx.term()
"""


def ledger_hb(step_s: float, n: int, at: int) -> dict[str, Any]:
    b = [0] * (len(P.STEP_BUCKETS) + 1)
    b[bisect_left(P.STEP_BUCKETS, step_s)] = n
    led = {"at": at, "n": n, "sum": step_s * n, "q": [step_s] * 4, "b": b, "r": [], "epoch": 0}
    msgspec.convert(led, P.Ledger)  # a ledger the daemon takes
    return {"v": P.VERSION, "t": P.HEARTBEAT, "step": at, "sps": 1.0 / step_s, "ledger": led}


def peer(d: Daemon, role: str, rank: int, step_s: float, beats: int, stay: bool = False,
         host: str = "node-a") -> Any:  # fmt: skip
    hello = {**HELLO, "v": P.VERSION, "host": host, "job": JOB, "role": role,
             "rank": rank, "local_rank": rank, "world_size": 3}  # fmt: skip
    msgs: list[dict[str, Any]] = [hello]
    msgs += [ledger_hb(step_s, 10, 10 * (i + 1)) for i in range(beats)]
    if not stay:
        msgs.append({"v": P.VERSION, "t": P.BYE})
    return subprocess.Popen(
        [sys.executable, "-c", _PEER, pack(msgs).hex(), str(d.runtime_dir / "agent.sock"),
         "stay" if stay else ""],
        stdout=subprocess.PIPE,
    )  # fmt: skip


def history(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return d.ctl("history", "--job", JOB, *args)


def minutes_with(d: Daemon, role: str, steps: int) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        r = history(d, "--json")
        if r.returncode != 0:
            return None
        rows = [m for m in json.loads(r.stdout)["minutes"] if m["role"] == role]
        return rows if sum(m["steps"] for m in rows) == steps else None

    found: list[dict[str, Any]] = wait_for(ready, 30, f"{steps} {role} steps in the history")
    return found


def not_near_a_minute_end() -> None:
    """The peers take a second or two: start them where no wall-clock minute ends meanwhile,
    so each rank's steps are one minute."""
    if time.time() % 60 > 45:
        time.sleep(61 - time.time() % 60)


def test_history_of_ranks_that_left_outlives_the_daemon(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory()
    not_near_a_minute_end()
    rollout = peer(d, "rollout", 0, 0.020, 2, stay=True)
    try:
        trainers = [peer(d, "trainer", r, 0.045 if r == 2 else 0.030, 3) for r in range(3)]
        for p in trainers:
            assert p.wait(30) == 0
        assert read_line(rollout, 120) == b"sent\n"

        (m,) = minutes_with(d, "trainer", 90)
        assert m["minute"] % 60 == 0 and m["minute"] <= time.time()
        assert (m["ranks"], m["steps"]) == (3, 90)
        assert (m["p50_ms"], m["p90_ms"], m["max_ms"]) == (30.0, 30.0, 45.0)
        assert m["slowest"] == [
            {"host": "node-a", "role": "trainer", "rank": 2, "p50_ms": 45.0},
            {"host": "node-a", "role": "trainer", "rank": 0, "p50_ms": 30.0},
            {"host": "node-a", "role": "trainer", "rank": 1, "p50_ms": 30.0},
        ]
        doc = d.ctl_json("history", "--job", JOB)
        assert doc["job"] == JOB and doc["node"] == d.ctl_json("status")["host"]
        assert doc["since"] < m["minute"] < doc["until"]
        text = history(d)
        assert text.returncode == 0, text.stderr
        assert "node-a r2 45.0ms, node-a r0 30.0ms, node-a r1 30.0ms" in text.stdout

        # The rollout rank is still attached: its minute is written when the daemon stops.
        d.stop()
        d.start()
        (again,) = [r for r in minutes_with(d, "trainer", 90)]
        assert again == m
        (ro,) = minutes_with(d, "rollout", 20)
        assert (ro["ranks"], ro["p50_ms"], ro["slowest"][0]["rank"]) == (1, 20.0, 0)
    finally:
        rollout.kill()
        rollout.wait()


def test_a_job_without_history_is_one_line_and_exit_1(daemon: Daemon) -> None:
    r = daemon.ctl("history", "--job", "never-ran")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("profctl: no step times for job 'never-ran' from ")
    assert r.stderr.count("\n") == 1
    r = daemon.ctl("history", "--job", "never-ran", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["code"] == "not_found"
    r = daemon.ctl("history", "--job", "never-ran", "--since", "last week")
    assert r.returncode == 2 and "--since 'last week'" in r.stderr
    r = daemon.ctl("history", "--job", "never-ran", "--since", "1h", "--until", "2h")
    assert r.returncode == 2 and "--since must be before --until" in r.stderr


def test_cluster_history_merges_the_nodes_minutes(cluster: Cluster) -> None:
    a, _ = cluster.add("node-a", heartbeat=1)
    b, _ = cluster.add("node-b", heartbeat=1)
    not_near_a_minute_end()
    peers = [peer(a, "trainer", r, 0.030, 3, host="pod-a") for r in range(2)]
    peers.append(peer(b, "trainer", 2, 0.090, 3, host="pod-b"))
    for p in peers:
        assert p.wait(30) == 0
    minutes_with(a, "trainer", 60)
    minutes_with(b, "trainer", 30)
    r = cluster.ctl("--json", "history", "--job", JOB)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"job", "since", "until", "minutes"}
    (m,) = doc["minutes"]
    assert (m["ranks"], m["steps"], m["p50_ms"], m["max_ms"]) == (3, 90, 30.0, 90.0)
    assert [(s["host"], s["client_host"], s["rank"], s["p50_ms"]) for s in m["slowest"]] == [
        ("node-b", "pod-b", 2, 90.0),
        ("node-a", "pod-a", 0, 30.0),
        ("node-a", "pod-a", 1, 30.0),
    ]
    text = cluster.ctl("history", "--job", JOB)
    assert "node-b r2 90.0ms, node-a r0 30.0ms" in text.stdout, text.stderr
