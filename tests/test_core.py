"""The daemon, the client and the live listing, with real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness import BIN, Daemon, wait_for


def test_ps_shows_both_ranks_with_advancing_steps(daemon: Daemon, torchrun) -> None:
    job = torchrun("train.py", daemon=daemon, STEPS="400", STEP_SLEEP="0.02")
    rows = daemon.wait_attached(2, min_step=1)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        for key in (
            "host",
            "pid",
            "job",
            "role",
            "rank",
            "world_size",
            "step",
            "steps_per_s",
            "state",
        ):
            assert key in r
        assert r["role"] == "main"
        assert r["world_size"] == 2
        # No GPU here: NVML finds nothing and the columns stay empty, not an error.
        assert r["gpu_util"] is None and r["gpu_mem_bytes"] is None
    assert len({r["job"] for r in rows}) == 1
    first = {r["rank"]: r["step"] for r in rows}
    wait_for(
        lambda: (
            lambda rs: (
                rs
                if len(rs) == 2
                and all(r["step"] > first[r["rank"]] and r["steps_per_s"] > 0 for r in rs)
                else None
            )
        )(daemon.ps()),
        30,
        "steps to advance",
    )
    # The sampler fills cpu% and rss for both ranks within a few sample intervals.
    sampled = wait_for(
        lambda: (lambda rs: rs if len(rs) == 2 and all(r["rss_bytes"] for r in rs) else None)(
            daemon.ps()
        ),
        30,
        "cpu/rss samples",
    )
    assert all(r["cpu_percent"] is not None and r["rss_bytes"] > 10 << 20 for r in sampled)
    # Filters and the human table.
    assert daemon.ctl_json("ps", "--role", "ma*") != []
    assert daemon.ctl_json("ps", "--role", "actor") == []
    assert daemon.ctl_json("ps", "--job", rows[0]["job"]) != []
    human = daemon.ctl("ps")
    assert human.returncode == 0 and "STEPS/S" in human.stdout
    # profctl asks for a table; a profctl from before the table form asks without ``form``
    # and gets the same rows as maps.
    from profd.ctl.connection import Connection

    conn = Connection(str(daemon.runtime_dir), timeout_ms=30_000)
    try:
        for t in ("ps", "top"):
            table, maps = conn.request(t, form="table"), conn.request(t)
            assert set(table) == {"columns", "rows", "others"} and isinstance(maps, list), t
            assert [list(r) for r in maps] == [table["columns"]] * len(table["rows"]), t
            pid = table["columns"].index("pid")
            assert sorted(r["pid"] for r in maps) == sorted(r[pid] for r in table["rows"]), t
    finally:
        conn.close()
    job.kill()


def test_daemon_killed_and_restarted_mid_training(daemon: Daemon, torchrun) -> None:
    job = torchrun("train.py", daemon=daemon, STEPS="300", STEP_SLEEP="0.03")
    daemon.wait_attached(2, min_step=5)
    daemon.kill9()
    time.sleep(1.0)
    daemon.start()
    # Nothing tells the clients the daemon is back: they must notice and register again.
    rows = daemon.wait_attached(2, timeout=60)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert job.wait() == 0, job.output()
    results = job.results()
    assert sorted(r["steps"] for r in results) == [300, 300]


def test_no_daemon_job_finishes_and_attach_does_not_wait(torchrun) -> None:
    # PROFD_ATTACH_WAIT asks attach() to wait for a daemon, but with no daemon socket there is
    # nothing to wait for: were it to wait, the job would outlive job.wait()'s timeout.
    job = torchrun("train.py", daemon=None, STEPS="30", STEP_SLEEP="0", PROFD_ATTACH_WAIT="600")
    assert job.wait(timeout=300) == 0, job.output()
    results = job.results()
    assert len(results) == 2
    for r in results:
        assert r["steps"] == 30 and r["attached"] is True and r["connected"] is False, r


def test_status_and_no_daemon_errors(daemon: Daemon, tmp_path: Path) -> None:
    st = daemon.ctl_json("status")
    assert st["clients"] == 0 and st["version"]
    assert st["s3"]["configured"] is False
    # What start-up built is frozen out of the collector; the pauses are counted from then.
    assert st["gc"]["frozen_objects"] > 10_000 and len(st["gc"]["passes"]) == 3, st["gc"]
    assert "full pass(es)" in daemon.ctl("status").stdout
    env = dict(os.environ, PROFD_RUNTIME_DIR=str(tmp_path / "nowhere"))
    for args in (["status"], ["ps"], ["ps", "--json"]):
        r = subprocess.run([str(BIN / "profctl"), *args], env=env, capture_output=True, text=True)
        assert r.returncode == 3  # its own code: 2 is click's, for usage errors
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and str(tmp_path / "nowhere") in lines[0], r.stderr


def test_runtime_dir_permissions_and_single_daemon(daemon: Daemon) -> None:
    mode = daemon.runtime_dir.stat().st_mode & 0o777
    assert mode == 0o700
    for name in ("agent.sock", "control.sock"):
        assert (daemon.runtime_dir / name).stat().st_mode & 0o002 == 0
    second = subprocess.run(
        [str(BIN / "profd"), "run"], env=daemon.env(), capture_output=True, text=True, timeout=30
    )
    assert second.returncode != 0
    assert "already running" in second.stderr
    assert daemon.ctl("status").returncode == 0  # the first one is unharmed


def test_stale_socket_is_replaced(daemon_factory) -> None:
    d = daemon_factory()
    d.kill9()
    assert (d.runtime_dir / "control.sock").exists()  # left behind by the dead daemon
    d.start()
    assert d.ctl_json("status")["clients"] == 0


def test_sigterm_shuts_down_cleanly(daemon_factory) -> None:
    d = daemon_factory()
    assert d.stop() == 0
    assert not (d.runtime_dir / "agent.sock").exists()


def test_import_does_not_pull_daemon_dependencies() -> None:
    code = (
        "import sys, profd_client\n"
        "bad = [m for m in ('boto3', 'click', 'psutil', 'pynvml', 'torch') if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_disabled_client_starts_no_thread_and_no_socket(tmp_path: Path) -> None:
    code = (
        "import threading, torch, profd_client, json\n"
        "before = threading.active_count()\n"
        "ok = profd_client.attach()\n"
        "import sys\n"
        "print(json.dumps({'ok': ok, 'threads': threading.active_count() - before,"
        " 'zmq': 'zmq' in sys.modules}))\n"
    )
    env = dict(os.environ, PROFD_DISABLE="1", PROFD_RUNTIME_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"ok": False, "threads": 0, "zmq": False}
