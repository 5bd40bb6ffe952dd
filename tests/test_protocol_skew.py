"""Version skew with the step ledger (protocol 3) against a real protocol-2 release.

A job runs for weeks while its daemon is upgraded or rolled back under it (docs/design.md, "The
wire"). The other side here is not a simulation: it is profd as it was at the last
protocol-2 commit (``tests/compat/profd-protocol2.tar.gz``), run from its own sources.

* A protocol-2 client (the old ``profd_client``) against today's daemon: it keeps training,
  is listed with protocol 2, ``top`` times it from its rate, and a capture of it completes.
* Today's client against a protocol-2 daemon: it steps down to protocol 2 (no ledger), keeps
  training, and a capture started with that daemon's own profctl completes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon, Jobs, wait_for

ARCHIVE = Path(__file__).resolve().parent / "compat" / "profd-protocol2.tar.gz"
WAIT = 90.0


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("protocol2")
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(root, filter="data")
    return root


def old_path(tree: Path) -> str:
    """PYTHONPATH that imports the old release's ``profd`` and ``profd_client`` first."""
    return os.pathsep.join([str(tree), str(tree / "client"), os.environ.get("PYTHONPATH", "")])


@dataclass
class OldDaemon(Daemon):
    """The protocol-2 release's ``profd run`` and ``profctl``, from its own sources."""

    tree: Path = Path()
    this_tree = False

    def env(self) -> dict[str, str]:
        e = super().env()
        e["PYTHONPATH"] = old_path(self.tree)
        return e

    def launch(self, *args: str) -> None:
        with self.log.open("ab") as logf:
            code = "import sys; from profd.cli import main; sys.argv[0] = 'profd'; main()"
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, "run", *args],
                cwd=self.tree,  # not a checkout of today's profd: "" is first on sys.path
                env=self.env(),
                stdout=logf,
                stderr=logf,
            )

    def ctl(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        code = "import sys; from profd.ctl.main import main; sys.argv[0] = 'profctl'; main()"
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=self.tree,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout or self.ctl_timeout,
        )


def capture(d: Daemon, job: str) -> dict[str, Any]:
    res: dict[str, Any] = d.ctl_json(
        "start", "--job", job, "--next", "--active", "2", "--wait", "--timeout", str(WAIT),
        timeout=WAIT + 30,
    )  # fmt: skip
    return res


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    j = Jobs(tmp_path)
    yield j
    j.kill_all()


def test_a_protocol_2_client_trains_and_is_profiled_by_this_daemon(
    tmp_path: Path, old_tree: Path, jobs: Jobs
) -> None:
    d = Daemon(tmp_path / "profd")
    d.root.mkdir()
    d.start()
    try:
        job = jobs.start(
            "workers.py", nproc=2, daemon=d, PYTHONPATH=old_path(old_tree),
            PROFD_JOB="old", STEPS="400", STEP_SLEEP="0.02",
        )  # fmt: skip
        rows = d.wait_attached(2, timeout=WAIT, min_step=5)
        assert {r["protocol"] for r in rows} == {2}, rows
        assert capture(d, "old")["state"] == "done"

        def timed() -> list[dict[str, Any]] | None:
            top = d.ctl_json("top", "--once", "--job", "old")["ranks"]
            return top if len(top) == 2 and all(r["step_ms_p50"] for r in top) else None

        top = wait_for(timed, WAIT, "top to time the protocol-2 ranks")
        # No ledger from a protocol-2 client: its step time is the inverse of its rate.
        assert {r["source"] for r in top} == {"rate"}, top
        assert job.wait(WAIT * 2) == 0, job.output()
        assert len(job.results()) == 2
    finally:
        d.stop()


def test_this_client_steps_down_to_a_protocol_2_daemon(
    tmp_path: Path, old_tree: Path, jobs: Jobs
) -> None:
    d = OldDaemon(tmp_path / "profd", tree=old_tree)
    d.root.mkdir()
    d.start()
    try:
        status = d.ctl_json("status")
        assert status["protocol"] == [1, 2], status  # it is the old release
        # d.env() points PYTHONPATH at the old release: the job gets today's instead.
        job = jobs.start(
            "workers.py", nproc=2, daemon=d, PYTHONPATH=os.environ.get("PYTHONPATH", ""),
            PROFD_JOB="new", STEPS="400", STEP_SLEEP="0.02",
        )  # fmt: skip
        rows = d.wait_attached(2, timeout=WAIT, min_step=5)
        assert {r["protocol"] for r in rows} == {2}, rows
        assert capture(d, "new")["state"] == "done"
        assert job.wait(WAIT * 2) == 0, job.output()
        assert len(job.results()) == 2
        # It said once that it stepped down, and nothing worse.
        out = job.output()
        assert out.count("stepped down to version 2") == 2, out  # once per rank
        assert "Traceback" not in out, out
    finally:
        d.stop()


def test_the_archive_is_the_protocol_2_release(old_tree: Path) -> None:
    text = (old_tree / "client" / "profd_client" / "protocol.py").read_text()
    assert "VERSION: Final = 2\n" in text
