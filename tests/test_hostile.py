"""Hostile input on both sockets: every bad frame gets an error reply or is dropped, and
the daemon keeps serving well-formed requests afterwards."""

from __future__ import annotations

import random

import pytest
import zmq
from harness import Daemon
from rawpeer import HELLO, dealer, pack, reply, req

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
