"""Fixtures that run real things: a profd daemon process, profctl, torchrun jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"
BIN = Path(sys.executable).parent


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


@dataclass
class Daemon:
    """A real ``profd run`` subprocess with its own dirs."""

    root: Path
    config: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def runtime_dir(self) -> Path:
        return self.root / "run"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def spool(self) -> Path:
        return self.state_dir / "spool"

    @property
    def log(self) -> Path:
        return self.root / "profd.log"

    def env(self) -> dict[str, str]:
        e = dict(os.environ)
        e.update(
            PROFD_RUNTIME_DIR=str(self.runtime_dir),
            PROFD_STATE_DIR=str(self.state_dir),
            PROFD_HEARTBEAT="0.5",
        )
        e.pop("PROFD_CONFIG", None)
        if self.config is not None:
            e["PROFD_CONFIG"] = str(self.config)
        e.update(self.extra_env)
        return e

    def start(self, wait: bool = True) -> Daemon:
        logf = self.log.open("ab")
        self.proc = subprocess.Popen(
            [str(BIN / "profd"), "run", "-v"], env=self.env(), stdout=logf, stderr=logf
        )
        if wait:
            wait_for(lambda: self.ctl("status").returncode == 0, 15, "daemon to answer")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.proc = None
        return rc

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "profctl"), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ctl_json(self, *args: str, timeout: float = 60) -> Any:
        r = self.ctl(*args, "--json", timeout=timeout)
        assert r.returncode == 0, f"profctl {args} failed ({r.returncode}): {r.stderr}{r.stdout}"
        return json.loads(r.stdout)

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
