"""profctl's plain-Python REQ peer (profd/ctl/zmtp.py) against a real libzmq ROUTER on a unix
socket, as the daemon's control.sock is: replies of every size, the limits, a peer that is
silent, gone, restarted or not ZeroMQ at all, and libzmq's own heartbeats."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from profd.ctl import zmtp

Answer = Callable[[bytes], "list[bytes] | None"]


class Router:
    """A ROUTER bound at ``path`` in a thread: each request's payload goes to ``answer``,
    which returns the reply's frames after the delimiter (None: no reply)."""

    def __init__(self, path: Path, answer: Answer, **opts: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for name, value in opts.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        self.sock.bind(f"ipc://{path}")
        self.answer = answer
        self.seen: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, delimiter, payload = self.sock.recv_multipart()
            assert delimiter == b""
            self.seen.append(payload)
            reply = self.answer(payload)
            if reply is not None:
                self.sock.send_multipart([ident, b"", *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "control.sock"


@pytest.fixture
def echo(path: Path) -> Iterator[Router]:
    r = Router(path, lambda payload: [b"re:" + payload])
    yield r
    r.close()


@pytest.mark.parametrize("size", [0, 1, 255, 256, 70_000, 3 << 20])
def test_a_request_and_its_reply_arrive_whole_at_every_size(
    echo: Router, path: Path, size: int
) -> None:
    req = zmtp.ReqSocket(str(path), max_reply=8 << 20)
    payload = bytes(i % 251 for i in range(size))
    assert req.request(payload, 10) == b"re:" + payload
    assert echo.seen == [payload]
    req.close()


def test_requests_go_in_order_on_one_connection(echo: Router, path: Path) -> None:
    req = zmtp.ReqSocket(str(path), max_reply=1 << 20)
    for i in range(50):
        assert req.request(b"%d" % i, 10) == b"re:%d" % i
    req.close()


def test_a_reply_over_the_limit_is_refused_and_the_next_request_connects_anew(
    path: Path,
) -> None:
    r = Router(path, lambda p: [b"x" * (int(p) if p else 0)])
    try:
        req = zmtp.ReqSocket(str(path), max_reply=1000)
        with pytest.raises(zmtp.Error, match="a reply of 1001 bytes") as exc:
            req.request(b"1001", 10)
        assert exc.value.sent
        assert req.request(b"1000", 10) == b"x" * 1000
        req.close()
    finally:
        r.close()


def test_a_reply_of_several_frames_is_not_taken_for_one(path: Path) -> None:
    r = Router(path, lambda p: [b"a", b"b"])
    try:
        with pytest.raises(zmtp.Error, match="a reply of 3 frames"):
            zmtp.ReqSocket(str(path), 1000).request(b"q", 10)
    finally:
        r.close()


def test_a_silent_peer_times_out_at_the_deadline(path: Path) -> None:
    r = Router(path, lambda p: None)
    try:
        req = zmtp.ReqSocket(str(path), 1000)
        t0 = time.monotonic()
        with pytest.raises(zmtp.Timeout) as exc:
            req.request(b"q", 0.5)
        waited = time.monotonic() - t0
        assert exc.value.sent and 0.5 <= waited < 5, waited
        assert r.seen == [b"q"]
    finally:
        r.close()


def test_a_socket_file_nobody_listens_on_is_said_at_once(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the file stays, as a killed daemon leaves it
    assert path.exists()
    t0 = time.monotonic()
    with pytest.raises(zmtp.Error, match="nothing listens on it") as exc:
        zmtp.ReqSocket(str(path), 1000).request(b"q", 10)
    assert not exc.value.sent and time.monotonic() - t0 < 5


def test_a_restarted_peer_is_reached_on_a_new_connection(path: Path) -> None:
    first = Router(path, lambda p: [b"first"])
    req = zmtp.ReqSocket(str(path), 1000)
    assert req.request(b"q", 10) == b"first"
    first.close()
    path.unlink(missing_ok=True)
    second = Router(path, lambda p: [b"second"])
    try:
        # The kept connection ended with the first peer: the request is not lost in it.
        assert req.request(b"q", 10) == b"second"
        assert second.seen == [b"q"]
    finally:
        req.close()
        second.close()


def test_a_peer_that_dies_before_it_answers_is_an_error_not_a_hang(path: Path) -> None:
    got = threading.Event()
    r = Router(path, lambda p: (got.set(), None)[1])
    req = zmtp.ReqSocket(str(path), 1000)
    killer = threading.Thread(target=lambda: (got.wait(10), r.close()))
    killer.start()
    try:
        with pytest.raises(zmtp.Error, match="closed the connection") as exc:
            req.request(b"q", 10)
        assert exc.value.sent
    finally:
        killer.join(10)


def test_libzmq_heartbeats_are_answered_while_a_reply_is_awaited(path: Path) -> None:
    # The peer pings every 50 ms and drops a connection silent for 200 ms: a reply that
    # takes a second comes only to a peer that answers the pings.
    r = Router(
        path,
        lambda p: (time.sleep(1.0), [b"late"])[1],
        HEARTBEAT_IVL=50,
        HEARTBEAT_TIMEOUT=200,
    )
    try:
        assert zmtp.ReqSocket(str(path), 1000).request(b"q", 10) == b"late"
    finally:
        r.close()


def test_a_peer_that_is_not_zeromq_is_named(path: Path) -> None:
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def speak() -> None:
        conn, _ = srv.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(64))
        time.sleep(0.5)
        conn.close()

    t = threading.Thread(target=speak)
    t.start()
    try:
        with pytest.raises(zmtp.Error, match="does not speak ZMTP 3") as exc:
            zmtp.ReqSocket(str(path), 1000).request(b"q", 10)
        assert not exc.value.sent
    finally:
        t.join(5)
        srv.close()


def _greeting() -> bytes:
    return b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)


@pytest.mark.parametrize(
    "after_greeting",
    [
        b"\x06" + (1 << 62).to_bytes(8, "big"),  # a command "of" 4 EiB
        b"\x06" + (2**64 - 1).to_bytes(8, "big"),
        b"\x04\x05\x05READY",  # READY without its Socket-Type
        b"\x04\x00",  # an empty command
        b"\x00\x01x",  # a message before READY
        b"\xf0\x00",  # flags no ZMTP has
    ],
    ids=["huge-command", "largest-size", "no-socket-type", "empty-command", "early", "flags"],
)
def test_a_lying_peer_is_an_error_never_a_crash_or_a_wait(
    path: Path, after_greeting: bytes
) -> None:
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def speak() -> None:
        conn, _ = srv.accept()
        conn.sendall(_greeting() + after_greeting)
        conn.settimeout(5)
        with contextlib.suppress(OSError):  # open until the client gives up: no EOF to blame
            while conn.recv(4096):
                pass
        conn.close()

    t = threading.Thread(target=speak)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(zmtp.Error):
            zmtp.ReqSocket(str(path), 1000).request(b"q", 10)
        assert time.monotonic() - t0 < 2.5, "it waited for more of a frame no peer would send"
    finally:
        t.join(5)
        srv.close()
