"""profd under systemd, tested without systemd as PID 1.

The notify protocol is tested against a real daemon and a datagram socket the test owns in
systemd's place: READY=1 once the sockets exist, WATCHDOG=1 while the loop runs, STOPPING=1
on SIGTERM, each from the daemon's own pid (what ``NotifyAccess=main`` accepts). The unit file
is checked with ``systemd-analyze verify`` where that binary exists.
"""

from __future__ import annotations

import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import ROOT, Daemon

from profd_client import protocol as P

UNIT = ROOT / "systemd" / "profd.service"
UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


@dataclass
class Note:
    fields: dict[str, str]
    pid: int


class FakeSystemd:
    """An abstract ``AF_UNIX`` datagram socket standing in for systemd's notify socket."""

    def __init__(self) -> None:
        self.name = f"@profd-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # The kernel attaches the sender's pid, as systemd gets it to enforce NotifyAccess=.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + self.name[1:])

    def recv(self, timeout: float) -> Note | None:
        self.sock.settimeout(timeout)
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(UCRED.size))
        except TimeoutError:
            return None
        pid = -1
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = UCRED.unpack(payload[: UCRED.size])[0]
        fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
        return Note(fields, pid)

    def wait(self, key: str, timeout: float, seen: list[Note]) -> Note:
        """The next notification carrying ``key``; every one received lands in ``seen``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            note = self.recv(left)
            if note is None:
                break
            seen.append(note)
            if key in note.fields:
                return note
        raise AssertionError(f"no {key}= within {timeout}s; got {[n.fields for n in seen]}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake_systemd() -> Iterator[FakeSystemd]:
    s = FakeSystemd()
    yield s
    s.close()


def test_notify_ready_watchdog_stopping(
    daemon_factory: Callable[..., Daemon], fake_systemd: FakeSystemd
) -> None:
    d = daemon_factory(
        start=False, NOTIFY_SOCKET=fake_systemd.name, WATCHDOG_USEC="400000", WATCHDOG_PID=""
    )
    d.start(wait=False)
    assert d.proc is not None
    pid = d.proc.pid
    seen: list[Note] = []

    ready = fake_systemd.wait("READY", 60, seen)
    # READY is the first word, sent only once clients can connect.
    assert len(seen) == 1
    assert ready.fields["READY"] == "1"
    assert ready.fields["MAINPID"] == str(pid)
    assert str(d.runtime_dir) in ready.fields["STATUS"]
    for name in (P.AGENT_SOCKET, P.CONTROL_SOCKET):
        assert stat.S_ISSOCK((d.runtime_dir / name).stat().st_mode)
    assert d.ctl("status").returncode == 0

    # The loop keeps the watchdog alive, idle or not.
    for _ in range(5):
        assert fake_systemd.wait("WATCHDOG", 30, seen).fields == {"WATCHDOG": "1"}
    assert d.ctl("status").returncode == 0
    assert fake_systemd.wait("WATCHDOG", 30, seen).fields == {"WATCHDOG": "1"}

    assert d.stop() == 0  # SIGTERM, reaped
    stopping = fake_systemd.wait("STOPPING", 30, seen)
    assert stopping.fields["STOPPING"] == "1"
    assert fake_systemd.recv(0.5) is None  # nothing after STOPPING
    assert sum("READY" in n.fields for n in seen) == 1
    # Only the main process speaks (NotifyAccess=main); pipeline workers and nsys stay quiet.
    assert {n.pid for n in seen} == {pid}


def test_watchdog_pid_of_another_process_no_pings(
    daemon_factory: Callable[..., Daemon], fake_systemd: FakeSystemd
) -> None:
    # A WATCHDOG_PID naming another process: the daemon must not ping for it.
    d = daemon_factory(NOTIFY_SOCKET=fake_systemd.name, WATCHDOG_USEC="400000", WATCHDOG_PID="1")
    seen: list[Note] = []
    fake_systemd.wait("READY", 60, seen)
    assert d.ctl("status").returncode == 0
    assert d.stop() == 0
    fake_systemd.wait("STOPPING", 30, seen)
    assert not any("WATCHDOG" in n.fields for n in seen), seen


def _unit_settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line.strip())
        if m:
            out.setdefault(m[1], []).append(m[2].strip())
    return out


def test_unit_is_notify_and_hardened() -> None:
    u = _unit_settings(UNIT.read_text())
    assert u["Type"] == ["notify"]
    assert u["NotifyAccess"] == ["main"]
    assert int(u["WatchdogSec"][0]) > 0
    assert u["Restart"] == ["on-failure"]  # includes watchdog timeouts
    assert u["AmbientCapabilities"] == [""]
    assert set(u["CapabilityBoundingSet"][0].split()) == {
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FOWNER",
        "CAP_SYS_PTRACE",
    }
    for key in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectClock",
        "ProtectHostname",
        "RestrictNamespaces",
        "LockPersonality",
        "RestrictRealtime",
        "RestrictSUIDSGID",
    ):
        assert u[key] == ["yes"], key
    assert u["ProtectSystem"] == ["strict"]
    # NVML needs /dev/nvidia*; the sampler reads other users' /proc entries.
    assert "PrivateDevices" not in u and "ProtectProc" not in u
    assert u["Group"] == ["profd"] and u["UMask"] == ["0007"]


def test_no_cap_kill_needed() -> None:
    # The unit drops CAP_KILL on the grounds that the daemon signals nobody: keep it true.
    # faults.py (the crash-test switch) kills the daemon itself, from the daemon or its own
    # worker: the same uid, which needs no CAP_KILL.
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "profd" / "daemon").glob("*.py"))
        if p.name != "faults.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bos\.(kill|killpg)\(|\.send_signal\(", line)
    ]
    assert hits == [], "the daemon signals processes: CAP_KILL belongs in the unit"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd): unit not verified")
    # verify checks that ExecStart's binary exists: point it at one that does.
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/profd " in text
    copy = tmp_path / "profd.service"
    copy.write_text(text.replace("ExecStart=/usr/local/bin/profd ", f"ExecStart={sys.executable} "))
    r = subprocess.run([exe, "verify", str(copy)], capture_output=True, text=True, timeout=120)
    ours = [ln for ln in (r.stdout + r.stderr).splitlines() if "profd.service" in ln]
    assert r.returncode == 0 and ours == [], r.stdout + r.stderr
