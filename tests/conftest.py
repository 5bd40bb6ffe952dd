"""Fixtures that run real things: a profd daemon process, profctl, torchrun jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from daemonproc import BIN, DaemonProcess, wait_for

ROOT = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"


@dataclass
class Daemon(DaemonProcess):
    """A real ``profd run -v`` subprocess for one test."""

    def start(self, wait: bool = True) -> Daemon:
        self.launch("-v")
        if wait:
            wait_for(lambda: self.ctl("status").returncode == 0, 15, "daemon to answer")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return self.terminate(sig)

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)

    def ps(self) -> list[dict[str, Any]]:
        r = self.ctl("ps", "--json")
        return json.loads(r.stdout) if r.returncode == 0 else []

    def wait_attached(self, n: int, timeout: float = 60, min_step: int = 0) -> list[dict[str, Any]]:
        return wait_for(
            lambda: (
                lambda rows: (
                    rows if len(rows) >= n and all(r["step"] >= min_step for r in rows) else None
                )
            )(self.ps()),
            timeout,
            f"{n} attached processes at step >= {min_step}",
        )


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "profd")
    d.root.mkdir()
    try:
        yield d.start()
    finally:
        d.stop()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """For tests that need a config file or want to start the daemon themselves."""
    made: list[Daemon] = []

    def make(config: str | None = None, start: bool = True, **env: str) -> Daemon:
        d = Daemon(tmp_path / f"profd{len(made)}", extra_env=env)
        d.root.mkdir()
        if config is not None:
            d.config = d.root / "profd.toml"
            d.config.write_text(config)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.stop()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A ZeroMQ context for raw peers of the daemon (see ``rawpeer.py``)."""
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@dataclass
class Job:
    proc: subprocess.Popen[str]
    out: Path

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        # torchrun starts its workers in sessions of their own, so killing the launcher's
        # process group would orphan them: kill the whole tree.
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def results(self) -> list[dict[str, Any]]:
        """Lines the job scripts print as ``RESULT {json}``."""
        # Ranks share one stdout, so lines can interleave: match the objects, not lines.
        return [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", self.output())]


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Start ``torchrun --nproc-per-node N tests/jobs/SCRIPT`` against a daemon (gloo, CPU)."""
    jobs: list[Job] = []

    def start(
        script: str,
        nproc: int = 2,
        daemon: Daemon | None = None,
        args: tuple[str, ...] = (),
        **env: str,
    ) -> Job:
        e = daemon.env() if daemon is not None else dict(os.environ)
        if daemon is None:
            e["PROFD_RUNTIME_DIR"] = str(tmp_path / "no-daemon")
        e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
        out = tmp_path / f"job{len(jobs)}.log"
        proc = subprocess.Popen(
            [
                str(BIN / "torchrun"),
                "--standalone",
                f"--nproc-per-node={nproc}",
                str(JOBS / script),
                *args,
            ],
            env=e,
            stdout=out.open("w"),
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        j = Job(proc, out)
        jobs.append(j)
        return j

    yield start
    for j in jobs:
        j.kill()
