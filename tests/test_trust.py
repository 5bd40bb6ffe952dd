"""The trust boundary between local peers: no agent peer can touch another job's captures.

Raw ZeroMQ peers play a victim job and a hostile one against a real daemon; each forged
report was accepted by the wave-1 daemon (it overwrote or moved another job's trace).
"""

from __future__ import annotations

import gzip
import json
import os
import socket
from pathlib import Path
from typing import Any

import zmq
from daemonproc import wait_for
from harness import Daemon
from rawpeer import HELLO, dealer, pack, read_line, recv, reply, spawn_peer

from profd.states import TERMINAL
from profd_client import protocol as P


class Peer:
    """One raw agent peer: a process of ``job`` with rank 0 of role ``r``."""

    def __init__(
        self,
        ctx: zmq.Context,
        d: Daemon,
        job: str,
        host: str = HELLO["host"],
        rank: int = 0,
    ) -> None:
        # Its pid is this test's: the daemon checks it against the kernel. Two peers in one
        # test are told apart by their host names.
        self.sock = dealer(ctx, d, "agent.sock")
        self.ids = iter(range(1, 1 << 30))
        self.sock.send(pack({**HELLO, "job": job, "host": host, "rank": rank}))
        recv(self.sock, "welcome")

    def send(self, t: str, **fields: Any) -> dict[str, Any]:
        self.sock.send(pack({"v": P.VERSION, "t": t, "id": next(self.ids), **fields}))
        return recv(self.sock, "ack")

    def capture(self, arm: dict[str, Any], body: str, files: list[dict[str, str]] | None = None):  # type: ignore[no-untyped-def]
        """Record cycle 0 of ``arm``'s session into this peer's own file and report it."""
        sid = arm["session"]
        trace = Path(arm["incoming"]) / "c0" / "r-r0.pt.trace.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(body)
        self.send("progress", session=sid, state="capturing", step=1)
        self.report(sid, files or [{"kind": "trace", "path": str(trace)}])
        self.send("progress", session=sid, state="done", step=2)
        return trace

    def report(self, sid: str, files: list[dict[str, str]], cycle: int = 0) -> None:
        self.send("captured", session=sid, job="x", cycle=cycle, steps=[1], files=files,
                  started_at=1.0, ended_at=2.0, stall_ms=1.0)  # fmt: skip


def wait_end(d: Daemon, sid: str) -> dict[str, Any]:
    return wait_for(
        lambda: (lambda s: s if s["state"] in TERMINAL else None)(d.ctl_json("show", sid)),
        60,
        f"session {sid} to end",
    )


def events_of(path: str) -> list[dict[str, Any]]:
    with gzip.open(path) as fh:
        data: list[dict[str, Any]] = json.loads(fh.read())["traceEvents"]
    return data


def test_a_peer_cannot_report_into_another_jobs_session(daemon: Daemon, ctx: zmq.Context) -> None:
    victim = Peer(ctx, daemon, "victim", host="victim-node")
    attacker = Peer(ctx, daemon, "attacker", host="attacker-node")
    sid = daemon.ctl_json("start", "--job", "victim", "--next")["session"]
    arm = recv(victim.sock, "arm")
    real = '{"traceEvents": [{"name": "victim-event", "ph": "X", "ts": 1, "dur": 1}]}'
    trace = victim.capture(arm, real)
    s = wait_end(daemon, sid)
    assert s["state"] == "done", s
    [row] = daemon.ctl_json("traces", "--session", sid)
    assert [e["name"] for e in events_of(row["path"])] == ["victim-event"]

    # The attacker forges reports into the victim's session: its own content at the victim's
    # path, the victim's path as an extra file, a finished session, prefixes and patterns.
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text('{"traceEvents": [{"name": "forged", "ph": "X", "ts": 1, "dur": 1}]}')
    attacker.report(sid, [{"kind": "trace", "path": str(trace)}])
    attacker.report(sid, [{"kind": "memory", "path": row["path"]}])
    for bad in ("", sid[:-3] + "%", sid[:8]):
        attacker.sock.send(pack({"v": P.VERSION, "t": "captured", "id": 99, "session": bad,
                                 "job": "x", "cycle": 0, "steps": [1], "files": [],
                                 "started_at": 1.0, "ended_at": 2.0, "stall_ms": 1.0}))  # fmt: skip
        r = reply(attacker.sock)
        assert r is not None and r["t"] in ("ack", "error"), r
    # The victim's trace was neither overwritten, re-queued nor moved away.
    [again] = daemon.ctl_json("traces", "--session", sid)
    assert again["path"] == row["path"] and Path(row["path"]).is_file()
    assert [e["name"] for e in events_of(row["path"])] == ["victim-event"]
    assert daemon.ctl_json("show", sid)["state"] == "done"
    log = daemon.log.read_text()
    assert log.count(f"refused a capture report from pid {os.getpid()}") >= 2, log[-3000:]


def test_a_target_reports_only_its_own_files_while_capturing(
    daemon: Daemon, ctx: zmq.Context
) -> None:
    a = Peer(ctx, daemon, "shared", host="node-a")
    b_sock = dealer(ctx, daemon, "agent.sock")
    b_sock.send(pack({**HELLO, "job": "shared", "host": "node-b", "rank": 1}))
    recv(b_sock, "welcome")
    sid = daemon.ctl_json("start", "--job", "shared", "--next")["session"]
    arm = recv(a.sock, "arm")
    recv(b_sock, "arm")
    incoming = Path(arm["incoming"])
    mine = incoming / "c0" / "r-r0.pt.trace.json"
    theirs = incoming / "c0" / "r-r1.pt.trace.json"
    for p in (mine, theirs):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text('{"traceEvents": []}')
    # Not capturing yet: refused.
    a.report(sid, [{"kind": "trace", "path": str(mine)}])
    # Capturing, but naming rank 1's file, a cycle the session does not have, or a path that
    # only resolves to its own file: refused.
    a.send("progress", session=sid, state="capturing", step=1)
    a.report(sid, [{"kind": "trace", "path": str(theirs)}])
    a.report(sid, [{"kind": "trace", "path": str(mine)}], cycle=5)
    a.report(sid, [{"kind": "trace", "path": str(incoming / "c0" / ".." / "c0" / mine.name)}])
    assert theirs.is_file() and mine.is_file()
    assert daemon.ctl_json("traces", "--session", sid) == []
    # Its own file, exactly: accepted.
    a.report(sid, [{"kind": "trace", "path": str(mine)}])
    wait_for(lambda: daemon.ctl_json("traces", "--session", sid), 30, "the real report indexed")
    [row] = daemon.ctl_json("traces", "--session", sid)
    assert row["rank"] == 0 and theirs.is_file()
    assert daemon.log.read_text().count(f"refused a capture report from pid {os.getpid()}") == 4


def test_a_long_stall_while_capturing_is_not_a_death(daemon: Daemon, ctx: zmq.Context) -> None:
    # A raw peer on this node as this (alive) process: it captures, then goes silent for
    # longer than three heartbeats, as a training thread stopping the profiler on a huge
    # trace does. The same silence from a pid that no longer exists is a death.
    host = socket.gethostname()
    stalled = Peer(ctx, daemon, "stall", host=host)
    gone = spawn_peer(daemon, "stall", host=host, rank=1)
    # Both attached before the start: a peer still starting would get no arm, ever.
    wait_for(lambda: daemon.ctl_json("status")["clients"] == 2, 30, "both peers attached")
    sid = daemon.ctl_json("start", "--job", "stall", "--next")["session"]
    arm = recv(stalled.sock, "arm")
    stalled.send("progress", session=sid, state="capturing", step=1)
    assert read_line(gone, 30).strip() == b"capturing"
    assert daemon.ctl_json("status")["clients"] == 2
    gone.kill()
    gone.wait()
    ranks = lambda: {t["rank"]: t for t in daemon.ctl_json("show", sid)["targets"]}  # noqa: E731
    wait_for(lambda: ranks()[1]["state"] == "failed", 30, "the dead pid's target to fail")
    # Past three missed heartbeats the daemon notices the silence, and waits.
    wait_for(lambda: "silent for" in daemon.log.read_text(), 30, "the stall to be noticed")
    assert ranks()[0]["state"] == "capturing", ranks()
    assert [r["pid"] for r in daemon.ps()] == [os.getpid()]
    # The capture arrives late, and completes its session.
    trace = Path(arm["incoming"]) / "c0" / "r-r0.pt.trace.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text('{"traceEvents": []}')
    stalled.report(sid, [{"kind": "trace", "path": str(trace)}])
    stalled.send("progress", session=sid, state="done", step=2)
    s = wait_end(daemon, sid)
    t = {x["rank"]: x for x in s["targets"]}
    assert t[0]["state"] == "done" and t[0]["traces"] == 1, t
    assert s["state"] == "partial", s
