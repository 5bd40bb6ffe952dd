"""Hostile input on both sockets: every bad frame gets an error reply or is dropped, and
the daemon keeps serving well-formed requests afterwards. One peer, however fast it sends and
whatever it names, makes the daemon keep a bounded amount; one process or one user registers
a bounded number of peers."""

from __future__ import annotations

import json
import random
import sqlite3
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from harness import Daemon, wait_for
from prometheus_client.parser import text_string_to_metric_families
from rawpeer import HELLO, dealer, pack, reply, req, spawn_peers
from users import group_daemon

from profd_client import protocol as P


def assert_serving(ctx: zmq.Context, d: Daemon) -> None:
    s = req(ctx, d)
    s.send(pack({"v": 1, "t": "status"}))
    r = reply(s, 5000)
    assert r is not None and r["t"] == "ok", r
    a = dealer(ctx, d, "agent.sock")
    a.send(pack(HELLO))
    w = reply(a, 5000)
    assert w is not None and w["t"] == "welcome", w
    s.close()
    a.close()


#: Not a message: not msgpack, not a map, or no usable version and type. The daemon may
#: answer with an ``error`` or drop it.
MALFORMED = [
    b"",
    b"\xc1",  # never-used msgpack byte
    bytes(range(256)),  # 0x00 is a whole message (0); the rest is trailing garbage
    pack([1, 2, 3]),
    pack("hello"),
    pack({"t": "hello"}),  # no version
    pack({"v": "1", "t": "status"}),
    pack({"v": 1}),
    pack({"v": 1, "t": 5}),
    pack({1: 2}),
    b"\xdd\xff\xff\xff\xff",  # array header claiming 4G items
    b"\xdf\xff\xff\xff\xff",  # map header claiming 4G entries
]
#: Well-formed messages the daemon refuses: another protocol version, an unknown type, a
#: type the socket does not take, a hello that fails the schema or names an unsafe job.
#: A real (older, newer or buggy) client can send these, so each gets an ``error`` reply.
REFUSED = [
    pack({"v": 99, "t": "status"}),
    pack({"v": 1, "t": "no-such-type"}),
    pack({**HELLO, "rank": "zero"}),
    pack({**HELLO, "rank": True}),
    pack({k: v for k, v in HELLO.items() if k != "pid"}),
    pack({**HELLO, "job": "../../etc"}),
    pack({"v": 1, "t": "start", "spec": "x"}),
    pack({"v": 1, "t": "traces", "filters": {"bogus": 1}}),
]
BAD_FRAMES = MALFORMED + REFUSED


@pytest.mark.parametrize("sock", ["agent.sock", "control.sock"])
def test_bad_frames_get_errors_or_are_dropped(daemon: Daemon, ctx, sock: str) -> None:
    for frame in BAD_FRAMES:
        if sock == "control.sock":
            s = req(ctx, daemon)
            s.send(frame)
            r = reply(s)
            # REQ must get an answer to stay usable: every bad request gets an error reply.
            assert r is not None and r["t"] == "error", (frame[:40], r)
            s.close()
        else:
            s = dealer(ctx, daemon, sock)
            s.send(frame)
            r = reply(s, 1000)
            if frame in REFUSED:
                assert r is not None and r["t"] == "error", (frame[:40], r)
            else:
                assert r is None or r["t"] == "error", (frame[:40], r)
            s.close()
    # None of the bad hellos registered a process (each came from a socket of its own).
    assert not [p for p in daemon.ps() if p["host"] == HELLO["host"]]
    rnd = random.Random(1234)
    s = dealer(ctx, daemon, sock)
    for _ in range(300):
        s.send(bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 200))))
    s.close()
    assert_serving(ctx, daemon)


def test_agent_peers_cannot_start_sessions(daemon: Daemon, ctx) -> None:
    a = dealer(ctx, daemon, "agent.sock")
    a.send(pack(HELLO))
    assert reply(a)["t"] == "welcome"
    a.send(pack({"v": 1, "t": "start", "spec": {"steps": "3:5"}}))
    r = reply(a)
    assert r is not None and r["t"] == "error" and r["code"] == "type"
    assert daemon.ctl_json("sessions") == []


def test_unknown_client_is_told_to_register(daemon: Daemon, ctx) -> None:
    a = dealer(ctx, daemon, "agent.sock")
    a.send(pack({"v": 1, "t": "hb", "step": 5}))
    r = reply(a)
    assert r == {"v": 1, "t": "error", "code": "unknown_client", "msg": "say hello first"}


def test_oversized_frame_is_dropped(daemon: Daemon, ctx) -> None:
    for name in ("agent.sock", "control.sock"):
        s = dealer(ctx, daemon, name)
        s.send(b"x" * (P.MAX_FRAME_BYTES + 1024))
        assert reply(s, 1000) is None
        s.close()
    assert_serving(ctx, daemon)


def test_burst_of_10000_messages(daemon: Daemon, ctx) -> None:
    a = dealer(ctx, daemon, "agent.sock")
    a.setsockopt(zmq.SNDHWM, 0)
    a.setsockopt(zmq.RCVHWM, 0)
    a.send(pack(HELLO))
    assert reply(a)["t"] == "welcome"
    hb = pack({"v": 1, "t": "hb", "step": 1, "sps": 1.0})
    for i in range(10_000):
        a.send(hb if i % 2 else b"\x00garbage")
    got = 0
    while a.poll(3000):
        a.recv()
        got += 1
        if got == 10_000:
            break
    assert got == 10_000  # every frame answered: a heartbeat or an error
    c = dealer(ctx, daemon, "control.sock")
    for _ in range(10_000):
        c.send_multipart([b"", b"\x00garbage"])
    n = 0
    while c.poll(3000) and n < 10_000:
        c.recv_multipart()
        n += 1
    assert n == 10_000
    assert_serving(ctx, daemon)


FLOOD = """
[daemon]
max_regions_per_rank = 8
max_heartbeat_rate = 2
[metrics]
listen = "127.0.0.1:0"
"""


def region_names(beat: int) -> list[str]:
    """32 names of 200 characters, new at every heartbeat."""
    return [f"{beat:04d}-{j:02d}-".ljust(P.MAX_NAME, "x") for j in range(P.MAX_LEDGER_REGIONS)]


def scrape(d: Daemon, job: str) -> dict[str, list[Any]]:
    """``/metrics``' samples of ``job``'s ranks, by family."""
    addr = d.ctl_json("status")["metrics"]["listen"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        page = r.read().decode()
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(page):
        out[fam.name] = [x for x in fam.samples if x.labels.get("job") == job]
    return out


def test_a_flood_of_heartbeats_and_region_names_is_bounded(
    daemon_factory: Callable[..., Daemon], ctx: zmq.Context
) -> None:
    d = daemon_factory(config=FLOOD)
    job, beats = "flood", 200
    a = dealer(ctx, d, "agent.sock")
    a.setsockopt(zmq.SNDHWM, 0)
    a.setsockopt(zmq.RCVHWM, 0)
    a.send(pack({**HELLO, "v": P.VERSION, "job": job}))
    assert reply(a, 10_000)["t"] == "welcome"
    b = [1] + [0] * len(P.STEP_BUCKETS)
    for i in range(beats):  # as fast as the socket takes them, 32 new names each
        r = [[name, 0.0001, 1] for name in region_names(i)]
        led = {"at": i + 1, "n": 1, "sum": 0.001, "q": [0.001] * 4, "b": b, "r": r, "epoch": 0}
        a.send(pack({"v": P.VERSION, "t": P.HEARTBEAT, "step": i + 1, "ledger": led}))
    answered = 0
    while answered < beats and (m := reply(a, 10_000)) is not None:
        answered += m["t"] == P.HEARTBEAT
    assert answered == beats  # every heartbeat answered: the peer is never held up
    assert [p["job"] for p in d.ps()] == [job]  # and never dropped for it
    kept = set(region_names(0)[:8]) | {"(other)"}
    [top] = [t for t in d.ctl_json("top", "--once")["ranks"] if t["job"] == job]
    assert set(top["regions"]) <= kept and "(other)" in top["regions"], len(top["regions"])

    st = d.ctl_json("status")
    lim = st["limits"]
    # The first 8 names are the rank's; every other entry counts as "(other)".
    assert lim["regions_folded"] == beats * P.MAX_LEDGER_REGIONS - 8, lim
    # At most 2 a second are intervals of their own (a burst of 2 first): the rest waited.
    assert lim["heartbeats_coalesced"] >= beats // 2, lim
    assert lim["peers_refused"] == 0
    text = d.ctl("status").stdout
    assert f"limits   {lim['regions_folded']} region entries counted as (other)" in text, text

    # Coalesced, not lost: every step counts once the next tick applied what waited.
    def all_steps() -> dict[str, list[Any]] | None:
        m = scrape(d, job)
        return m if [x.value for x in m["profd_steps"]] == [beats] else None

    page = wait_for(all_steps, 20, "every heartbeat's step in /metrics")
    assert {x.labels["region"] for x in page["profd_region_seconds"]} == kept

    a.send(pack({"v": P.VERSION, "t": P.BYE}))  # its minute closes and goes to the index

    def minutes() -> list[tuple[int, str]] | None:
        con = sqlite3.connect(f"file:{d.state_dir / 'index.db'}?mode=ro", uri=True)
        try:
            q = "SELECT steps, regions FROM step_minutes WHERE job = ?"
            rows = con.execute(q, (job,)).fetchall()
        finally:
            con.close()
        return rows if sum(n for n, _ in rows) == beats else None

    for _, regions in wait_for(minutes, 30, "the rank's minutes in the index"):
        assert set(json.loads(regions)) <= kept
    a.close()


def test_peers_are_limited_per_process_and_per_user() -> None:
    limits = "max_peers_per_process = 3\nmax_peers_per_user = 5\n"
    with group_daemon(("profd-peer-a",), config=limits) as (d, (user,)):
        procs = []
        try:
            # One process asks for 6 peers: 3 are its own, then each is refused in a line.
            p, first = spawn_peers(d, 6, "many")
            procs.append(p)
            assert [t for t, _, _ in first] == ["welcome"] * 3 + ["error"] * 3 + ["welcome"]
            for _, code, msg in first[3:6]:
                assert code == "limit" and "\n" not in msg, msg
                assert msg == (
                    f"pid {p.pid} already has 3 peers attached, the most"
                    " [daemon] max_peers_per_process allows"
                )
            # Another process of the same user: 2 more make the user's 5.
            p, second = spawn_peers(d, 3, "more")
            procs.append(p)
            assert [t for t, _, _ in second] == ["welcome"] * 2 + ["error", "welcome"]
            assert second[2][1] == "limit" and "max_peers_per_user allows" in second[2][2]
            # Another user's peers are not the first user's.
            p, theirs = spawn_peers(d, 2, "theirs", popen=user.popen)
            procs.append(p)
            assert [t for t, _, _ in theirs] == ["welcome"] * 3
            assert len(d.ps()) == 7
            st = d.ctl_json("status")
            assert st["limits"]["peers_refused"] == 4 and st["clients"] == 7, st
            assert "limits   4 peer(s) refused" in d.ctl("status").stdout
        finally:
            for p in procs:
                p.kill()
                p.wait()


def test_a_peer_moves_to_another_rank_a_bounded_number_of_times(
    daemon: Daemon, ctx: zmq.Context
) -> None:
    # Each move closes the old rank's minute into the index: moving at every heartbeat
    # would write rows without end. An honest process moves once or twice in its life.
    a = dealer(ctx, daemon, "agent.sock")
    answers = []
    for i in range(10):
        a.send(pack({**HELLO, "v": P.VERSION, "job": f"mover-{i}"}))
        m = reply(a, 10_000)
        answers.append((m["t"], m.get("code"), m.get("msg")))
    assert [t for t, _, _ in answers] == ["welcome"] * 7 + ["error"] * 3, answers
    for _, code, msg in answers[7:]:
        assert code == "limit" and msg == (
            f"pid {HELLO['pid']} re-registered as another rank 6 times in 60 s, the most the"
            " daemon takes; it stays job mover-6 r rank 0"
        ), msg
    a.send(pack({**HELLO, "v": P.VERSION, "job": "mover-6"}))  # its own rank again: welcome
    assert reply(a, 10_000)["t"] == "welcome"
    assert [p["job"] for p in daemon.ps()] == ["mover-6"]
    assert daemon.ctl_json("status")["limits"]["peers_refused"] == 3
    a.close()
