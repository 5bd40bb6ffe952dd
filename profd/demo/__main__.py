"""``python -m profd.demo``: run the whole loop on this machine, CPU only.

Starts ``profd run`` with temporary dirs, launches a 2-rank ``torchrun`` job that uses the
two-line integration, shows ``profctl ps`` and ``profctl top`` while it trains, captures
three steps on both ranks, and prints the session, the indexed traces, a summary, and ends
with the cross-rank report of the capture (``profctl report``: text here, the HTML page
beside the spool).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    root = Path(os.environ.get("PROFD_DEMO_DIR") or tempfile.mkdtemp(prefix="profd-demo-"))
    env = dict(
        os.environ,
        PROFD_RUNTIME_DIR=str(root / "run"),
        PROFD_STATE_DIR=str(root / "state"),
        OMP_NUM_THREADS="1",
    )
    env.pop("PROFD_CONFIG", None)
    say(f"starting profd (dirs under {root})")
    log = (root / "profd.log").open("w") if root.exists() else None
    if log is None:
        root.mkdir(parents=True)
        log = (root / "profd.log").open("w")
    daemon = subprocess.Popen([str(BIN / "profd"), "run"], env=env, stdout=log, stderr=log)
    job = None
    try:
        for _ in range(100):
            if (
                subprocess.run(
                    [str(BIN / "profctl"), "status"], env=env, capture_output=True
                ).returncode
                == 0
            ):
                break
            time.sleep(0.1)
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
        say("attached processes, live")
        ctl(env, "ps")
        say("every rank's step times, always on (the step ledger; `profctl top` refreshes live)")
        time.sleep(2.0)  # two heartbeats: each rank's first ledgers
        ctl(env, "top", "--once")
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
        session = json.loads(ctl(env, "sessions", "--json", "--limit", "1", quiet=True).stdout)[0][
            "id"
        ]
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
        say("done")
        spool = root / "state" / "spool"
        print(f"Traces: {spool} (open a cycle dir with HTA, TensorBoard or Perfetto)")
        print(f"Index:  {root / 'state' / 'index.db'}")
        print(f"Report: {page} (open it in a browser; it needs no network)")
    finally:
        if job is not None:
            job.terminate()
            job.wait(30)
        daemon.terminate()
        daemon.wait(30)
        if os.environ.get("PROFD_DEMO_CLEAN"):
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
