"""Each hostile-input defect found in review, reproduced against a real daemon with raw peers.

Every test here crashed, hung or corrupted the landed daemon; each must now be refused with a
``bad_request`` that names the field (or survived), with no traceback in the daemon's log.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgpack
import zmq
from daemonproc import BIN, wait_for
from harness import Daemon
from rawpeer import HELLO, dealer, pack, recv, reply, req

from profd.states import TERMINAL
from profd_client import protocol as P

NOBODY = 65534


def control(ctx: zmq.Context, d: Daemon, msg: dict[str, Any]) -> dict[str, Any]:
    s = req(ctx, d)
    s.send(pack({"v": P.VERSION, **msg}))
    r = reply(s, 10_000)
    s.close()
    assert r is not None, f"no reply to {msg}"
    return r


def no_traceback(d: Daemon) -> None:
    log = d.log.read_text()
    assert "Traceback" not in log, log[-3000:]


def alive(ctx: zmq.Context, d: Daemon) -> None:
    assert d.proc is not None and d.proc.poll() is None, d.log.read_text()[-3000:]
    assert control(ctx, d, {"t": "status"})["t"] == "ok"


def test_huge_rank_is_refused_and_a_report_cannot_crash_indexing(
    daemon: Daemon, ctx: zmq.Context
) -> None:
    a = dealer(ctx, daemon, "agent.sock")
    a.send(pack({**HELLO, "rank": 1 << 63}))
    err = recv(a, "error")
    assert err["code"] == "bad_request" and "hello.rank" in err["msg"], err
    # The largest accepted rank goes all the way through a capture report and the index.
    a.send(pack({**HELLO, "rank": P.MAX_RANK, "world_size": P.MAX_RANK + 1}))
    recv(a, "welcome")
    sid = daemon.ctl_json("start", "--next")["session"]
    arm = recv(a, "arm")
    trace = Path(arm["incoming"]) / "c0" / f"r-r{P.MAX_RANK}.pt.trace.json"
    trace.parent.mkdir(parents=True)
    trace.write_text('{"traceEvents": []}')
    a.send(pack({"v": 1, "t": "progress", "id": 3, "session": sid, "state": "capturing",
                 "step": 9}))  # fmt: skip
    recv(a, "ack")
    a.send(pack({"v": 1, "t": "captured", "id": 1, "session": sid, "job": "j", "cycle": 0,
                 "steps": arm["cycles"][0][1:2], "files": [{"kind": "trace", "path": str(trace)}],
                 "started_at": 1.0, "ended_at": 2.0, "stall_ms": 1.0}))  # fmt: skip
    recv(a, "ack")
    a.send(pack({"v": 1, "t": "progress", "id": 2, "session": sid, "state": "done", "step": 9}))
    recv(a, "ack")
    s = wait_for(
        lambda: (lambda r: r if r["state"] in TERMINAL else None)(daemon.ctl_json("show", sid)),
        60,
        "session end",
    )
    assert s["targets"][0]["rank"] == P.MAX_RANK
    alive(ctx, daemon)
    no_traceback(daemon)


def test_huge_heartbeat_step_cannot_make_next_unencodable(daemon: Daemon, ctx: zmq.Context) -> None:
    a = dealer(ctx, daemon, "agent.sock")
    a.send(pack(HELLO))
    recv(a, "welcome")
    a.send(pack({"v": 1, "t": "hb", "step": (1 << 64) - 1}))
    assert "hb.step" in recv(a, "error")["msg"]
    # The largest step a heartbeat may carry: --next is refused in one line, nothing re-arms.
    a.send(pack({"v": 1, "t": "hb", "step": P.MAX_STEP, "sps": P.MAX_RATE}))
    recv(a, "hb")
    r = daemon.ctl("start", "--next")
    assert r.returncode == 1 and "beyond" in r.stderr and len(r.stderr.splitlines()) == 1
    alive(ctx, daemon)
    no_traceback(daemon)


def test_label_and_region_must_be_strings_and_sessions_survive_a_restart(
    daemon: Daemon, ctx: zmq.Context
) -> None:
    a = dealer(ctx, daemon, "agent.sock")
    a.send(pack(HELLO))
    recv(a, "welcome")
    for field, value in (("label", {"a": 1}), ("label", [1]), ("region", {}), ("region", 123)):
        r = control(ctx, daemon, {"t": "start", "spec": {"next": True, field: value}})
        assert r["t"] == "error" and r["code"] == "bad_request", r
        assert f"spec.{field}" in r["msg"], r
    good = daemon.ctl_json("start", "--next", "--label", "kept")["session"]
    daemon.stop()
    daemon.start()
    assert daemon.ctl_json("show", good)["label"] == "kept"
    assert "cannot write the index" not in daemon.log.read_text()
    no_traceback(daemon)


def test_oversized_schedules_and_rank_lists_are_refused_at_once(
    daemon: Daemon, ctx: zmq.Context
) -> None:
    a = dealer(ctx, daemon, "agent.sock")
    a.send(pack(HELLO))
    recv(a, "welcome")
    for args, needle in (
        (("--next", "--repeat", "2000000"), "--repeat must be at most 1000 (got 2000000)"),
        (("--ranks", "0-20000000"), "ranks go up to"),
        (("--ranks", "0-200000"), "more than"),
        (("--steps", "1000:5001000"), "more than 10000"),
        (("--steps", ",".join(map(str, range(2, 1100)))), "at most 1000"),
    ):
        # A hang guard, not a timing threshold: each once blocked the loop for seconds.
        r = daemon.ctl("start", *args, timeout=30)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert needle in r.stderr and len(r.stderr.splitlines()) == 1, (args, r.stderr)
    alive(ctx, daemon)
    no_traceback(daemon)


def test_an_arm_a_client_cannot_follow_fails_the_rank_instead_of_hanging(
    daemon: Daemon, tmp_path: Path
) -> None:
    # The real client (profd_client) receives an arm whose region it cannot use; the daemon
    # validates outbound frames too, so the bad arm is forged here by a raw ROUTER in the
    # daemon's place, and the client must answer with a failed progress naming the field.
    rdir = tmp_path / "fake"
    rdir.mkdir(mode=0o700)
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{rdir / 'agent.sock'}")
    code = (
        "import profd_client, time\n"
        "profd_client.attach(job='j', role='r', step='manual')\n"
        "for _ in range(200):\n"
        "    profd_client.step(); time.sleep(0.02)\n"
    )
    env = dict(os.environ, PROFD_RUNTIME_DIR=str(rdir), PROFD_HB_INTERVAL="0.2")
    proc = subprocess.Popen([str(BIN / "python"), "-c", code], env=env)
    try:
        assert router.poll(20_000)
        ident, frame = router.recv_multipart()
        hello = msgpack.unpackb(frame)
        assert hello["t"] == "hello"
        router.send_multipart([ident, pack({"v": hello["v"], "t": "welcome", "spool": "/tmp",
                                            "hb_interval": 0.2, "daemon": "x"})])  # fmt: skip
        router.send_multipart([ident, pack({"v": hello["v"], "t": "arm", "session": "s-1",
                                            "job": "j", "backend": "torch",
                                            "cycles": [[50, 50, 51]], "options": {},
                                            "region": 123, "incoming": "/tmp"})])  # fmt: skip
        while True:
            assert router.poll(10_000), "the client never said it cannot follow the arm"
            m = msgpack.unpackb(router.recv_multipart()[1])
            if m["t"] == "progress":
                break
        assert m["session"] == "s-1" and m["state"] == "failed", m
        assert "arm.region" in m["error"], m
        assert proc.wait(60) == 0  # and training went on
    finally:
        proc.kill()
        router.close(0)


def test_infinite_rates_and_bad_pids_never_reach_the_registry(
    daemon: Daemon, ctx: zmq.Context
) -> None:
    a = dealer(ctx, daemon, "agent.sock")
    a.send(pack({**HELLO, "pid": -1}))
    assert "hello.pid" in recv(a, "error")["msg"]
    a.send(pack(HELLO))
    recv(a, "welcome")
    for sps in (math.inf, math.nan, -math.inf):
        a.send(pack({"v": 1, "t": "hb", "step": 10, "sps": sps}))
        assert "hb.sps" in recv(a, "error")["msg"]
    assert daemon.ctl("start", "--next").returncode == 0
    out = daemon.ctl("ps", "--json").stdout
    json.loads(out, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    alive(ctx, daemon)
    no_traceback(daemon)


WRONG_TYPES: list[dict[str, Any]] = [
    {"t": "traces", "filters": {"rank": "zero"}},
    {"t": "traces", "filters": {"limit": -5}},
    {"t": "traces", "filters": {"since": "yesterday"}},
    {"t": "traces", "filters": {"job": ["a"]}},
    {"t": "traces", "filters": {"nope": 1}},
    {"t": "traces", "filters": []},
    {"t": "start", "spec": {"pids": "1"}},
    {"t": "start", "spec": {"roles": [1]}},
    {"t": "start", "spec": {"steps": [1, 2]}},
    {"t": "start", "spec": {"at_step": 1.5}},
    {"t": "start", "spec": {"options": []}},
    {"t": "sessions", "limit": "10"},
    {"t": "sessions", "state": "bogus"},
    {"t": "show", "session": ""},
    {"t": "stop", "session": 5},
    {"t": "retry", "session": ["x"]},
]


def test_wrong_typed_requests_are_bad_requests_naming_the_field(
    daemon: Daemon, ctx: zmq.Context
) -> None:
    for msg in WRONG_TYPES:
        r = control(ctx, daemon, msg)
        assert r["t"] == "error" and r["code"] == "bad_request", (msg, r)
        field = next(k for k in msg if k != "t")
        assert f"{msg['t']}.{field}" in r["msg"], (msg, r)
    alive(ctx, daemon)
    no_traceback(daemon)


def _fake_daemon(rdir: Path, answer: bytes | None) -> threading.Thread:
    """A lying peer in the daemon's place on control.sock: answers every request with
    ``answer`` (raw bytes)."""
    rdir.mkdir(mode=0o700, exist_ok=True)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 5000)  # a large answer must leave before the close
    sock.bind(f"ipc://{rdir / 'control.sock'}")

    def serve() -> None:
        try:
            if sock.poll(30_000):
                frames = sock.recv_multipart()
                sock.send_multipart([*frames[:-1], answer or b""])
        finally:
            sock.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return th


def _profctl(rdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PROFD_RUNTIME_DIR=str(rdir))
    return subprocess.run(
        [str(BIN / "profctl"), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_profctl_gives_one_line_for_other_versions_and_oversized_replies(tmp_path: Path) -> None:
    cases = [
        (pack({"v": 99, "t": "ok", "data": {}}), "protocol version"),
        (pack({"v": 99, "t": "error", "code": "version", "msg": "speaks 99"}), "protocol"),
        (pack({"v": P.VERSION, "t": "ok", "data": "x" * (2 << 20)}), "bad reply"),
        (b"\xc1garbage", "bad reply"),
    ]
    for i, (answer, needle) in enumerate(cases):
        rdir = tmp_path / f"r{i}"
        th = _fake_daemon(rdir, answer)
        r = _profctl(rdir, "status")
        th.join(5)
        assert r.returncode == 1, (needle, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert needle in r.stderr, r.stderr


def test_profctl_permission_denied_is_one_line() -> None:
    # CI runs as root, for whom every file is accessible: profctl runs as an unprivileged
    # user against a root daemon whose runtime dir (0700) it can see but not enter, then
    # against one whose socket (0600) it can see but not open.
    root = Path(tempfile.mkdtemp(prefix="profd-perm-"))
    root.chmod(0o711)
    d = Daemon(root)
    try:
        d.start()
        for mode in (0o700, 0o711):
            d.runtime_dir.chmod(mode)
            r = subprocess.run(
                [str(BIN / "profctl"), "status"],
                env=dict(d.env(), HOME="/tmp"),
                capture_output=True,
                text=True,
                timeout=60,
                user=NOBODY,
                group=NOBODY,
            )
            assert r.returncode == 1, (mode, r.stdout, r.stderr)
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and "permission denied" in lines[0], (mode, r.stderr)
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_clients_of_other_versions(daemon: Daemon, ctx: zmq.Context) -> None:
    # A job started before an upgrade (protocol 1) is served in its own version.
    old = dealer(ctx, daemon, "agent.sock")
    old.send(pack({**HELLO, "v": 1}))
    w = recv(old, "welcome")
    assert w["v"] == 1 and "protocol" not in w
    new = dealer(ctx, daemon, "agent.sock")
    new.send(pack({**HELLO, "v": 2, "host": "another-node", "rank": 1}))
    w = recv(new, "welcome")
    assert w["v"] == 2 and w["protocol"] == [P.MIN_VERSION, P.VERSION]
    sid = daemon.ctl_json("start", "--next")["session"]
    assert recv(old, "arm")["v"] == 1 and recv(new, "arm")["v"] == 2
    assert daemon.ctl_json("show", sid)["state"] in ("pending", "armed")

    # An unsupported one gets an error it can read (in its version), a warning in the log,
    # and a row in ps: it is not silently invisible.
    future = dealer(ctx, daemon, "agent.sock")
    future.send(pack({**HELLO, "v": 99, "pid": 4242, "job": "upgraded-later"}))
    err = recv(future, "error")
    assert err["v"] == 99 and err["code"] == "version"
    assert f"{P.MIN_VERSION}..{P.VERSION}" in err["msg"]
    rows = daemon.ctl_json("ps")
    [row] = [r for r in rows if r["state"] == "incompatible"]
    assert row["protocol"] == 99 and row["pid"] == 4242 and row["job"] == "upgraded-later"
    human = daemon.ctl("ps").stdout
    assert "incompatible" in human, human
    assert "protocol version 99" in daemon.log.read_text()
    no_traceback(daemon)


def _client_against(router: zmq.Socket, rdir: Path, steps: int = 150) -> subprocess.Popen[bytes]:
    code = (
        "import profd_client, time\n"
        "profd_client.attach(job='j', role='r', step='manual')\n"
        f"for _ in range({steps}):\n"
        "    profd_client.step(); time.sleep(0.02)\n"
        "print('TRAINED')\n"
    )
    env = dict(os.environ, PROFD_RUNTIME_DIR=str(rdir), PROFD_HB_INTERVAL="0.2")
    return subprocess.Popen(
        [str(BIN / "python"), "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def test_a_client_steps_down_to_an_older_daemons_version(tmp_path: Path) -> None:
    # A raw ROUTER plays a daemon that speaks only protocol 1 (as wave 1's did).
    rdir = tmp_path / "old"
    rdir.mkdir(mode=0o700)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(f"ipc://{rdir / 'agent.sock'}")
    proc = _client_against(router, rdir)
    try:
        seen = []
        while True:
            assert router.poll(20_000), f"no hello in version 1 (saw {seen})"
            ident, frame = router.recv_multipart()
            m = msgpack.unpackb(frame)
            if m["t"] != "hello":
                continue
            seen.append(m["v"])
            if m["v"] != 1:
                refusal = {"v": 1, "t": "error", "code": "version", "msg": "unsupported"}
                router.send_multipart([ident, pack(refusal)])
                continue
            welcome = {"v": 1, "t": "welcome", "spool": "/tmp", "hb_interval": 0.2, "daemon": "0"}
            router.send_multipart([ident, pack(welcome)])
            break
        assert seen[0] == P.VERSION and seen[-1] == 1
        # Now profilable in version 1: an arm in version 1 is acknowledged as armed.
        router.send_multipart([ident, pack({"v": 1, "t": "arm", "session": "s-1", "job": "j",
                                            "backend": "torch", "cycles": [[140, 140, 141]],
                                            "options": {"activities": ["cpu"]},
                                            "incoming": str(tmp_path)})])  # fmt: skip
        while True:
            assert router.poll(10_000), "no armed"
            m = msgpack.unpackb(router.recv_multipart()[1])
            if m["t"] == "armed":
                break
        assert m["v"] == 1 and m["session"] == "s-1"
    finally:
        proc.kill()
        router.close(0)


def test_a_client_no_daemon_version_fits_keeps_training(tmp_path: Path) -> None:
    rdir = tmp_path / "future"
    rdir.mkdir(mode=0o700)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(f"ipc://{rdir / 'agent.sock'}")
    proc = _client_against(router, rdir, steps=100)
    try:
        # A daemon that refuses every version this client speaks.
        while proc.poll() is None:
            if router.poll(200):
                ident, frame = router.recv_multipart()
                m = msgpack.unpackb(frame)
                refusal = {"v": m["v"], "t": "error", "code": "version", "msg": "speaks 7..9"}
                router.send_multipart([ident, pack(refusal)])
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        router.close(0)
    assert proc.returncode == 0 and b"TRAINED" in out, err
    warnings = [line for line in err.decode().splitlines() if "refused this client" in line]
    assert len(warnings) == 1 and "7..9" in warnings[0], err
