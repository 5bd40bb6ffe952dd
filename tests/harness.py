"""The end-to-end test harness: a real profd daemon, profctl against it, torchrun jobs.

Plain classes and functions, no fixtures: ``conftest.py`` wraps them in fixtures, and test
modules import names from here (never from ``conftest``, which pytest imports itself).
How the daemon process is launched and talked to lives in ``daemonproc.py``, shared with
``bench/``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from daemonproc import BIN, DaemonProcess, wait_for

__all__ = ["BIN", "JOBS", "ROOT", "Daemon", "Daemons", "Job", "Jobs", "wait_for"]

ROOT = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"


@dataclass
class Daemon(DaemonProcess):
    """A real ``profd run -v`` subprocess for one test."""

    def start(self, wait: bool = True) -> Daemon:
        self.launch("-v")
        if wait:
            wait_for(self.answers, 15, "daemon to answer")
        return self

    #: The daemon is this tree's (speaks its protocol): polls ask it from this process. A
    #: daemon of another release or environment is asked by its own profctl (``ctl``).
    this_tree = True

    def _own_client(self) -> bool:
        return self.this_tree and self.bin == BIN

    def answers(self) -> bool:
        """Whether the daemon answers ``status``: through this tree's client code (see
        :meth:`request`) when the daemon is this tree's, else its own environment's profctl."""
        if not self._own_client():
            return self.ctl("status").returncode == 0
        from profd.ctl.errors import CtlError

        try:
            self.request("status")
        except CtlError:
            return False
        return True

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return self.terminate(sig)

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)

    def ps(self) -> list[dict[str, Any]]:
        r = self.ctl("ps", "--json")
        return json.loads(r.stdout) if r.returncode == 0 else []

    def request(self, t: str, **fields: Any) -> Any:
        """A control request's ``data``, asked as ``profctl`` asks it but from this process:
        for polls, where a ``profctl`` process each time (~0.2 s of CPU, ten times a second)
        would take the CPU the processes waited for need. Failures raise ``CtlError``; a
        daemon that does not answer, after profctl's own 10 s.

        profd is imported here, not when this module is: conftest imports it before it takes
        the checkout off ``sys.path`` (``dev.py test`` runs the installed wheels)."""
        from profd.ctl.connection import Connection

        conn = Connection(str(self.runtime_dir))
        try:
            return conn.request(t, **fields)
        finally:
            conn.close()

    def wait_captured(self, session: str, timeout: float) -> None:
        """Until every rank of ``session`` has captured its steps: the session is past the
        live states before ``processing`` (its traces are on their way), or it has ended."""
        from profd.states import LIVE

        capturing = LIVE[: LIVE.index("processing")]
        wait_for(
            lambda: self.request("show", session=session)["state"] not in capturing,
            timeout, f"session {session} captured", every=0.05,
        )  # fmt: skip

    def wait_ended(self, session: str, timeout: float) -> dict[str, Any]:
        """``show``'s document of ``session`` once it has ended."""
        from profd.states import TERMINAL

        def ended() -> dict[str, Any] | None:
            doc: dict[str, Any] = self.request("show", session=session)
            return doc if doc["state"] in TERMINAL else None

        found: dict[str, Any] = wait_for(ended, timeout, f"session {session} to end", every=0.2)
        return found

    def polled_ps(self) -> list[dict[str, Any]]:
        """``ps``'s rows for a poll (:meth:`request`); none while the daemon does not answer."""
        if not self._own_client():
            return self.ps()
        from profd.ctl.errors import CtlError

        try:
            return list(self.request("ps"))
        except CtlError:
            return []

    def wait_attached(self, n: int, timeout: float = 60, min_step: int = 0) -> list[dict[str, Any]]:
        """At least ``n`` attached processes, every one past ``min_step``; their ``ps`` rows."""

        def ready() -> list[dict[str, Any]] | None:
            rows = self.polled_ps()
            # A row without a step is a peer listed as incompatible: not attached (yet: a
            # client newer than the daemon is listed so until it steps down to its version).
            ok = len(rows) >= n and all(r.get("step", -1) >= min_step for r in rows)
            return rows if ok else None

        rows: list[dict[str, Any]] = wait_for(
            ready, timeout, f"{n} attached processes at step >= {min_step}"
        )
        return rows


@dataclass
class Daemons:
    """Daemons made under ``base`` (``profd0``, ``profd1``, ...); :meth:`stop_all` stops them."""

    base: Path
    made: list[Daemon] = field(default_factory=list)

    def make(self, config: str | None = None, start: bool = True, **env: str) -> Daemon:
        """A daemon with ``config`` as its TOML file and ``env`` on top of the test's
        environment; started (and answering) unless ``start`` is false."""
        d = Daemon(self.base / f"profd{len(self.made)}", extra_env=env)
        d.root.mkdir()
        if config is not None:
            d.config = d.root / "profd.toml"
            d.config.write_text(config)
        self.made.append(d)
        return d.start() if start else d

    def stop_all(self) -> None:
        for d in self.made:
            d.stop()


@dataclass
class Job:
    """One ``torchrun`` launcher and its workers; output in one log file."""

    proc: subprocess.Popen[str]
    out: Path

    @classmethod
    def spawn(cls, cmd: list[str], env: dict[str, str], out: Path) -> Job:
        """Start ``cmd`` in a session of its own (so :meth:`kill` reaches its whole tree),
        stdout and stderr into ``out``."""
        with out.open("w") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        return cls(proc, out)

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


@dataclass
class Jobs:
    """``torchrun --nproc-per-node N tests/jobs/SCRIPT`` (gloo, CPU) with logs under ``logs``;
    :meth:`kill_all` kills every job started."""

    logs: Path
    started: list[Job] = field(default_factory=list)

    def start(
        self,
        script: str,
        nproc: int = 2,
        daemon: Daemon | None = None,
        args: tuple[str, ...] = (),
        **env: str,
    ) -> Job:
        """Against ``daemon``, or against no daemon at all (an empty runtime dir)."""
        e = daemon.env() if daemon is not None else dict(os.environ)
        if daemon is None:
            e["PROFD_RUNTIME_DIR"] = str(self.logs / "no-daemon")
        e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
        out = self.logs / f"job{len(self.started)}.log"
        cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}"]
        j = Job.spawn([*cmd, str(JOBS / script), *args], e, out)
        self.started.append(j)
        return j

    def kill_all(self) -> None:
        for j in self.started:
            j.kill()


def step_markers(trace: Path) -> list[int]:
    """The N of every ``ProfilerStep#N`` span in a gzipped Chrome trace."""
    with gzip.open(trace, "rt", encoding="utf-8") as fh:
        doc = json.load(fh)
    return sorted(
        int(ev["name"].split("#", 1)[1])
        for ev in doc["traceEvents"]
        if ev.get("ph") == "X" and str(ev.get("name", "")).startswith("ProfilerStep#")
    )
