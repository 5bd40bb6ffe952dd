"""Identity from the job itself: launchers that set no rank before the script runs.

Each job here is started the way its users start it, with the two profd lines and nothing
else: Lightning spawning its own DDP processes, ``torch.multiprocessing.spawn``, actors on a
local Ray instance, and two unrelated ``python train.py``. ``ps`` must show the rank and
world size the process group has, one job id per job, and where each came from; a capture of
explicit steps must hold exactly those steps on every rank.

Explicit steps use the gate of ``test_captures``: the job waits for a file after its process
group exists, and the test opens it once every target is ``armed``.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonproc import free_port
from harness import JOBS, Daemon, Job, wait_for
from test_captures import (
    WAIT,
    by_rank,
    open_gate_when_armed,
    start_and_wait,
    step_markers,
    traces,
    wait_session,
)

from profd_client.protocol import RELEASE

pytestmark = pytest.mark.slow


def run_script(d: Daemon, log: Path, script: str, *args: str, **env: str) -> Job:
    """``python tests/jobs/SCRIPT``, with nothing of a launcher in its environment."""
    e = d.env()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(name, None)
    for name in [n for n in e if n.startswith(("SLURM_", "TORCHELASTIC_", "PROFD_JOB"))]:
        e.pop(name)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **env)
    return Job.spawn([sys.executable, str(JOBS / script), *args], e, log)


@pytest.fixture
def scripts(daemon: Daemon, tmp_path: Path) -> Iterator[Any]:
    started: list[Job] = []

    def start(script: str, *args: str, **env: str) -> Job:
        j = run_script(daemon, tmp_path / f"job{len(started)}.log", script, *args, **env)
        started.append(j)
        return j

    yield start
    for j in started:
        j.kill()


def one_job(d: Daemon, n: int) -> list[dict[str, Any]]:
    """The ``ps`` rows once ``n`` processes show ranks 0..n-1 of world size n in one job."""

    def settled() -> list[dict[str, Any]] | None:
        rows = d.ps()
        ok = (
            len(rows) == n
            and sorted(r["rank"] for r in rows) == list(range(n))
            and all(r["world_size"] == n for r in rows)
            and len({r["job"] for r in rows}) == 1
        )
        return rows if ok else None

    rows: list[dict[str, Any]] = wait_for(settled, WAIT, f"{n} ranks of one job", every=0.2)
    return rows


def capture_steps_3_4(d: Daemon, job: str, gate: Path, n: int) -> None:
    """``start --job J --steps 3:5`` on every rank, then the gate; exactly steps 3 and 4."""
    res = d.ctl_json("start", "--job", job, "--steps", "3:5")
    assert res["steps"] == [3, 4] and len(res["targets"]) == n, res
    open_gate_when_armed(d, gate, res["session"])
    s = wait_session(d, res["session"])
    assert s["state"] == "done", s
    rows = by_rank(traces(d, "--session", res["session"]))
    assert sorted(rows) == list(range(n))
    for r in range(n):
        assert step_markers(Path(rows[r]["path"])) == [3, 4], rows[r]


def test_lightning_ddp_processes_are_ranks_of_one_job(
    daemon: Daemon, scripts: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "go"
    job = scripts("lightning_ddp.py", GATE=str(gate), STEPS="6")
    rows = one_job(daemon, 2)
    for r in rows:
        src = r["identity_source"]
        assert src["rank"] == src["world_size"] == "torch.distributed", r
        assert src["job"] == "torch.distributed", r
        assert r["job"].startswith("lightning_ddp-"), r
    capture_steps_3_4(daemon, rows[0]["job"], gate, 2)
    assert job.wait() == 0, job.output()
    res = sorted(job.results(), key=lambda x: x["rank"])
    assert [(x["rank"], x["profd_rank"], x["steps"]) for x in res] == [(0, 0, 6), (1, 1, 6)]


def test_mp_spawn_attach_before_init_process_group(
    daemon: Daemon, scripts: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "go"
    port = free_port()
    job = scripts("spawn_ddp.py", GATE=str(gate), PORT=str(port), STEPS="6")
    rows = one_job(daemon, 2)
    assert {r["job"] for r in rows} == {f"spawn_ddp-localhost-{port}"}
    assert all(r["identity_source"]["rank"] == "torch.distributed" for r in rows)
    human = daemon.ctl("ps", "--sources")
    assert human.returncode == 0 and "RANK/WORLD FROM" in human.stdout, human
    assert "torch.distributed" in human.stdout
    # The release each process runs, beside where its identity came from.
    assert human.stdout.split("\n", 1)[0].split()[-1] == "CLIENT"
    assert all(line.split()[-1] == RELEASE for line in human.stdout.strip().splitlines()[1:])
    capture_steps_3_4(daemon, rows[0]["job"], gate, 2)
    assert job.wait() == 0, job.output()
    assert sorted((x["rank"], x["profd_rank"]) for x in job.results()) == [(0, 0), (1, 1)]


def test_a_session_armed_for_the_old_identity_is_refused_clearly(
    daemon: Daemon, scripts: Any, tmp_path: Path
) -> None:
    """Armed before ``init_process_group`` moved the process to another job: that target
    fails saying why, and the process is then selectable under its new job."""
    pre, gate = tmp_path / "init", tmp_path / "go"
    port = free_port()
    job = scripts("spawn_ddp.py", PREINIT_GATE=str(pre), GATE=str(gate), PORT=str(port), NPROC="1")
    (row,) = daemon.wait_attached(1, timeout=WAIT)
    assert row["identity_source"]["job"] == "process"
    old = daemon.ctl_json("start", "--job", row["job"], "--steps", "3:5")
    open_gate_when_armed(daemon, pre, old["session"])
    s = wait_session(daemon, old["session"])
    assert s["state"] == "failed", s
    (t,) = s["targets"]
    assert t["state"] == "failed"
    assert f"re-registered as job spawn_ddp-localhost-{port} main rank 0/1" in t["error"], t
    assert f"(was job {row['job']} main rank 0/1) before its capture began" in t["error"], t
    (moved,) = one_job(daemon, 1)
    assert moved["pid"] == row["pid"] and moved["job"] == f"spawn_ddp-localhost-{port}"
    capture_steps_3_4(daemon, moved["job"], gate, 1)
    assert job.wait() == 0, job.output()


def test_an_auto_rule_follows_the_process_to_its_job(daemon_factory: Any, tmp_path: Path) -> None:
    """An ``[[auto]]`` rule armed each rank under its first job; after ``init_process_group``
    both ranks are one job and the rule's capture of that job holds both."""
    d = daemon_factory(config='[[auto]]\nsteps = "3:5"\n')
    gate = tmp_path / "go"
    port = free_port()
    job = run_script(
        d, tmp_path / "job.log", "spawn_ddp.py", GATE=str(gate), PORT=str(port), STEPS="6"
    )
    try:
        rows = one_job(d, 2)
        name = rows[0]["job"]
        mine = wait_for(
            lambda: [s for s in d.ctl_json("sessions", "--job", name) if s["state"] == "armed"],
            WAIT,
            "the rule's session for the job, armed",
        )
        (session,) = mine
        open_gate_when_armed(d, gate, session["id"])
        s = wait_session(d, session["id"])
        assert s["state"] == "done", s
        rows = by_rank(traces(d, "--session", session["id"]))
        assert sorted(rows) == [0, 1]
        assert all(step_markers(Path(r["path"])) == [3, 4] for r in rows.values())
        # Sessions the rule began for a rank's first, per-process job ended as cancelled.
        for other in d.ctl_json("sessions"):
            if other["id"] != session["id"]:
                assert other["state"] == "cancelled", other
        assert job.wait() == 0, job.output()
    finally:
        job.kill()


def test_an_auto_rule_arms_a_process_again_when_only_its_rank_changed(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """The ``mp.spawn`` parent exported ``MASTER_ADDR``/``MASTER_PORT``: both children attach
    under the job's id as rank 0 of 1 and the rule arms them in one session. After
    ``init_process_group`` their ranks change and their job does not: the rule arms them
    again as ranks 0 and 1 of 2, and its capture holds both."""
    d = daemon_factory(config='[[auto]]\nsteps = "3:5"\n')
    pre, gate = tmp_path / "init", tmp_path / "go"
    port = free_port()
    name = f"spawn_ddp-localhost-{port}"
    job = run_script(
        d,
        tmp_path / "job.log",
        "spawn_ddp.py",
        PARENT_MASTER="1",
        PREINIT_GATE=str(pre),
        GATE=str(gate),
        PORT=str(port),
        STEPS="6",
    )

    def sessions() -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = d.ctl_json("sessions", "--job", name)
        return rows

    def with_targets(sid: str, n: int) -> dict[str, Any] | None:
        s: dict[str, Any] = d.ctl_json("show", sid)
        return s if len(s["targets"]) == n else None

    try:
        (first,) = wait_for(sessions, WAIT, f"the rule's session for {name}")
        held = wait_for(lambda: with_targets(first["id"], 2), WAIT, "both children in it")
        assert {(t["rank"], t["world_size"]) for t in held["targets"]} == {(0, 1)}, held
        # Both are armed as rank 0 of 1 before either learns its rank.
        open_gate_when_armed(d, pre, first["id"])
        one_job(d, 2)

        def again() -> dict[str, Any] | None:
            fresh = [x for x in sessions() if x["id"] != first["id"]]
            return with_targets(fresh[0]["id"], 2) if len(fresh) == 1 else None

        rearmed = wait_for(again, WAIT, "the rule's session again, with both ranks")
        open_gate_when_armed(d, gate, rearmed["id"])
        s = wait_session(d, rearmed["id"])
        assert s["state"] == "done", s
        # The index keeps the identity each target was armed under: the new one.
        assert sorted((t["rank"], t["world_size"]) for t in s["targets"]) == [(0, 2), (1, 2)]
        rows = by_rank(traces(d, "--session", rearmed["id"]))
        assert sorted(rows) == [0, 1]
        assert all(step_markers(Path(r["path"])) == [3, 4] for r in rows.values())
        old = wait_session(d, first["id"])
        assert old["state"] == "cancelled", old
        for t in old["targets"]:
            assert f"re-registered as job {name} main rank " in t["error"], t
            assert f"(was job {name} main rank 0/1) before its capture began" in t["error"], t
        assert job.wait() == 0, job.output()
    finally:
        job.kill()


def test_two_unrelated_python_jobs_get_two_job_ids(daemon: Daemon, scripts: Any) -> None:
    # Started from one parent, like two `python train.py` from one shell.
    for _ in range(2):
        scripts("lone.py")
    rows = daemon.wait_attached(2, timeout=WAIT)
    assert len({r["job"] for r in rows}) == 2, rows
    assert all(r["identity_source"]["job"] == "process" for r in rows)
    assert {r["job"] for r in rows} == {f"lone-{r['pid']}" for r in rows}


# --- Ray -----------------------------------------------------------------------------------
@pytest.fixture
def ray_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path, Job]]:
    """A daemon and a local Ray instance running ``tests/jobs/ray_actors.py``."""
    pytest.importorskip("ray")
    root = tmp_path_factory.mktemp("ray")
    d = Daemon(root / "profd")
    d.root.mkdir()
    d.start()
    stop = root / "stop"
    # Ray keeps its sockets under its temp dir, and a unix socket path has at most 107 bytes:
    # a private dir with a short name, not one below pytest's.
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    job = run_script(d, root / "ray.log", "ray_actors.py", STOP=str(stop), RAY_TMPDIR=ray_tmp)
    try:
        yield d, stop, job
    finally:
        stop.touch()
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.proc.wait(60)
        job.kill()  # the whole tree: Ray's raylet and GCS run in sessions of their own
        d.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def ray_rows(
    d: Daemon, job: Job, ready: Any, what: str, timeout: float = WAIT
) -> list[dict[str, Any]]:
    """``ps`` rows once ``ready(rows)``; fails at once with the driver's output if it died."""

    def check() -> list[dict[str, Any]] | None:
        if job.proc.poll() is not None:
            raise AssertionError(f"the Ray driver exited ({job.proc.returncode}):\n{job.output()}")
        rows = d.ps()
        return rows if ready(rows) else None

    rows: list[dict[str, Any]] = wait_for(check, timeout, what, every=0.5)
    return rows


def test_ray_actors_get_ray_job_and_class_roles(ray_job: tuple[Daemon, Path, Job]) -> None:
    """Both Ray checks in one test: under pytest-xdist a second test could start a second
    Ray instance on another worker, which a 2-core machine cannot afford."""
    d, _, job = ray_job
    # Ray's start is most of this wait, and it is slow on a loaded machine.
    rows = ray_rows(
        d,
        job,
        lambda rs: len(rs) == 3 and all(r["steps_per_s"] > 0 for r in rs),
        "3 actors stepping",
        timeout=3 * WAIT,
    )
    assert sorted(r["role"] for r in rows) == [
        "dtensor_policy_worker",
        "dtensor_policy_worker",
        "vllm_generation_worker",
    ], job.output()
    assert len({r["job"] for r in rows}) == 1 and rows[0]["job"].startswith("ray-"), rows
    for r in rows:
        assert r["identity_source"]["job"] == r["identity_source"]["role"] == "ray", r

    # `start --role '*policy*'` reaches exactly the policy actors.
    policy = {r["pid"] for r in rows if r["role"] == "dtensor_policy_worker"}
    res = start_and_wait(d, "--role", "*policy*", "--next")
    assert res["state"] == "done", res
    assert {t["pid"] for t in res["targets"]} == policy and len(policy) == 2
    traced = traces(d, "--session", res["session"])
    assert {row["pid"] for row in traced} == policy
    assert {row["role"] for row in traced} == {"dtensor_policy_worker"}
    for row in traced:
        assert step_markers(Path(row["path"])) == res["steps"], row


def test_ray_is_never_imported_by_the_client(daemon: Daemon, tmp_path: Path) -> None:
    code = (
        "import sys, profd_client\n"
        "profd_client.attach(step='manual')\n"
        "print('RAY', 'ray' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=daemon.env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "RAY False" in out.stdout, out.stderr
