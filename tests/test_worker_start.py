"""A pipeline worker that dies while it starts: one line, the capture again.

The lanes are driven directly (real spawn workers, real files, the daemon's reactor), so that
the start itself can be made to fail: a worker whose interpreter is killed before it reads
its job, and a worker that cannot be started at all, where multiprocessing raises out of
``submit`` (``EOFError`` or ``BrokenPipeError`` from its start-up plumbing, ``OSError`` here).
Neither may leave a traceback, nor lose the capture.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.spawn
import os
import resource
import select
import sys
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from profd.daemon.captures.lanes import Captures
from profd.daemon.captures.record import CaptureReport, Outcome
from profd.daemon.spool.incoming import Incoming
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.daemon.spool.storage import Storage
from profd.reactor import Reactor

JOB, HOST = "j", "node"
WAIT = 60.0


class Lanes:
    def __init__(self, spool: Path, workers: int = 2) -> None:
        self.spool = spool
        self.incoming = Incoming(spool, SpoolPerms(None))
        self.reactor = Reactor()
        self.outcomes: list[Outcome] = []
        self.captures = Captures(
            self.incoming, self.reactor, workers, self.outcomes.append, 1 << 30, Storage({})
        )
        self.n = 0

    def report(self) -> CaptureReport:
        """A capture of a small raw trace, in its process's own incoming directory."""
        self.n += 1
        sid, pid, uid, gid = (
            f"20250101-000000-00000{self.n}",
            4000 + self.n,
            os.getuid(),
            os.getgid(),
        )
        self.incoming.make_home(JOB, sid, 0, HOST, pid, uid, gid)
        c = CaptureReport(
            session_id=sid, training_job=JOB, host=HOST, pid=pid, role="r", rank=0,
            world_size=1, cycle=0, revision=0, uid=uid, gid=gid, steps=(1,),
            files=(("trace", "r-r0.pt.trace.json"),), started_at=1.0, ended_at=2.0,
            stall_ms=1.0,
        )  # fmt: skip
        raw = self.spool.joinpath(*c.raw_dir)
        raw.mkdir(mode=0o700)
        (raw / "r-r0.pt.trace.json").write_text(
            '{"traceEvents": [{"name": "op", "ph": "X", "ts": 1, "dur": 1}]}'
        )
        return c

    def run(self, c: CaptureReport) -> Outcome:
        """Submit ``c`` and run the loop's side until its outcome comes back."""
        done = len(self.outcomes)
        self.captures.submit(c)
        deadline = time.monotonic() + WAIT
        while len(self.outcomes) == done:
            assert time.monotonic() < deadline, "no outcome"
            select.select([self.reactor.fd], [], [], 0.2)
            self.reactor.run_pending()
        [out] = self.outcomes[done:]
        assert out.capture is c
        return out

    def close(self) -> None:
        self.captures.shutdown()
        self.reactor.close()


@pytest.fixture
def lanes(tmp_path: Path) -> Iterator[Lanes]:
    spool = tmp_path / "spool"
    spool.mkdir()
    made = Lanes(spool)
    yield made
    made.close()


def death_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "profd.captures"]


def test_a_worker_killed_before_it_reads_its_job_is_one_line_and_the_capture_runs_again(
    lanes: Lanes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The first worker's interpreter is SIGKILLed as it starts, before it reads anything
    # the daemon sent it; the next one is the real interpreter.
    flag = tmp_path / "first-died"
    exe = tmp_path / "python"
    exe.write_text(
        f'#!/bin/sh\n[ -e "{flag}" ] || {{ : > "{flag}"; kill -9 $$; }}\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    exe.chmod(0o755)
    resource_tracker.ensure_running()  # spawned with the same executable: the real one
    monkeypatch.setattr(multiprocessing.spawn, "_python_exe", os.fsencode(exe))
    caplog.set_level(logging.INFO, "profd.captures")
    c = lanes.report()
    out = lanes.run(c)
    assert flag.exists()
    assert out.error is None and out.trace is not None, out
    [line] = death_lines(caplog)
    assert line.levelno == logging.WARNING and line.exc_info is None
    text = line.getMessage()
    assert text.startswith("pipeline lane ") and "(killed by signal 9)" in text, text
    assert c.key in text and "running it once more" in text, text
    st = lanes.captures.status()
    assert st["restarts"] == 1 and st["last_worker_death"]["signal"] == 9, st
    assert lanes.captures.in_flight == 0


@contextlib.contextmanager
def no_free_fds() -> Iterator[None]:
    """Every file descriptor in use: the next pipe, and so the next worker, fails (EMFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    while True:  # fill the holes below the highest descriptor open now
        fd = os.open(os.devnull, os.O_RDONLY)
        fillers.append(fd)
        if fd >= top:
            break
    resource.setrlimit(resource.RLIMIT_NOFILE, (fillers[-1] + 1, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            os.close(fd)


def test_a_worker_that_cannot_start_is_a_death_of_its_capture_not_an_error_of_the_caller(
    lanes: Lanes, caplog: pytest.LogCaptureFixture
) -> None:
    # What multiprocessing raises when a worker's start fails (here: no descriptor for its
    # pipes) came out of submit, into whoever reported the capture, with a traceback; and
    # the capture was never finished (in flight until the next daemon start).
    caplog.set_level(logging.INFO, "profd.captures")
    c = lanes.report()
    with no_free_fds():
        lanes.captures.submit(c)
    [out] = lanes.outcomes
    assert out.capture is c and out.retry and out.trace is None, out
    assert out.error == "pipeline worker died twice (exit status unknown)", out
    first, second = death_lines(caplog)
    for line in (first, second):
        assert line.exc_info is None, line
        text = line.getMessage()
        assert text.startswith("pipeline lane ") and "died while starting (" in text, text
        assert "Too many open files" in text and c.key in text, text
    assert first.levelno == logging.WARNING and "running it once more" in first.getMessage()
    assert second.levelno == logging.ERROR and "giving up" in second.getMessage()
    assert lanes.captures.in_flight == 0
    # The lanes serve on.
    out = lanes.run(lanes.report())
    assert out.error is None and out.trace is not None, out
