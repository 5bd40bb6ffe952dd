"""``profctl top`` against real daemons: raw peers in processes of their own step at known
step times and send heartbeats with step ledgers (protocol 3), or without (protocol 2).

The step times are what each peer says it measured, so the figures ``top`` shows are checked
against numbers the test chose, however loaded the machine is.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from clusters import Cluster, free_port
from daemonproc import BIN, wait_for
from harness import Daemon
from lines import read_line
from rawpeer import HELLO, pack
from steppeer import step_peers

EXIT_NODES_MISSING = 4
FAST_S, SLOW_S = 0.030, 0.042  # the slow rank is 40 % slower
DATA, FWD = 0.25, 0.40  # each region's share of every step

#: A peer that steps: hello, then every 0.2 s a heartbeat with the steps that fit in the time
#: since the last one, each ``step_s`` long (±5 %), a quarter of it in ``data`` and 40 % in
#: ``fwd``; from protocol 3 with the ledger a client sends (``protocol.Ledger``).
_STEPPER = """
import bisect, os, random, sys, time
import msgpack, zmq
from profd_client.protocol import STEP_BUCKETS
hello, path = msgpack.unpackb(bytes.fromhex(sys.argv[1])), sys.argv[2]
step_s, v = float(sys.argv[3]), hello["v"]
data, fwd = float(sys.argv[4]), float(sys.argv[5])
wait_s = float(sys.argv[6])  # collective wait a step; < 0: none sent (no timings)
s = zmq.Context().socket(zmq.DEALER)
s.connect("ipc://" + path)
s.send(msgpack.packb({**hello, "pid": os.getpid()}))
while msgpack.unpackb(s.recv(), raw=False)["t"] != "welcome":
    pass
print("stepping", flush=True)
rng = random.Random(os.getpid())
step, last = 0, time.monotonic()
while True:
    while s.poll(0):
        s.recv()
    time.sleep(0.2)
    now = time.monotonic()
    n = max(1, round((now - last) / step_s))
    ds = sorted(step_s * (1 + rng.uniform(-0.05, 0.05)) for _ in range(n))
    step += n
    hb = {"v": v, "t": "hb", "step": step, "sps": n / (now - last), "state": "idle"}
    last = now
    if v >= 3:
        b = [0] * (len(STEP_BUCKETS) + 1)
        for d in ds:
            b[bisect.bisect_left(STEP_BUCKETS, d)] += 1
        q = [ds[min(n - 1, int(x * n))] for x in (0.5, 0.9, 0.99)] + [ds[-1]]
        total = sum(ds)
        hb["ledger"] = {"at": step, "n": n, "sum": total, "q": q, "b": b, "epoch": 0,
                        "r": [["data", data * total, n], ["fwd", fwd * total, n]]}
        if wait_s >= 0:
            hb["ledger"]["wait"] = [wait_s * n, n]
    s.send(msgpack.packb(hb))
"""


Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def stepper() -> Iterator[Spawn]:
    """``stepper(daemon, job, role, rank, step_s, v=3, wait_s=-1)``: a stepping peer, once
    welcomed (with ``wait_s`` >= 0, its ledgers say it waits that long a step in collectives)."""
    made: list[subprocess.Popen[str]] = []

    def spawn(
        d: Daemon,
        job: str,
        role: str,
        rank: int,
        step_s: float,
        v: int = 3,
        world: int = 3,
        wait_s: float = -1.0,
    ) -> subprocess.Popen[str]:
        hello = {**HELLO, "v": v, "host": "top-test", "job": job, "role": role, "rank": rank,
                 "local_rank": rank, "world_size": world}  # fmt: skip
        p = subprocess.Popen(
            [sys.executable, "-c", _STEPPER, pack(hello).hex(),
             str(d.runtime_dir / "agent.sock"), str(step_s), str(DATA), str(FWD), str(wait_s)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        made.append(p)
        assert read_line(p, 120).strip() == "stepping"
        return p

    yield spawn
    for p in made:
        p.kill()
        p.wait()


def top_json(run: Callable[..., subprocess.CompletedProcess[str]], *args: str) -> Any:
    r = run("top", "--once", "--json", *args)
    assert r.returncode == 0, f"profctl top {args}: {r.returncode} {r.stderr}{r.stdout}"
    return json.loads(r.stdout)["ranks"]


def timed(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]] | None:
    """``rows`` once ``n`` ranks have step times (and every ranked role its comparison)."""
    if len(rows) < n or any(r["step_ms_p50"] is None for r in rows):
        return None
    return rows


def by_rank(rows: list[dict[str, Any]], job: str) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for r in rows if r["job"] == job}


def near(value: float | None, want: float, within: float = 0.2) -> bool:
    return value is not None and abs(value - want) <= within * want


def test_top_ranks_slowest_first_against_their_role(daemon: Daemon, stepper: Spawn) -> None:
    for rank in range(3):
        stepper(daemon, "train", "main", rank, SLOW_S if rank == 2 else FAST_S)
    stepper(daemon, "gen", "rollout", 0, FAST_S)
    stepper(daemon, "old", "main", 0, 0.05, v=2)  # no ledger: timed by its rate

    rows = wait_for(
        lambda: timed(top_json(daemon.ctl), 5), 30, "5 ranks with step times", every=0.3
    )
    train = by_rank(rows, "train")
    # The slow rank first, 1.4x its role's other ranks (leave-one-out), and marked.
    assert (rows[0]["job"], rows[0]["rank"]) == ("train", 2), rows[0]
    assert near(train[2]["vs_role"], SLOW_S / FAST_S, 0.1) and train[2]["marked"], train[2]
    assert not train[0]["marked"] and not train[1]["marked"]
    for rank, want in ((0, FAST_S), (1, FAST_S), (2, SLOW_S)):
        r = train[rank]
        assert near(r["step_ms_p50"], want * 1000), r
        assert r["step_ms_p99"] >= r["step_ms_p50"], r
        assert r["source"] == "ledger" and 0 < r["window_s"] <= 60, r
        assert near(r["regions"]["data"], DATA, 0.05) and near(r["regions"]["fwd"], FWD, 0.05)
        assert r["host"] == "top-test" and r["node"] and r["world_size"] == 3, r
        assert r["sps"] > 0 and r["age_s"] >= 0 and isinstance(r["step_extrapolated"], bool)
    assert any(r["step_extrapolated"] for r in rows), rows  # heartbeats every 0.2 s
    # Alone in their roles: nothing to compare with.
    (old,) = by_rank(rows, "old").values()
    assert old["source"] == "rate" and old["regions"] == {} and old["step_ms_p99"] is None
    assert 0.5 * 50 < old["step_ms_p50"] < 2 * 50, old
    assert old["vs_role"] is None and not old["marked"]

    # Filters, as in ps: a job, a role glob.
    assert sorted(r["rank"] for r in top_json(daemon.ctl, "--job", "train")) == [0, 1, 2]
    assert [(r["job"], r["role"]) for r in top_json(daemon.ctl, "--role", "roll*")] == [
        ("gen", "rollout")
    ]
    assert top_json(daemon.ctl, "--job", "nothing") == []

    # ps rows say how fresh their step is.
    ps = daemon.ps()
    assert len(ps) == 5 and all(r["age_s"] >= 0 for r in ps), ps
    assert all(isinstance(r["step_extrapolated"], bool) for r in ps)
    assert any(r["step_extrapolated"] for r in ps)

    # The text frame: a header, every column, the marked rank's ratio with its "!".
    text = daemon.ctl("top", "--once")
    assert text.returncode == 0, text.stderr
    head, columns, first, *_ = text.stdout.splitlines()
    assert "1 node" in head and "5 ranks" in head and "1 marked" in head, head
    for name in ("HOST", "JOB", "ROLE", "RANK", "STEP", "AGE", "STEPS/S", "P50 MS", "P99 MS",
                 "VS ROLE", "REGIONS", "CPU%", "RSS", "GPU%", "GPU MEM", "SRC"):  # fmt: skip
        assert name in columns, (name, columns)
    assert "train" in first and "x!" in first and "fwd 40% data 25%" in first, first
    ps_text = daemon.ctl("ps")
    assert ps_text.returncode == 0 and "AGE" in ps_text.stdout.splitlines()[0], ps_text.stdout


def _read_until(fd: int, want: bytes, timeout: float = 20.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while want not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"no {want!r} from profctl top: {out!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                out += os.read(fd, 65536)
            except OSError:  # the child closed its end
                break
    return out


@pytest.mark.parametrize("leave", ["q", "ctrl-c"])
def test_live_top_redraws_on_a_terminal_and_quits_cleanly(
    daemon: Daemon, stepper: Spawn, leave: str
) -> None:
    stepper(daemon, "train", "main", 0, FAST_S)
    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    p = subprocess.Popen(
        [str(BIN / "profctl"), "top", "--interval", "0.3"],
        stdin=slave, stdout=slave, stderr=slave, env=daemon.env(), close_fds=True,
    )  # fmt: skip
    try:
        out = _read_until(master, b"VS ROLE")
        out += _read_until(master, b"profd top")  # the second frame: redrawn in place
        assert b"\x1b[H" in out and out.count(b"profd top") >= 2, out
        assert termios.tcgetattr(slave)[3] & termios.ICANON == 0  # cbreak while live
        if leave == "q":
            os.write(master, b"q")
        else:
            p.send_signal(signal.SIGINT)
        assert p.wait(20) == 0
        rest = _read_until(master, b"\x1b[?25h")  # the cursor shown again
        assert b"Traceback" not in out + rest
        assert termios.tcgetattr(slave) == before  # the terminal as it was
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
        os.close(slave)


def test_top_into_a_pipe_prints_frame_after_frame(daemon: Daemon, stepper: Spawn) -> None:
    stepper(daemon, "train", "main", 0, FAST_S)
    p = subprocess.Popen(
        [str(BIN / "profctl"), "top", "--interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=daemon.env(), text=True,
    )  # fmt: skip
    try:
        lines = [read_line(p, 120) for _ in range(7)]
    finally:
        p.send_signal(signal.SIGINT)
        rc = p.wait(20)
    assert rc == 0
    # Two frames, a blank line between them, no terminal codes in a pipe.
    assert lines[0].startswith("profd top") and lines[3] == "\n", lines
    assert lines[4].startswith("profd top") and not any("\x1b" in ln for ln in lines), lines


def test_top_across_nodes(cluster: Cluster, stepper: Spawn) -> None:
    # One role over two nodes: node-b's daemon sees its rank alone, profctl compares it with
    # the role's ranks on node-a.
    a, addr_a = cluster.add("node-a")
    b, addr_b = cluster.add("node-b")
    stepper(a, "train", "main", 0, FAST_S)
    stepper(a, "train", "main", 1, FAST_S)
    stepper(b, "train", "main", 2, SLOW_S)

    rows = wait_for(
        lambda: timed(top_json(cluster.ctl), 3), 30, "3 ranks with step times", every=0.3
    )
    assert {r["rank"]: r["host"] for r in rows} == {0: "node-a", 1: "node-a", 2: "node-b"}
    assert {r["client_host"] for r in rows} == {"top-test"}
    assert rows[0]["rank"] == 2 and rows[0]["marked"], rows[0]
    assert near(rows[0]["vs_role"], SLOW_S / FAST_S, 0.1), rows[0]
    # What node-b's daemon said alone: no other rank of the role to compare with.
    (alone,) = top_json(b.ctl)
    assert alone["vs_role"] is None and not alone["marked"]

    # A node that does not answer is named; the others' rows are printed.
    down = f"127.0.0.1:{free_port()}"
    r = cluster.ctl("--node-timeout", "1", "top", "--once", "--json", nodes=[addr_a, addr_b, down])
    assert r.returncode == EXIT_NODES_MISSING, r.stderr
    assert len(json.loads(r.stdout)["ranks"]) == 3
    assert f"{down} did not answer" in r.stderr


def test_hostile_host_and_region_names_are_escaped_in_text_and_exact_in_json(
    daemon: Daemon, tmp_path: Path
) -> None:
    """A peer's host (up to 255 characters) and region names (any content) reach other
    users' tables: an OSC 52 clipboard write, a newline that forges a row, a bidi override
    and a carriage return are shown escaped, one row per rank; ``--json`` has them exact."""
    host = "evil\x1b]52;c;SGVsbG8=\x07\nforged-host  4242  job  r  0/1"
    region = "\u202ebad\x1b[2J\r"
    with step_peers(tmp_path) as spawn:
        spawn(daemon, "hostile", 0, v=3, regions=(region, "data"), host=host)
        wait_for(lambda: (rows := top_json(daemon.ctl)) and rows[0]["regions"], 30, "region shares")
        ps_text = daemon.ctl("ps")
        top_text = daemon.ctl("top", "--once")
        [row] = daemon.ps()
        [top_row] = top_json(daemon.ctl)
    assert ps_text.returncode == 0 and top_text.returncode == 0, (ps_text, top_text)
    for out, lines in ((ps_text.stdout, 2), (top_text.stdout, 3)):
        assert out.count("\n") == lines, out  # (a header line, the column heads,) one row
        for raw in ("\x1b", "\x07", "\r", "\u202e"):
            assert raw not in out, (raw, out)
        assert "evil\\x1b]52;c;SGVsbG8=\\x07\\x0aforged-host" in out, out
    assert "\\u202ebad\\x1b[2J\\x0d" in top_text.stdout, top_text.stdout
    assert row["host"] == host and region in top_row["regions"], (row, top_row)


WAIT_WATCH = """
[watch]
window = 6.0
baseline = 12.0
hold = 3.0
cooldown = 600.0
"""


def test_a_lockstep_jobs_collective_waits_show_in_top_and_name_the_rank_waited_for(
    daemon_factory: Callable[..., Daemon], stepper: Spawn
) -> None:
    """Three ranks in lockstep (equal step times) whose ledgers carry their collective wait,
    as a client whose flight recorder times collectives sends it: rank 1 waits least, so the
    others wait for it; a fourth job's rank sends no wait (no timings)."""
    d = daemon_factory(config=WAIT_WATCH)
    for rank in range(3):
        stepper(d, "ddp", "main", rank, FAST_S, wait_s=0.001 if rank == 1 else 0.012)
    stepper(d, "gloo", "main", 0, FAST_S)

    def waits() -> list[dict[str, Any]] | None:
        rows = timed(top_json(d.ctl), 4)
        if rows is None or any(r.get("wait_ms") is None for r in rows if r["job"] == "ddp"):
            return None
        return rows

    rows = wait_for(waits, 30, "every ddp rank's wait in top", every=0.3)
    ddp = by_rank(rows, "ddp")
    assert near(ddp[1]["wait_ms"], 1.0) and near(ddp[0]["wait_ms"], 12.0), ddp
    assert near(ddp[2]["wait_ms"], 12.0), ddp
    assert by_rank(rows, "gloo")[0]["wait_ms"] is None  # unknown, not zero
    text = d.ctl("top", "--once")
    assert text.returncode == 0 and "WAIT MS" in text.stdout.splitlines()[1], text.stdout

    def incident() -> list[dict[str, Any]] | None:
        rows: list[dict[str, Any]] = d.ctl_json("incidents", "--job", "ddp")
        return rows or None

    (inc,) = wait_for(incident, 30, "a slow_rank incident by wait", every=0.5)
    assert inc["kind"] == "slow_rank" and [s["rank"] for s in inc["suspects"]] == [1], inc
    ev = inc["evidence"]
    assert ev["by"] == "wait" and near(ev["wait_ms"], 1.0, 0.5), ev
    assert near(ev["peers_wait_ms"], 12.0) and near(ev["step_ms"], FAST_S * 1000), ev
