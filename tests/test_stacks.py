"""``profctl stacks`` against a real daemon and real gloo DDP jobs (``tests/jobs/stuck.py``),
and py-spy's JSON as profd parses it, captured from a real process.

py-spy attaches with ptrace: these tests run as root (or where ptrace is allowed).
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from clusters import Cluster
from daemonproc import free_port
from harness import BIN, JOBS, Daemon, Job, wait_for
from lines import read_line
from msgspec.structs import replace
from users import group_daemon

from profd import control_schema as C
from profd.daemon.clients.pyspy_reader import StackTarget, find_pyspy, read_one
from profd.watch import stackgroups
from profd.watch.rankrow import ReadStatus
from profd.watch.stackrows import Source, to_maps

#: The torchrun jobs make these end-to-end; the py-spy parsing ones are quick.
slow = pytest.mark.slow
WAIT = 120.0

#: A process whose main thread waits in ``waiting_here`` and a second thread (named
#: ``helper``) in ``helper_loop``; it prints the helper's native id, then "ready".
_SLEEPER = """
import threading, time
def helper_loop():
    while True:
        time.sleep(0.05)
def waiting_here():
    time.sleep(600)
t = threading.Thread(target=helper_loop, name="helper", daemon=True)
t.start()
time.sleep(0.1)
print(t.native_id, flush=True)
print("ready", flush=True)
waiting_here()
"""


def _sleeper() -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-c", _SLEEPER], stdout=subprocess.PIPE, text=True)
    helper_tid = int(read_line(p, 120))
    assert read_line(p, 120).strip() == "ready"
    return p, helper_tid


def test_a_real_pyspy_dump_parses_into_threads_innermost_first() -> None:
    pyspy = find_pyspy()
    assert pyspy is not None, "py-spy is a dependency: it must be beside the interpreter"
    p, helper_tid = _sleeper()
    try:
        out = subprocess.run(
            [pyspy, "dump", "--pid", str(p.pid), "--json"], capture_output=True, check=True
        )
        threads = stackgroups.parse_pyspy(json.loads(out.stdout))
        by_name = {t.name: t for t in threads}
        assert set(by_name) == {"MainThread", "helper"}
        main = by_name["MainThread"].frames
        assert [f.function for f in main] == ["waiting_here", "<module>"]
        line = _SLEEPER.splitlines().index("    time.sleep(600)") + 1
        assert main[0].file == "<string>" and main[0].line == line
        assert by_name["helper"].tid == helper_tid
        assert by_name["helper"].frames[0].function == "helper_loop"
        # The thread the client names is the training thread, whatever the order.
        marked = stackgroups.mark_training(threads, helper_tid)
        assert [t.name for t in marked if t.training] == ["helper"]

        row = read_one(pyspy, StackTarget("h", "worker", 0, p.pid, p.pid, None)).stacks
        assert row.source is Source.PYSPY and row.error is None
        assert [t.name for t in row.threads if t.training] == ["MainThread"]
        # On the wire: the map the protocol's schema checks (an older profctl's too).
        C.STACK_RANK.check(to_maps(row), "stacks.ranks[0]")

        # With native frames: C frames marked as such, the Python frames unchanged, so the
        # two reads group together.
        # (py-spy run here without the daemon's time limit: a loaded host may take seconds to
        # unwind, and the daemon then falls back to the Python stacks alone.)
        out = subprocess.run(
            [pyspy, "dump", "--pid", str(p.pid), "--json", "--native"],
            capture_output=True,
            check=True,
            timeout=120,
        )
        native = stackgroups.parse_pyspy(json.loads(out.stdout))
        nat = replace(row, rank=1, threads=stackgroups.mark_training(native, None, p.pid))
        (t,) = [t for t in nat.threads if t.training]
        assert any(f.native for f in t.frames), t.frames
        assert tuple(f for f in t.frames if not f.native) == main
        assert len(stackgroups.group([row, nat])) == 1
    finally:
        p.kill()
        p.wait()


def test_a_process_that_is_gone_is_reported_not_raised() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    got = read_one(find_pyspy(), StackTarget("h", "worker", 3, p.pid, p.pid, None))
    assert got.status is ReadStatus.EXITED  # no agent thread is asked for a gone process
    row = to_maps(got.stacks)
    assert row["source"] is None and row["threads"] == []
    assert row["error"] == "the process exited while its stacks were read"


def _stacks(daemon: Daemon, *args: str) -> dict[str, Any]:
    doc: dict[str, Any] = daemon.ctl_json("stacks", *args, timeout=30)
    return doc


def stopped_after(daemon: Daemon | Cluster, n: int, step: int) -> None:
    """Wait until ``n`` ranks have ended ``step`` and stepped no more since (their rate is
    down to nothing): a stuck rank is then where it stays, the others wait for it."""

    def stopped() -> bool:
        if isinstance(daemon, Cluster):
            r = daemon.ctl("ps", "--json")
            rows = json.loads(r.stdout) if r.returncode == 0 else []
        else:
            rows = daemon.ps()
        return len(rows) == n and all(
            r["step"] >= step and not r["step_extrapolated"] and r["steps_per_s"] == 0 for r in rows
        )

    wait_for(stopped, WAIT, f"{n} ranks stopped after step {step}")


def settled(read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The stacks once two reads in a row group the ranks the same (a rank may still be
    on its way into the frame it stays in)."""
    last: list[Any] = [None]

    def same() -> dict[str, Any] | None:
        doc = read()
        key = [[(m["host"], m["rank"]) for m in g["ranks"]] for g in doc["groups"]]
        hit = doc if key == last[0] else None
        last[0] = key
        return hit

    found: dict[str, Any] = wait_for(same, WAIT, "the same groups twice in a row")
    return found


def _training(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in r["threads"] if t["training"]]


def _functions(frames: list[dict[str, Any]]) -> list[str]:
    return [f["function"] for f in frames]


@slow
def test_the_stuck_rank_is_named_alone_and_the_others_wait_in_the_all_reduce(
    daemon: Daemon, torchrun: Callable[..., Job]
) -> None:
    torchrun("stuck.py", 3, daemon, PROFD_JOB="stuck", STUCK_RANK="1", STUCK_AT="30")
    stopped_after(daemon, 3, 29)
    doc = settled(lambda: _stacks(daemon, "--job", "stuck"))
    majority, suspect = doc["groups"]
    assert majority["majority"] and not suspect["majority"]
    assert [m["rank"] for m in suspect["ranks"]] == [1]
    assert [m["rank"] for m in majority["ranks"]] == [0, 2]
    assert "stuck_in_data_loading" in _functions(suspect["frames"])
    assert "backward" in _functions(majority["frames"])
    assert "stuck_in_data_loading" not in _functions(majority["frames"])
    for r in doc["ranks"]:
        assert r["source"] == "py-spy", r
        assert len(_training(r)) == 1

    text = daemon.ctl("stacks", "--job", "stuck")
    assert text.returncode == 0, text.stderr
    first = text.stdout.splitlines()[1]
    assert first.split()[:3] == ["suspect", "rank", "1:"]
    assert "in stuck_in_data_loading (stuck.py:" in first
    full = daemon.ctl("stacks", "--job", "stuck", "-v")
    assert "[training]" in full.stdout and "load_batch" in full.stdout
    tree = daemon.ctl("stacks", "--job", "stuck", "--tree").stdout.splitlines()
    # The stacks part in train(): rank 1's branch goes on into load_batch.
    branch = next(i for i, ln in enumerate(tree) if ln.endswith("[rank 1]"))
    assert tree[branch].strip().startswith("train (stuck.py:"), tree
    assert tree[branch + 1].strip().startswith("load_batch (stuck.py:"), tree
    assert tree[branch + 2].strip().startswith("stuck_in_data_loading (stuck.py:"), tree

    one = _stacks(daemon, "--job", "stuck", "--rank", "1")
    assert [r["rank"] for r in one["ranks"]] == [1]


@slow
def test_a_healthy_job_every_rank_has_a_source_and_one_training_thread(
    daemon: Daemon, torchrun: Callable[..., Job]
) -> None:
    # The steps run on a thread of their own: only the client's word marks it.
    torchrun("stuck.py", 3, daemon, PROFD_JOB="stuck", THREAD="1", STEP_MS="50")
    daemon.wait_attached(3, WAIT, min_step=3)
    doc = _stacks(daemon)
    assert doc["job"] == "stuck"
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1, 2]
    for r in doc["ranks"]:
        assert r["source"] == "py-spy", r
        (t,) = _training(r)
        assert t["name"] == "trainer"
        assert "train" in _functions(t["frames"])
    assert sum(len(g["ranks"]) for g in doc["groups"]) == 3


@slow
def test_several_jobs_need_a_job_and_the_daemon_serves_while_reading(
    daemon: Daemon, torchrun: Callable[..., Job]
) -> None:
    torchrun("stuck.py", 2, daemon, PROFD_JOB="stuck")
    torchrun("stuck.py", 1, daemon, PROFD_JOB="other")
    daemon.wait_attached(3, WAIT, min_step=1)
    r = daemon.ctl("stacks")
    assert r.returncode == 2
    assert "2 jobs are attached (other, stuck): name one with --job" in r.stderr

    # Requests while stacks are being read are answered: the read runs off the loop.
    answers: list[int] = []

    def read() -> None:
        answers.append(daemon.ctl("stacks", "--job", "stuck").returncode)

    readers = [threading.Thread(target=read) for _ in range(4)]
    for t in readers:
        t.start()
    statuses = [daemon.ctl("status").returncode for _ in range(5)]
    for t in readers:
        t.join()
    assert statuses == [0] * 5 and answers == [0] * 4


@slow
def test_cluster_stacks_group_ranks_of_two_nodes_and_name_the_stuck_ones_host(
    cluster: Cluster, tmp_path: Path
) -> None:
    port = free_port()
    agents = []
    try:
        for k, name in enumerate(("node-a", "node-b")):
            d, _ = cluster.add(name, heartbeat=0.5)
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("PROFD_")},
                "PROFD_RUNTIME_DIR": str(d.runtime_dir),
                "PROFD_HEARTBEAT": "0.5",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "STUCK_RANK": "3",
                "STUCK_AT": "30",
            }
            cmd = [
                str(BIN / "torchrun"), "--nnodes=2", f"--node-rank={k}", "--nproc-per-node=2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twonode",
                str(JOBS / "stuck.py"),
            ]  # fmt: skip
            agents.append(Job.spawn(cmd, env, tmp_path / f"agent{k}.log"))

        stopped_after(cluster, 4, 29)

        def read() -> dict[str, Any]:
            r = cluster.ctl("stacks", "--json")
            assert r.returncode == 0, r.stderr
            doc: dict[str, Any] = json.loads(r.stdout)
            return doc

        doc = settled(read)
        assert len(doc["ranks"]) == 4
        # c10d's rendezvous gives the node that joins first ranks 0-1, whatever --node-rank
        # says: each node holds two consecutive ranks, and b is rank 3's.
        where = {r["rank"]: r["host"] for r in doc["ranks"]}
        a, b = where[0], where[3]
        assert {a, b} == {"node-a", "node-b"} and where == {0: a, 1: a, 2: b, 3: b}, where
        majority, suspect = doc["groups"]
        assert suspect["ranks"] == [{"host": b, "role": suspect["ranks"][0]["role"], "rank": 3}]
        assert "stuck_in_data_loading" in _functions(suspect["frames"])
        assert sorted(m["rank"] for m in majority["ranks"]) == [0, 1, 2]
        assert {m["rank"]: m["host"] for m in majority["ranks"]}[2] == b
        text = cluster.ctl("stacks")
        assert f"rank 3 on {b}: in stuck_in_data_loading" in text.stdout, text.stdout
        # The black boxes of both nodes' ranks, one trace aligned by the global step.
        out = tmp_path / "bb.json.gz"
        r = cluster.ctl("blackbox", "--job", "twonode", "--json", "-o", str(out))
        assert r.returncode == 0, r.stderr
        box = json.loads(r.stdout)
        nodes = {r["rank"]: r["node"] for r in box["ranks"]}
        assert nodes == where, box
        lo, hi = box["common_steps"]
        assert hi - lo >= 20 and box["missing"] == [], box
        # Rank 3 sits in step 30 (sleeping in its data loading): its samples there say so.
        samples = _samples(out, f"{b}/main rank 3")
        stuck = [s for s in samples if s["step"] == 30]
        assert stuck and "stuck_in_data_loading" in stuck[-1]["stack"], samples[-3:]
    finally:
        for a in agents:
            a.kill()


def _samples(trace: Path, process: str) -> list[dict[str, Any]]:
    """The stack samples in a black-box trace of the processes whose name starts so."""
    doc = json.loads(gzip.decompress(trace.read_bytes()))
    pids = {
        e["pid"]
        for e in doc["traceEvents"]
        if e["name"] == "process_name" and e["args"]["name"].startswith(process)
    }
    return [e["args"] for e in doc["traceEvents"] if e.get("cat") == "sample" and e["pid"] in pids]


@slow
def test_without_pyspy_the_agent_threads_answer(
    daemon_factory: Callable[..., Daemon], torchrun: Callable[..., Job]
) -> None:
    d = daemon_factory(PROFD_PYSPY="")  # nothing may ptrace here: the clients answer
    torchrun("stuck.py", 3, d, PROFD_JOB="stuck", STUCK_RANK="1", STUCK_AT="30", THREAD="1")
    stopped_after(d, 3, 29)
    doc = settled(lambda: _stacks(d, "--job", "stuck"))
    majority, suspect = doc["groups"]
    assert [m["rank"] for m in suspect["ranks"]] == [1]
    assert [m["rank"] for m in majority["ranks"]] == [0, 2]
    assert "stuck_in_data_loading" in _functions(suspect["frames"])
    for r in doc["ranks"]:
        assert r["source"] == "agent", r
        assert "py-spy not found" in r["error"]
        (t,) = _training(r)
        assert t["name"] == "trainer"
        # The agent thread that answered is not among the threads it sent.
        assert "profd-agent" not in [x["name"] for x in r["threads"]]


#: A rank without torch whose steps run on a thread named ``trainer``.
_THREADED = """
import threading, time, profd_client
profd_client.attach(job="theirs", step="manual", heartbeat=0.2)
def train():
    while True:
        profd_client.step()
        time.sleep(0.05)
t = threading.Thread(target=train, name="trainer", daemon=True)
t.start()
t.join()
"""
_CAP_SYS_PTRACE = 19


@slow
def test_a_daemon_that_may_not_trace_another_users_ranks_lists_their_agent_threads() -> None:
    # A root daemon without CAP_SYS_PTRACE (a site that drops it from the unit's bounding
    # set), serving a job of another user, whom py-spy then may not trace (EPERM): the
    # agents answer.
    drop = ("setpriv", "--bounding-set", "-sys_ptrace")
    with group_daemon(("profd-victim",), prefix=drop) as (d, (victim,)):
        assert d.proc is not None
        caps = Path(f"/proc/{d.proc.pid}/status").read_text().split("CapEff:")[1].split()[0]
        assert not int(caps, 16) >> _CAP_SYS_PTRACE & 1
        ranks = [
            victim.popen(
                [str(BIN / "python"), "-c", _THREADED],
                env={**victim.env, "RANK": str(r), "WORLD_SIZE": "2"},
            )
            for r in (0, 1)
        ]
        try:
            d.wait_attached(2, WAIT, min_step=2)
            doc = _stacks(d, "--job", "theirs")
        finally:
            for p in ranks:
                p.kill()
                p.wait()
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1]
    for r in doc["ranks"]:
        assert r["source"] == "agent", r
        (t,) = _training(r)
        assert t["name"] == "trainer" and "train" in _functions(t["frames"]), t
        assert r["error"].startswith("read by its agent thread (py-spy: Permission denied"), r
        why = f"it runs as uid {victim.uid}, the daemon as uid 0 without CAP_SYS_PTRACE"
        assert why in r["error"], r["error"]
    assert sum(len(g["ranks"]) for g in doc["groups"]) == 2


def _rank(doc: dict[str, Any], rank: int) -> dict[str, Any]:
    (r,) = [r for r in doc["ranks"] if r["rank"] == rank]
    return r


@slow
def test_a_rank_holding_the_gil_is_read_by_pyspy_alone_and_without_it_does_not_answer(
    daemon_factory: Callable[..., Daemon], torchrun: Callable[..., Job]
) -> None:
    # Rank 1 spins in one regex match (stuck.py STUCK_HOW=gil), rank 0 waits for it in the
    # all-reduce; a daemon that reads with py-spy. Beside it a 1-rank job stuck the same way
    # on a daemon without py-spy.
    spy, blind = daemon_factory(), daemon_factory(PROFD_PYSPY="")
    env = {"STUCK_AT": "3", "STUCK_HOW": "gil"}
    torchrun("stuck.py", 2, spy, PROFD_JOB="gil", STUCK_RANK="1", **env)
    torchrun("stuck.py", 1, blind, PROFD_JOB="gil", STUCK_RANK="0", **env)
    spy.wait_attached(2, WAIT)
    blind.wait_attached(1, WAIT)

    def in_the_regex() -> dict[str, Any] | None:
        doc = _stacks(spy, "--job", "gil")
        if len(doc["ranks"]) != 2:
            return None
        one, zero = _training(_rank(doc, 1)), _training(_rank(doc, 0))
        # Rank 0 may still be in its own step's load_batch when rank 1 enters the regex.
        there = one and "stuck_in_data_loading" in _functions(one[0]["frames"])
        waits = zero and "backward" in _functions(zero[0]["frames"])
        return doc if there and waits else None

    doc = wait_for(in_the_regex, WAIT, "rank 1 in the regex and rank 0 waiting for it")
    one = _rank(doc, 1)
    assert one["source"] == "py-spy" and "error" not in one, one
    (t,) = _training(one)
    # Innermost Python frame: re.match, called by the function that is stuck.
    assert _functions(t["frames"])[:2] == ["match", "stuck_in_data_loading"], t["frames"]
    assert t["frames"][0]["file"].endswith("re/__init__.py"), t["frames"][0]
    assert t.get("owns_gil") is True, t
    assert "backward" in _functions(_training(_rank(doc, 0))[0]["frames"])

    # Without py-spy only the agent thread can answer, and the regex starves it: the rank is
    # listed as not answering, in bounded time, while the daemon goes on serving ps.
    listed: list[list[int]] = []

    def starved() -> dict[str, Any] | None:
        got: list[dict[str, Any]] = []
        reading = threading.Thread(target=lambda: got.append(_stacks(blind, "--job", "gil")))
        reading.start()
        while reading.is_alive():
            listed.append([r["rank"] for r in blind.ps()])
        reading.join()
        return got[0] if got and got[0]["ranks"][0]["source"] is None else None

    doc = wait_for(starved, WAIT, "the rank's agent thread starved")
    (stuck,) = doc["ranks"]
    assert stuck["threads"] == [], stuck
    assert stuck["error"] == (
        "py-spy not found (or turned off: PROFD_PYSPY empty); its agent thread did not answer in 2s"
    ), stuck
    assert listed and all(x == [0] for x in listed), listed

    # A rank that dies while its stacks are being read is reported, never a traceback.
    answer: list[subprocess.CompletedProcess[str]] = []
    reading = threading.Thread(
        target=lambda: answer.append(blind.ctl("stacks", "--job", "gil", "--json", timeout=30))
    )
    reading.start()
    os.kill(stuck["pid"], signal.SIGKILL)
    reading.join()
    (r,) = answer
    if r.returncode == 0:  # read before its departure was noticed: listed, with the reason
        (gone,) = json.loads(r.stdout)["ranks"]
        assert gone["source"] is None and "did not answer" in gone["error"], gone
    else:  # its departure noticed first
        assert "no attached ranks of job gil" in r.stderr, r.stderr
    assert "Traceback" not in blind.log.read_text()
    assert blind.ctl("status").returncode == 0
