"""Finished captures: check, post-process in worker processes, report back to the loop.

The loop calls :meth:`Captures.submit` with a client's ``captured`` report once it is safely
in the index inbox; the gzip/fix/summarise work runs in worker processes (JSON parsing of a
tens-of-MB trace would otherwise hold the loop's GIL); the result comes back through the
reactor to ``on_done``, on the loop thread.

Each worker is a *lane*: a one-process ``ProcessPoolExecutor`` that is given one capture at a
time. A worker killed inside a shared pool (the OOM killer) breaks that pool for good and
fails every capture queued in it without saying which one was on the dead worker. With one
capture per lane the capture that was running is known: its lane gets a new executor and the
capture is run once more, and only a second death fails it.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..pipeline.process import PipelineError, ProcessedTrace, process_trace
from .reactor import Reactor

log = logging.getLogger("profd.captures")

INCOMING = ".incoming"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class Job:
    key: str
    session: str
    job: str
    host: str
    pid: int
    role: str
    rank: int
    world_size: int
    cycle: int
    report: dict[str, Any]


@dataclass(frozen=True)
class WorkerDeath:
    """A pipeline worker that died under the daemon, as ``profctl status`` shows it."""

    pid: int | None
    exitcode: int | None  # Process.exitcode: -N for signal N, None when it was not read
    at: float
    capture: str | None  # the inbox key of the capture it was running; None when idle

    @property
    def signal(self) -> int | None:
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None

    @property
    def cause(self) -> str:
        if self.signal is not None:
            return f"killed by signal {self.signal}"
        if self.exitcode is None:
            return "exit status unknown"
        return f"exit code {self.exitcode}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "exitcode": self.exitcode,
            "signal": self.signal,
            "cause": self.cause,
            "at": self.at,
            "capture": self.capture,
        }


@dataclass
class _Task:
    job: Job
    args: dict[str, Any]
    deaths: int = 0


@dataclass
class _Lane:
    pool: cf.ProcessPoolExecutor | None = None
    task: _Task | None = None  # set from submit until its result is handled on the loop


def inside(spool: Path, path: str) -> Path | None:
    """The resolved path if it lies inside the spool, else None (never trust a client path)."""
    try:
        p = Path(path).resolve(strict=True)
        p.relative_to(spool.resolve())
    except (OSError, ValueError):
        return None
    return p


def _run(job_args: dict[str, Any]) -> ProcessedTrace:
    return process_trace(**job_args)


def _die_with(daemon_pid: int) -> None:
    """Pool initializer: the worker is killed when the daemon dies, however it dies.

    A SIGKILLed daemon runs no cleanup, and its workers would otherwise wait on their call
    queue forever: each holds that queue's write end itself, so no EOF ever comes. Once they
    are gone, multiprocessing's resource tracker (spawned by the daemon for the queues'
    semaphores) reads EOF on its pipe, unlinks the semaphores and exits by itself.
    PR_SET_PDEATHSIG fires when the *thread* that spawned the worker exits: workers are only
    spawned by ``ProcessPoolExecutor.submit`` on the loop thread, which lives as long as the
    daemon (the executor's own thread spawns only with ``max_tasks_per_child``, unused here).
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the worker still runs, it just may outlive a killed daemon
    # A daemon that died before prctl above sends no signal: we were re-parented already.
    if os.getppid() != daemon_pid:
        os._exit(1)


class Captures:
    def __init__(
        self,
        spool: Path,
        reactor: Reactor,
        workers: int,
        on_done: Callable[[Job, ProcessedTrace | None, str | None, bool], None],
    ) -> None:
        self.spool = spool
        self.reactor = reactor
        self.on_done = on_done
        self.in_flight = 0  # captures queued or running, until on_done
        self.restarts = 0  # workers replaced after they died
        self.last_death: WorkerDeath | None = None
        self.closing = False
        self._ctx = multiprocessing.get_context("spawn")
        self._lanes = [_Lane() for _ in range(max(1, workers))]
        self._queue: deque[_Task] = deque()

    def incoming_dir(self, job: str, session: str) -> Path:
        return self.spool / INCOMING / job / session

    def remove_incoming(self, job: str, session: str) -> None:
        """Drop a finished session's emptied ``.incoming`` dirs; any holding a file stay."""
        root = self.incoming_dir(job, session)
        if not root.is_dir():
            return
        for d in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        for d in (root, root.parent):
            try:
                d.rmdir()
            except OSError:
                return

    def final_dir(self, job: str, session: str, cycle: int) -> Path:
        return self.spool / job / session / f"c{cycle}"

    def submit(self, j: Job) -> None:
        """Validate and queue one capture; bad reports fail at once, without the pool."""
        files = j.report.get("files") or []
        trace: Path | None = None
        extras: list[tuple[str, str]] = []
        for f in files:
            if not isinstance(f, dict) or not isinstance(f.get("path"), str):
                return self._fail(j, "malformed file entry in report")
            p = inside(self.spool, f["path"])
            if p is None:
                return self._fail(j, f"rejected path outside the spool or missing: {f['path']}")
            if f.get("kind") == "trace" and trace is None:
                trace = p
            else:
                extras.append((str(f.get("kind", "extra")), str(p)))
        if trace is None:
            return self._fail(j, j.report.get("error") or "no trace file in report")
        args = {
            "raw_trace": str(trace),
            "final_dir": str(self.final_dir(j.job, j.session, j.cycle)),
            "stem": f"{j.role}-r{j.rank}",
            "rank": j.rank,
            "world_size": j.world_size,
            "extra_files": extras,
            "header": {
                "session": j.session,
                "job": j.job,
                "host": j.host,
                "pid": str(j.pid),
                "role": j.role,
                "cycle": str(j.cycle),
                "steps": ",".join(map(str, j.report.get("steps", []))),
                "region": str(j.report.get("region") or ""),
                "stall_ms": f"{j.report.get('stall_ms', 0):.1f}",
                "torch": str(j.report.get("torch")),
                "device": str(j.report.get("device")),
            },
        }
        if self.closing:
            # Too late for this daemon; the open inbox row brings it back at the next start.
            return self.on_done(j, None, "pipeline unavailable: the daemon is stopping", True)
        self.in_flight += 1
        self._queue.append(_Task(j, args))
        self._dispatch()

    def status(self) -> dict[str, Any]:
        """``pipeline`` in ``profctl status``. A worker that died while idle breaks its lane
        silently (nothing was running to fail): such a lane is replaced here, so that the
        death is counted when the operator looks, not only at the next capture."""
        for lane in self._lanes:
            if lane.task is None and lane.pool is not None and lane.pool._broken:
                self._replace(lane, None)
        return {
            "in_flight": self.in_flight,
            "workers": len(self._lanes),
            "restarts": self.restarts,
            "last_worker_death": self.last_death.as_dict() if self.last_death else None,
        }

    def _dispatch(self) -> None:
        free = [lane for lane in self._lanes if lane.task is None]
        while free and self._queue:
            if self._start(free[-1], self._queue.popleft()):
                free.pop()

    def _start(self, lane: _Lane, task: _Task) -> bool:
        """Hand ``task`` to ``lane``'s worker; False if it could not and the task failed."""
        why = "no worker"
        for _ in range(2):
            if lane.pool is None:
                lane.pool = cf.ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=self._ctx,
                    initializer=_die_with,
                    initargs=(os.getpid(),),
                )
            try:
                fut = lane.pool.submit(_run, task.args)
            except BrokenProcessPool:
                # Its worker died while idle (the OOM killer picks the largest process, and a
                # worker that just parsed a big trace can be that); nothing was lost.
                self._replace(lane, None)
                continue
            except RuntimeError as exc:  # shut down under us
                why = str(exc)
                break
            lane.task = task
            fut.add_done_callback(partial(self._done_soon, lane, task))
            return True
        # Retryable: the inbox row stays open and the next daemon start redoes the capture.
        self._finish(task, None, f"pipeline unavailable: {why}", True)
        return False

    def _done_soon(self, lane: _Lane, task: _Task, fut: cf.Future[ProcessedTrace]) -> None:
        # On the executor's manager thread: hand over to the loop, which owns the lanes.
        self.reactor.call_soon(self._finished, lane, task, fut)

    def _finished(self, lane: _Lane, task: _Task, fut: cf.Future[ProcessedTrace]) -> None:
        if lane.task is task:
            lane.task = None
        j = task.job
        try:
            res = fut.result()
        except BrokenProcessPool:
            self._worker_died(lane, task)
        except PipelineError as exc:
            self._finish(task, None, f"pipeline: {exc}", False)
        except Exception as exc:
            # A full disk, say: the raw trace is still in place, so the next daemon start
            # tries again (the inbox row stays open).
            log.error("pipeline failed on %s: %r", j.key, exc)
            self._finish(task, None, f"pipeline error: {type(exc).__name__}: {exc}", True)
        else:
            self._finish(task, res, None, False)
        if not self.closing:
            self._dispatch()

    def _worker_died(self, lane: _Lane, task: _Task) -> None:
        j = task.job
        if self.closing:
            # Its executor is shut down already; the inbox row brings the capture back.
            self._finish(task, None, "pipeline worker died while the daemon stopped", True)
            return
        death = self._replace(lane, j.key)
        task.deaths += 1
        if task.deaths == 1:
            log.warning(
                "pipeline worker %s died (%s) while processing %s: running it once more",
                death.pid,
                death.cause,
                j.key,
            )
            self._queue.appendleft(task)
            return
        # Twice on the same trace is the trace (too big for this node's memory, most
        # likely), not bad luck. The raw trace and the open inbox row stay: a later daemon
        # start (more memory, fewer jobs) tries again, or an operator deletes the file.
        log.error(
            "pipeline worker %s died (%s) on %s again: giving up; the raw trace %s stays"
            " (check the kernel log for the OOM killer)",
            death.pid,
            death.cause,
            j.key,
            task.args["raw_trace"],
        )
        # A signal is a guess worth making (9: the OOM killer); an exit code is a fact.
        guess = "?" if death.signal is not None else ""
        self._finish(task, None, f"pipeline worker died twice ({death.cause}{guess})", True)

    def _replace(self, lane: _Lane, capture: str | None) -> WorkerDeath:
        """Drop ``lane``'s broken executor (the next ``_start`` makes a new one); the death."""
        pool, lane.pool = lane.pool, None
        # The executor has no public word for "broken" or for its worker: its private (but
        # typeshed-declared) ``_broken`` and ``_processes`` are the only places they live.
        procs = list(pool._processes.values()) if pool is not None and pool._processes else []
        if pool is not None:
            # Broken means its manager thread is ending, after it joins the dead worker:
            # waiting for that thread (milliseconds) makes the exit code readable.
            pool.shutdown(wait=True)
        dead = next((p for p in procs if p.exitcode is not None), procs[0] if procs else None)
        death = WorkerDeath(
            dead.pid if dead is not None else None,
            dead.exitcode if dead is not None else None,
            time.time(),
            capture,
        )
        self.restarts += 1
        self.last_death = death
        if capture is None:
            log.warning("idle pipeline worker %s died (%s); replaced", death.pid, death.cause)
        return death

    def _finish(
        self, task: _Task, res: ProcessedTrace | None, error: str | None, retryable: bool
    ) -> None:
        self.in_flight -= 1
        self.on_done(task.job, res, error, retryable)

    def _fail(self, j: Job, error: str) -> None:
        self.on_done(j, None, error, False)

    def shutdown(self) -> None:
        """Run every queued and running capture to its end, then stop the workers: a raw
        trace is deleted only on success, and the inbox row redoes anything cut off."""
        self.closing = True
        lanes = itertools.cycle(self._lanes)
        while self._queue:
            self._start(next(lanes), self._queue.popleft())
        for lane in self._lanes:
            if lane.pool is not None:
                lane.pool.shutdown(wait=True)
