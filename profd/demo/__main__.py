"""``python -m profd.demo``: run the whole loop on this machine, CPU only.

Starts ``profd run`` with temporary dirs, launches a 2-rank ``torchrun`` job that uses the
two-line integration, shows ``profctl ps`` and ``profctl top`` while it trains, captures
three steps on both ranks, and prints the session, the indexed traces, a summary and the
cross-rank report of the capture (``profctl report``: text here, the HTML page beside the
spool). Then it turns sampling on (``[watch] sample_every``, re-read on SIGHUP), slows rank 1
on purpose, and ends with the ``straggler`` incident profd records by itself from the next
sample, and the comparison of its automatic capture (``profctl incident``). Then rank 1's
data loader stalls once for 3 s: a ``spike`` incident whose frozen black box names the rank
the other waited for and the function it sat in. Last, one
``profctl query`` over the warehouse the daemon exports to (a local directory here): the
demo job's captures and incidents, as any SQL engine would read them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from profd.states import TERMINAL

BIN = Path(sys.executable).parent
JOB = Path(__file__).with_name("train_job.py")


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def ctl(env: dict[str, str], *args: str, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    if not quiet:
        print(f"$ profctl {' '.join(args)}", flush=True)
    r = subprocess.run([str(BIN / "profctl"), *args], env=env, text=True, capture_output=True)
    if not quiet:
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        sys.stderr.flush()
    if r.returncode != 0:
        raise SystemExit(f"demo: profctl {args[0]} failed")
    return r


def wait_for_ranks(env: dict[str, str], n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(
            [str(BIN / "profctl"), "ps", "--json"], env=env, text=True, capture_output=True
        )
        if r.returncode == 0:
            rows = json.loads(r.stdout)
            if len(rows) >= n and all(x["step"] > 5 for x in rows):
                return
        time.sleep(0.3)
    raise SystemExit("demo: the training job did not attach in time")


#: The daemon's [watch] once the demo turns sampling on: a sample of 4 steps every 50 steps
#: (the straggler rule reads every sample), a short cooldown.
WATCH_ON = """
[watch]
sample_every = 50
sample_steps = 4
"""
#: The export writes its Parquet objects every few seconds (under the state dir), so they
#: are on disk by the end; ``profctl query`` reads what is not written yet from the daemon.
WAREHOUSE = """
[warehouse]
flush_every = 2.0
"""
#: What the demo recorded about its job, from the warehouse: captures by label, incidents by
#: kind, with the rank-seconds each kind cost.
DEMO_SQL = """SELECT 'capture' AS what, coalesce(label, '-') AS detail,
       count(DISTINCT session) AS count, count(DISTINCT rank) AS ranks,
       NULL AS lost_rank_s, min(created) AS first
FROM captures WHERE job = 'demo' GROUP BY label
UNION ALL
SELECT 'incident', kind || ' (' || state || ')', count(*), max(len(suspects)),
       sum(lost_rank_s), min(detected)
FROM incidents WHERE job = 'demo' GROUP BY kind, state
ORDER BY first"""


def wait_json(
    env: dict[str, str], what: str, args: list[str], done: Any, timeout: float = 120
) -> Any:
    """Poll ``profctl ARGS --json`` until ``done(doc)`` gives something, with dots."""
    print(f"waiting for {what} ", end="", flush=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(
            [str(BIN / "profctl"), *args, "--json"], env=env, text=True, capture_output=True
        )
        found = done(json.loads(r.stdout)) if r.returncode == 0 else None
        if found:
            print(" ok", flush=True)
            return found
        print(".", end="", flush=True)
        time.sleep(1.0)
    print(flush=True)
    raise SystemExit(f"demo: no {what} in {timeout:.0f}s")


def main() -> None:
    root = Path(os.environ.get("PROFD_DEMO_DIR") or tempfile.mkdtemp(prefix="profd-demo-"))
    config = root / "profd.toml"
    slow = root / "slow-rank-1"
    env = demo_env(root, slow)
    say(f"starting profd (dirs under {root})")
    log = (root / "profd.log").open("w") if root.exists() else None
    if log is None:
        root.mkdir(parents=True)
        log = (root / "profd.log").open("w")
    config.write_text(WAREHOUSE + "[watch]\n")  # sampling off until the last part
    daemon = subprocess.Popen(
        [str(BIN / "profd"), "run", "--config", str(config)], env=env, stdout=log, stderr=log
    )
    job = None
    try:
        wait_for_daemon(env)
        ctl(env, "status")
        say("launching a 2-rank CPU torchrun job (gloo) that calls profd_client.attach()")
        job_log = (root / "job.log").open("w")
        job = subprocess.Popen(
            [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(JOB)],
            env=env,
            stdout=job_log,
            stderr=subprocess.STDOUT,
        )
        wait_for_ranks(env, 2)
        show_live(env)
        page = capture_and_report(env, root)
        watch(env, daemon, config, slow)
        spike(env, root)
        query(env)
        say("done")
        spool = root / "state" / "spool"
        print(f"Traces: {spool} (open a cycle dir with HTA, TensorBoard or Perfetto)")
        print(f"Index:  {root / 'state' / 'index.db'}")
        print(f"Warehouse: {root / 'state' / 'warehouse'} (Parquet: DuckDB, Polars, Spark)")
        print(f"Report: {page} (open it in a browser; it needs no network)")
    finally:
        if job is not None:
            job.terminate()
            job.wait(30)
        daemon.terminate()
        daemon.wait(30)
        if os.environ.get("PROFD_DEMO_CLEAN"):
            shutil.rmtree(root, ignore_errors=True)


def demo_env(root: Path, slow: Path) -> dict[str, str]:
    """The environment of the demo's daemon, CLI and job: its own dirs under ``root``."""
    env = dict(
        os.environ,
        PROFD_RUNTIME_DIR=str(root / "run"),
        PROFD_STATE_DIR=str(root / "state"),
        OMP_NUM_THREADS="1",
    )
    env.pop("PROFD_CONFIG", None)
    env["DEMO_SLOW_FILE"] = str(slow)
    env["DEMO_STALL_FILE"] = str(root / "stall-rank-1")
    env["DEMO_STEPS"] = "1000000"  # ended by the demo
    env["PROFD_JOB"] = "demo"
    return env


def wait_for_daemon(env: dict[str, str]) -> None:
    """Up to 10 s for ``profctl status`` to answer (the demo's next ``ctl`` says if not)."""
    for _ in range(100):
        if (
            subprocess.run(
                [str(BIN / "profctl"), "status"], env=env, capture_output=True
            ).returncode
            == 0
        ):
            return
        time.sleep(0.1)


def show_live(env: dict[str, str]) -> None:
    say("attached processes, live")
    ctl(env, "ps")
    say("every rank's step times, always on (the step ledger; `profctl top` refreshes live)")
    time.sleep(2.0)  # two heartbeats: each rank's first ledgers
    ctl(env, "top", "--once")


def capture_and_report(env: dict[str, str], root: Path) -> Path:
    """Capture 3 steps on both ranks, show what profd made of them; the report page's path."""
    say("capture the next 3 steps on both ranks, and wait for the result")
    ctl(
        env,
        "start",
        "--role",
        "trainer",
        "--ranks",
        "all",
        "--next",
        "--active",
        "3",
        "--record-shapes",
        "--wait",
    )
    session = json.loads(ctl(env, "sessions", "--json", "--limit", "1", quiet=True).stdout)[0]["id"]
    say("sessions")
    ctl(env, "sessions")
    say("indexed traces")
    ctl(env, "traces", "--session", session)
    rows = json.loads(ctl(env, "traces", "--session", session, "--json", quiet=True).stdout)
    summary = next(f["path"] for f in rows[0]["files"] if f["kind"] == "summary")
    say(f"summary of rank {rows[0]['rank']} ({summary})")
    print("\n".join(Path(summary).read_text().splitlines()[:40]))
    say("the cross-rank report of the capture: who waits for whom, where the time goes")
    page = root / f"report-{session}.html"
    ctl(env, "report", session, "-o", str(page))
    return page


def watch(env: dict[str, str], daemon: subprocess.Popen[bytes], config: Path, slow: Path) -> None:
    """Sampling on, rank 1 slowed: the straggler incident profd records by itself."""
    say("profd notices by itself: sampling on (every 50 steps, re-read on SIGHUP)")
    config.write_text(WAREHOUSE + WATCH_ON)
    daemon.send_signal(signal.SIGHUP)
    print(WATCH_ON.strip())
    say("rank 1 is now slowed on purpose: 60 ms more in its forward pass every step")
    slow.touch()

    def straggler(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next((r for r in rows if r["kind"] == "straggler"), None)

    inc = wait_json(env, "a straggler incident from the next sample", ["incidents"], straggler)
    ctl(env, "incidents")

    def compared(doc: dict[str, Any]) -> dict[str, Any] | None:
        ended = doc.get("session_state") in TERMINAL
        return doc if doc.get("comparison") or (ended and doc.get("session")) else None

    wait_json(env, "its automatic capture, processed", ["incident", inc["id"]], compared)
    say("the incident: who, from which sample, and what its capture shows")
    ctl(env, "incident", inc["id"])


def spike(env: dict[str, str], root: Path) -> None:
    """One 3-second stall of rank 1's data loader: a spike, explained by the black box."""
    say("rank 1's data loader stalls once, for 3 s: a spike, over before anyone could capture it")
    (root / "stall-rank-1").touch()

    def frozen(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next((r for r in rows if r["kind"] == "spike" and "blackbox" in r["evidence"]), None)

    inc = wait_json(env, "a spike incident with its black box", ["incidents"], frozen)
    say("the spike: every rank's last steps, frozen when it opened (profctl blackbox on request)")
    ctl(env, "incident", inc["id"])


def query(env: dict[str, str]) -> None:
    """One SQL question over the warehouse: what the demo's job went through."""
    say(
        "the fleet's warehouse: every node exports its captures, minutes and incidents as"
        " Parquet; one SQL query over the demo job (the daemon adds rows not written yet)"
    )
    ctl(env, "query", " ".join(DEMO_SQL.split()))


if __name__ == "__main__":
    main()
