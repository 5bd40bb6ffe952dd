"""Every benchmark in bench/ runs end to end on tiny sizes and writes its JSON result.

No timing assertions at all: the numbers of a ``--quick`` run on a shared machine mean
nothing. The six benchmarks start together (module fixture) so the whole file stays around a
minute; each test then waits for its own process and checks the result's shape.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
NAMES = ("idle", "trigger", "stall", "daemon", "index", "s3")
# Two lanes side by side: the CPU-heavy ones with the ones that mostly wait.
LANES = (("idle", "index", "s3"), ("trigger", "daemon", "stall"))
RESULT_KEYS = {"name", "quick", "date", "machine", "params", "rows", "details", "wall_s"}
ROW_KEYS = {
    "metric",
    "target",
    "measured",
    "unit",
    "spread",
    "baseline",
    "baseline_what",
    "ratio",
    "met",
}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("bench-results")
    procs = {}
    for lane in LANES:
        # One shell per lane runs its benchmarks one after another; each test waits for the
        # marker file its benchmark's exit code goes into.
        script = " ; ".join(
            f"{sys.executable} {BENCH / f'bench_{n}.py'} --quick --out {out}"
            f" > {out / f'{n}.log'} 2>&1 ; echo $? > {out / f'{n}.rc'}"
            for n in lane
        )
        procs[lane] = subprocess.Popen(["bash", "-c", script], cwd=ROOT)
    yield out
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("name", NAMES)
def test_bench_quick(runs: Path, name: str) -> None:
    out = runs
    rc_file = out / f"{name}.rc"
    deadline = time.monotonic() + TIMEOUT_S
    while not (rc_file.exists() and rc_file.read_text().strip()):
        if time.monotonic() > deadline:
            pytest.fail(f"bench_{name} --quick still running after {TIMEOUT_S}s")
        time.sleep(0.2)
    rc = int(rc_file.read_text())
    text = (out / f"{name}.log").read_text(errors="replace")
    assert rc == 0, f"bench_{name} --quick failed ({rc}):\n{text[-4000:]}"
    res = json.loads((out / f"{name}.json").read_text())
    assert set(res) >= RESULT_KEYS, sorted(RESULT_KEYS - set(res))
    assert res["name"] == name
    assert res["quick"] is True
    assert res["rows"], "no result rows"
    for row in res["rows"]:
        assert set(row) >= ROW_KEYS, sorted(ROW_KEYS - set(row))
        assert row["measured"] is not None, row
    assert {"nproc", "cpu", "python", "torch"} <= set(res["machine"])


def test_driver_prints_table(tmp_path: Path) -> None:
    """bench/run.py reads results back and prints one table (index only: the fastest)."""
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH / "run.py"),
            "--quick",
            "--only",
            "index",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "query by job" in r.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rows"] and summary["failed"] == []
