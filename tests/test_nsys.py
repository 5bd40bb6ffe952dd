"""The nsys backend end to end: ``profctl run --nsys``, ``profctl start --backend nsys``.

This machine cannot run NVIDIA Nsight Systems, so ``nsys`` here is the TEST DOUBLE in
``tests/doubles/`` (see its README): a stand-in CLI with interactive sessions, plus a
``sitecustomize`` in the launched processes that stands in for the CUDA profiler API calls
(``torch.cuda.profiler.start/stop``) and NVTX ranges, which a CPU build of torch cannot make.
Everything else is real: the daemon, profctl, torchrun with gloo, the spool, the index.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import BIN, JOBS, Daemon, Job, wait_for
from test_captures import open_gate_when_armed, start, traces, wait_session

NSYS_DOUBLE = Path(__file__).resolve().parent / "doubles" / "nsys"
WAIT = 120.0

pytestmark = pytest.mark.slow


class NsysBench:
    """A daemon pointed at the nsys double, and jobs launched with ``profctl run --nsys``."""

    def __init__(self, d: Daemon, state: Path, tmp: Path) -> None:
        self.d = d
        self.state = state
        self.tmp = tmp
        self.jobs: list[Job] = []

    def env(self, **extra: str) -> dict[str, str]:
        e = self.d.env()
        e.update(
            FAKE_NSYS_STATE=str(self.state),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONFAULTHANDLER="1",
            **extra,
        )
        return e

    def run(self, job: str, *run_args: str, nproc: int = 2, **env: str) -> Job:
        log = self.tmp / f"{job}.log"
        cmd = [str(BIN / "profctl"), "run", *run_args, "--job", job, "--"]
        cmd += [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}"]
        j = Job.spawn([*cmd, str(JOBS / "workers.py")], self.env(**env), log)
        self.jobs.append(j)
        return j

    def calls(self, verb: str) -> list[list[str]]:
        path = self.state / "calls.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r["argv"] for r in rows if r["argv"] and r["argv"][0] == verb]


@pytest.fixture
def bench(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> Iterator[NsysBench]:
    state = tmp_path / "fake-nsys"
    state.mkdir()
    d = daemon_factory(
        PROFD_NSYS=str(NSYS_DOUBLE),
        FAKE_NSYS_STATE=str(state),
        PROFD_NSYS_FINALIZE_TIMEOUT="3",
    )
    b = NsysBench(d, state, tmp_path)
    yield b
    for j in b.jobs:
        j.kill()


def report(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    assert doc.get("fake_nsys_report"), f"{path} is not a report of the nsys double"
    return doc


def step_ranges(doc: dict[str, Any]) -> list[str]:
    return [e["name"] for e in doc["events"] if e["ev"] == "push"]


def test_nsys_captures_exact_steps_per_cycle_on_the_chosen_rank(
    bench: NsysBench, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    job = bench.run("nsysjob", "--nsys", GATE=str(gate), DDP="1", STEPS="12")
    ps = bench.d.wait_attached(2)
    assert all(r["nsys_session"] and r["nsys_session"].startswith("profd-") for r in ps)
    rank1 = next(r for r in ps if r["rank"] == 1)

    res = start(
        bench.d,
        "--backend",
        "nsys",
        "--job",
        "nsysjob",
        "--ranks",
        "1",
        "--steps",
        "3:5",
        "--repeat",
        "2",
    )
    assert res["steps"] == [3, 4, 5, 6]
    open_gate_when_armed(bench.d, gate, res["session"])
    s = wait_session(bench.d, res["session"])
    assert s["state"] == "done", s
    assert job.wait(WAIT) == 0, job.output()

    # nsys was told to listen for the CUDA profiler API, write into the spool, two ranges.
    (start_call,) = bench.calls("start")
    assert f"--session={rank1['nsys_session']}" in start_call
    assert "--capture-range=cudaProfilerApi" in start_call
    assert "--capture-range-end=repeat:2" in start_call
    out = next(a for a in start_call if a.startswith("--output="))
    assert Path(out.split("=", 1)[1]).is_relative_to(bench.d.spool)

    rows = sorted(traces(bench.d, "--session", res["session"]), key=lambda r: r["cycle"])
    assert [(r["rank"], r["cycle"], r["steps"]) for r in rows] == [(1, 0, [3, 4]), (1, 1, [5, 6])]
    for row, want in zip(
        rows,
        (["ProfilerStep#3", "ProfilerStep#4"], ["ProfilerStep#5", "ProfilerStep#6"]),
        strict=True,
    ):
        path = Path(row["path"])
        assert path.name == "main-r1.nsys-rep" and path.parent.name == f"c{row['cycle']}"
        doc = report(path)
        # Only the armed rank opened the range, and it holds exactly the requested steps.
        assert {e["pid"] for e in doc["events"]} == {rank1["pid"]}
        assert step_ranges(doc) == want
        kinds = {f["kind"]: f for f in row["files"]}
        assert set(kinds) == {"nsys", "summary"}
        summary = Path(kinds["summary"]["path"]).read_text()
        assert "nsys_session:" in summary and want[0] in summary
    # The report was moved, not copied: nothing is left where nsys wrote it.
    assert not list((bench.d.spool / ".incoming").rglob("*.nsys-rep"))


def test_report_that_nsys_never_finalised_is_recovered_with_nsys_stop(
    bench: NsysBench, tmp_path: Path
) -> None:
    # FAKE_NSYS_HOLD: the double keeps the range open after cudaProfilerStop, the way a
    # collection waiting for `repeat-shutdown:N` never writes its report (verl, NeMo RL).
    gate = tmp_path / "gate"
    job = bench.run("held", "--nsys", GATE=str(gate), STEPS="150", FAKE_NSYS_HOLD="1")
    bench.d.wait_attached(2)
    res = start(bench.d, "--backend", "nsys", "--job", "held", "--ranks", "0", "--steps", "3:5")
    open_gate_when_armed(bench.d, gate, res["session"])
    s = wait_session(bench.d, res["session"])
    assert s["state"] == "done", s
    assert bench.calls("stop"), "the daemon never ran nsys stop"
    (row,) = traces(bench.d, "--session", res["session"])
    assert step_ranges(report(Path(row["path"]))) == ["ProfilerStep#3", "ProfilerStep#4"]
    assert job.wait(WAIT) == 0, job.output()


#: TEST DOUBLE: an importer that cannot load, as Nsight Compute 2025.3.1's on a machine
#: without elfutils' libdw (what the H100 run had): the loader's words, exit 127.
BROKEN_IMPORTER = (
    "#!/bin/sh\n"
    'echo "$0: error while loading shared libraries: libdw.so.1: cannot open shared object'
    ' file: No such file or directory" >&2\n'
    "exit 127\n"
)


# One end-to-end case (the importer the H100 run met); an nsys with no importer at all takes
# the same refusal, its words checked in tests/unit/test_nsys_files.py.
@pytest.mark.parametrize("importer", ["broken"])
def test_an_nsys_that_cannot_import_is_refused_at_start_saying_what_to_install(
    daemon_factory: Callable[..., Daemon], tmp_path: Path, importer: str
) -> None:
    # The double laid out the way Nsight Compute carries nsys. Such an nsys holds the armed
    # rank inside cudaProfilerStop for minutes and leaves only a .qdstrm, so nothing is armed.
    ncu = tmp_path / "nsight-compute-2025.3.1" / "host"
    where = ncu / "target-linux-x64"
    where.mkdir(parents=True)
    shutil.copy2(NSYS_DOUBLE, where / "nsys")
    shutil.copytree(NSYS_DOUBLE.parent / "inject", where / "inject")
    if importer == "broken":
        imp = ncu / "linux-desktop-glibc_2_11_3-x64" / "QdstrmImporter"
        imp.parent.mkdir()
        imp.write_text(BROKEN_IMPORTER)
        imp.chmod(0o755)
    state = tmp_path / "fake-nsys"
    state.mkdir()
    d = daemon_factory(PROFD_NSYS=str(where / "nsys"), FAKE_NSYS_STATE=str(state))
    b = NsysBench(d, state, tmp_path)
    try:
        job = b.run("noimport", "--nsys", nproc=1, STEPS="40", STEP_SLEEP="0.05")
        d.wait_attached(1)
        r = d.ctl("start", "--backend", "nsys", "--job", "noimport", "--next")
        assert r.returncode == 1, (r.stdout, r.stderr)
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1, err
        assert "cannot convert a capture into a report" in err, err
        assert "nsight-systems" in err, err
        if importer == "broken":
            assert "libdw.so.1 is missing" in err and "apt install libdw1" in err, err
        else:
            assert "has no QdstrmImporter near it" in err and "Nsight Compute" in err, err
        assert d.ctl_json("sessions") == []
        assert b.calls("start") == [], "nsys start ran for a refused session"
        assert job.wait(WAIT) == 0, job.output()
    finally:
        for j in b.jobs:
            j.kill()
    # profctl run said it at launch, before any capture was asked for.
    out = job.output()
    assert "profctl: warning:" in out and "cannot convert a capture into a report" in out, out


def test_nsys_refusals_say_why_and_start_nothing(bench: NsysBench, tmp_path: Path) -> None:
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=1", str(JOBS / "workers.py")]
    env = bench.env(PROFD_JOB="plain", STEPS="400")
    bench.jobs.append(Job.spawn(cmd, env, tmp_path / "plain.log"))
    bench.run("under", "--nsys", nproc=1, STEPS="400")
    wait_for(lambda: len(bench.d.ps()) == 2, 60, "both jobs attached")

    cases = [
        (("--job", "plain"), "does not run under nsys: launch the job with `profctl run --nsys"),
        (("--job", "under", "--record-shapes"), "--record-shapes is a torch.profiler option"),
        (("--job", "under", "--region", "forward"), "--region is torch-only"),
        (("--job", "under", "--warmup", "2"), "--warmup is torch.profiler's"),
    ]
    for args, why in cases:
        r = bench.d.ctl("start", "--backend", "nsys", *args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert bench.d.ctl_json("sessions") == []
    assert bench.calls("start") == []

    # One collection per launch at a time: a second session on it is refused, not queued
    # (a second `nsys start` would fail, and must never cancel the first one's collection).
    first = start(bench.d, "--backend", "nsys", "--job", "under", "--at-step", "380")
    r = bench.d.ctl("start", "--backend", "nsys", "--job", "under", "--at-step", "390")
    assert r.returncode == 1 and f"is collecting for session {first['session']}" in r.stderr
    wait_for(lambda: len(bench.calls("start")) == 1, 30, "the first session's nsys start")
    assert bench.d.ctl("cancel", first["session"]).returncode == 0

    # profctl run --nsys without an nsys binary: one line, exit 1, nothing launched.
    e = bench.env()
    e["PROFD_NSYS"] = str(tmp_path / "missing" / "nsys")
    r = subprocess.run(
        [str(BIN / "profctl"), "run", "--nsys", "--", "true"],
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "nsys not found" in r.stderr, r.stderr


def test_profctl_run_passes_the_exit_code_and_points_the_job_at_the_daemon(
    bench: NsysBench, tmp_path: Path
) -> None:
    e = bench.env()
    e.pop("PROFD_RUNTIME_DIR")
    probe = (
        "import os,sys; print(os.environ['PROFD_RUNTIME_DIR'], os.environ['PROFD_JOB']);"
        " sys.exit(7)"
    )
    r = subprocess.run(
        [
            str(BIN / "profctl"),
            "--runtime-dir",
            str(bench.d.runtime_dir),
            "run",
            "--job",
            "j1",
            "--json",
            "--",
            str(BIN / "python"),
            "-c",
            probe,
        ],
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 7, r.stderr
    assert json.loads(r.stdout) == {
        "exit_code": 7,
        "nsys_session": None,
        "command": [str(BIN / "python"), "-c", probe],
    }
    # --json: the job's own stdout went to stderr, so stdout is the JSON document alone.
    assert f"{bench.d.runtime_dir} j1" in r.stderr
