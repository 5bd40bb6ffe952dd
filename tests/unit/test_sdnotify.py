"""sd_notify client: addresses, watchdog interval, message lines, never raising."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from profd.daemon.runtime import sdnotify
from profd.daemon.runtime.sdnotify import Notifier


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    s.bind(path)
    s.settimeout(5)
    yield s, path
    s.close()


def _fields(data: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in data.decode().split("\n"))


def test_parse_address() -> None:
    assert sdnotify.parse_address(None) is None
    assert sdnotify.parse_address("") is None
    assert sdnotify.parse_address("/run/systemd/notify") == "/run/systemd/notify"
    assert sdnotify.parse_address("@org/systemd/x") == "\0org/systemd/x"
    assert sdnotify.parse_address("vsock:2:1234") is None
    assert sdnotify.parse_address("relative/path") is None


def test_watchdog_timeout() -> None:
    assert sdnotify.watchdog_timeout({}, 10) is None
    assert sdnotify.watchdog_timeout({"WATCHDOG_USEC": "30000000"}, 10) == 30.0
    assert sdnotify.watchdog_timeout({"WATCHDOG_USEC": "0"}, 10) is None
    assert sdnotify.watchdog_timeout({"WATCHDOG_USEC": "soon"}, 10) is None
    env = {"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "10"}
    assert sdnotify.watchdog_timeout(env, 10) == 0.4
    # Meant for another process (we inherited it): not ours to ping.
    assert sdnotify.watchdog_timeout(env, 11) is None
    assert sdnotify.watchdog_timeout({**env, "WATCHDOG_PID": "x"}, 10) is None


def test_unset_is_a_silent_noop(caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier({"WATCHDOG_USEC": "1000000"}, pid=5)
    assert not n.enabled
    assert n.ping_every is None
    assert n.next_ping == float("inf")
    assert not n.ready("x") and not n.watchdog(0.0) and not n.stopping()
    assert caplog.records == []


def test_ready_status_mainpid(receiver: tuple[socket.socket, str]) -> None:
    s, path = receiver
    n = Notifier({"NOTIFY_SOCKET": path}, pid=4242)
    assert n.ready("listening on /run/profd\nsecond line")
    msg = s.recv(4096)
    assert b"\n\n" not in msg
    assert _fields(msg) == {
        "READY": "1",
        "MAINPID": "4242",
        "STATUS": "listening on /run/profd second line",
    }
    assert n.stopping()
    assert _fields(s.recv(4096)) == {"STOPPING": "1"}
    n.close()


def test_defaults_to_this_process(receiver: tuple[socket.socket, str]) -> None:
    s, path = receiver
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.ready()
    assert _fields(s.recv(4096)) == {"READY": "1", "MAINPID": str(os.getpid())}


def test_abstract_socket() -> None:
    name = f"profd-test-{uuid.uuid4().hex}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name}, pid=1)
        assert n.stopping("bye")
        assert _fields(s.recv(4096)) == {"STOPPING": "1", "STATUS": "bye"}
    finally:
        s.close()


def test_watchdog_pings_at_half_the_timeout(receiver: tuple[socket.socket, str]) -> None:
    s, path = receiver
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"}, pid=3)
    assert n.ping_every == 5.0
    assert n.watchdog(100.0)  # the first call pings at once
    assert s.recv(4096) == b"WATCHDOG=1"
    assert n.next_ping == 105.0
    assert not n.watchdog(104.9)
    assert n.watchdog(105.0)
    assert s.recv(4096) == b"WATCHDOG=1"
    assert n.next_ping == 110.0


def test_watchdog_pid_mismatch_means_no_pings(receiver: tuple[socket.socket, str]) -> None:
    s, path = receiver
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "77"}
    n = Notifier(env, pid=78)
    assert n.enabled and n.ping_every is None
    assert not n.watchdog(1e9)
    assert n.ready()  # other notifications still go out
    assert _fields(s.recv(4096))["READY"] == "1"


def test_unreachable_socket_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}, pid=1)
    with caplog.at_level(logging.DEBUG, logger="profd"):
        assert not n.ready()
        assert not n.stopping()
        assert not n.ready()
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "gone" in caplog.records[0].getMessage()


def test_full_receiver_does_not_block(tmp_path: Path) -> None:
    # A receiver that never reads: sends are dropped (EAGAIN), never waited on.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "full")
    s.bind(path)
    try:
        n = Notifier({"NOTIFY_SOCKET": path}, pid=1)
        results = [n.send({"STATUS": "x" * 1000}) for _ in range(5000)]
        assert results[0] and not results[-1]
    finally:
        s.close()
