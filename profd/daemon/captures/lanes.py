"""The pipeline's worker lanes: finished captures post-processed in worker processes.

The agent handler calls :meth:`Captures.submit` with a :class:`CaptureReport` once it is safely
in the index inbox; the gzip/fix/summarise work runs in worker processes (JSON parsing of a
tens-of-MB trace would otherwise hold the loop's GIL); its :class:`Outcome` comes back through
the reactor to ``on_done`` (the results), on the loop thread.

Each worker is a *lane*: a one-process ``ProcessPoolExecutor`` that is given one capture at a
time. A worker killed inside a shared pool (the OOM killer) breaks that pool for good and
fails every capture queued in it without saying which one was on the dead worker. With one
capture per lane the capture that was running is known: its lane gets a new executor and the
capture is run once more, and only a second death fails it. A worker that cannot be started
(fork or exec fails, or it dies before it takes its job and multiprocessing raises whatever it
was reading or writing, ``EOFError`` or ``BrokenPipeError``) counts as a death of that capture
too, never as an error of the caller that submitted it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import itertools
import logging
import multiprocessing
import os
import signal
import stat
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from functools import partial
from multiprocessing import popen_fork
from pathlib import Path
from typing import Any

from profd.daemon.captures.record import CaptureReport, Outcome
from profd.daemon.runtime import faults
from profd.daemon.spool import clientfiles
from profd.daemon.spool.clientfiles import DirSpec
from profd.daemon.spool.incoming import Incoming
from profd.daemon.spool.storage import Storage, is_disk_full
from profd.pipeline.files import FilePerms, ProcessedFile
from profd.pipeline.process import PipelineError, ProcessedTrace, process_open
from profd.reactor import Reactor

log = logging.getLogger("profd.captures")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: How long a worker that failed to start may take to be reaped (it is dead or dying).
STARTED_WAIT_S = 0.5


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


@dataclass(frozen=True)
class _Placement:
    """Where a worker reads one capture and writes its outputs, and as whom (pickled to it)."""

    spool: Path
    final: tuple[DirSpec, ...]  # the cycle's final dir below the spool, level by level
    perms: FilePerms  # of the outputs; its uid is also the one the raw files must have
    max_bytes: int


@dataclass
class _Task:
    capture: CaptureReport
    placement: _Placement
    deaths: int = 0


@dataclass
class _Lane:
    n: int  # its place in the lanes, as logs name it
    pool: cf.ProcessPoolExecutor | None = None
    task: _Task | None = None  # set from submit until its result is handled on the loop


def _run(c: CaptureReport, at: _Placement) -> ProcessedTrace:
    """In a worker: the capture's files, opened through directory descriptors, processed."""
    trace = c.raw_trace
    assert trace is not None  # submit checked
    try:
        with (
            clientfiles.opened_dir(at.spool, c.raw_dir) as src,
            clientfiles.made_dir(at.spool, at.final) as dst,
        ):
            fd, st = clientfiles.open_regular(src, trace, at.max_bytes, at.perms.uid)
            with os.fdopen(fd, "rb") as fh:
                res = process_open(
                    fh,
                    st.st_size,
                    str(at.spool.joinpath(*(lv.name for lv in at.final))),
                    perms=at.perms,
                    name=trace,
                    stem=c.stem,
                    rank=c.rank,
                    world_size=c.world_size,
                    header=_header(c),
                )
            extras = [
                ProcessedFile(kind, os.path.join(os.path.dirname(res.trace_path), to), size)
                for kind, name in c.extras
                for to in [c.final_name(name)]
                for size in [_move_extra(src, dst, name, to, at)]
            ]
    except clientfiles.UnsafeFile as exc:
        raise PipelineError(str(exc)) from None
    except FileNotFoundError as exc:
        raise PipelineError(f"missing: {exc.filename or exc}") from None
    faults.point("outputs-written", os.getppid())
    return replace(res, files=res.files + tuple(extras))


def _header(c: CaptureReport) -> dict[str, str]:
    """The trace's ``profd`` header: who captured it, when in the job."""
    return {
        "session": c.session_id,
        "job": c.training_job,
        "host": c.host,
        "pid": str(c.pid),
        "role": c.role,
        "cycle": str(c.cycle),
        "steps": ",".join(map(str, c.steps)),
        "region": str(c.region or ""),
        "stall_ms": f"{c.stall_ms:.1f}",
        "torch": str(c.torch),
        "device": str(c.device),
    }


def _move_extra(src: int, dst: int, name: str, to: str, at: _Placement) -> int:
    """Move raw file ``name`` into the cycle dir as ``to``; its size."""
    try:
        fd, st = clientfiles.open_regular(src, name, at.max_bytes, at.perms.uid)
    except FileNotFoundError:
        # Moved by an attempt that died before its result was indexed: adopt it.
        st = os.stat(to, dir_fd=dst, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise
        return st.st_size
    try:
        return clientfiles.move(src, name, (fd, st), dst, at.perms.mode, to)
    finally:
        os.close(fd)


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


def _popen_of(exc: BaseException) -> Any:
    """The ``Popen`` of the worker whose start raised ``exc``, if it got as far as a pid:
    multiprocessing loses it with the exception, but its frame still holds it."""
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        obj = frame.f_locals.get("self")
        if isinstance(obj, popen_fork.Popen):
            return obj
    return None


class Captures:
    """The pipeline's worker lanes. Each capture's :class:`Outcome` goes to ``on_done`` (on
    the loop thread) exactly once per run of it: a full index parks the outcome here until
    :meth:`retry_parked` hands it over again."""

    def __init__(
        self,
        incoming: Incoming,
        reactor: Reactor,
        workers: int,
        on_done: Callable[[Outcome], None],
        max_trace_bytes: int,
        storage: Storage,
    ) -> None:
        self.incoming = incoming
        self.storage = storage
        self.reactor = reactor
        self.on_done = on_done
        self.max_trace_bytes = max_trace_bytes
        self.in_flight = 0  # captures queued or running, until on_done
        self.restarts = 0  # workers replaced after they died
        self.last_death: WorkerDeath | None = None
        self.closing = False
        self._ctx = multiprocessing.get_context("spawn")
        self._lanes = [_Lane(n) for n in range(max(1, workers))]
        self._queue: deque[_Task] = deque()
        #: Captures a full disk stopped, with their outcome when only its index write is
        #: left (None: the pipeline runs again): :meth:`retry_parked` tries them again.
        self._parked: list[tuple[_Task, Outcome | None]] = []

    def submit(self, c: CaptureReport) -> None:
        """Validate and queue one capture; bad reports fail at once, without the pool."""
        task = _Task(
            c,
            _Placement(
                self.incoming.spool,
                self.incoming.final_levels(c.training_job, c.session_id, c.cycle),
                self.incoming.file_perms(c.uid, c.gid),
                self.max_trace_bytes,
            ),
        )
        self.in_flight += 1
        if c.raw_trace is None:
            return self._finish(task, Outcome(c, error=c.error or "no trace file in report"))
        if self.closing:
            # Too late for this daemon; the open inbox row brings it back at the next start.
            why = "pipeline unavailable: the daemon is stopping"
            return self._finish(task, Outcome(c, error=why, retry=True))
        self._queue.append(task)
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
            "waiting_for_space": len(self._parked),
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
        """Hand ``task`` to ``lane``'s worker; False if it could not: the task failed, or its
        worker did not start and it is back at the head of the queue."""
        why = "no worker"
        for _ in range(2):
            try:
                if lane.pool is None:
                    lane.pool = cf.ProcessPoolExecutor(
                        max_workers=1,
                        mp_context=self._ctx,
                        initializer=_die_with,
                        initargs=(os.getpid(),),
                    )
                fut = lane.pool.submit(_run, task.capture, task.placement)
            except BrokenProcessPool:
                # Its worker died while idle (the OOM killer picks the largest process, and a
                # worker that just parsed a big trace can be that); nothing was lost.
                self._replace(lane, None)
                continue
            except RuntimeError as exc:  # shut down under us
                why = str(exc)
                break
            except Exception as exc:
                self._start_failed(lane, task, exc)
                return False
            lane.task = task
            fut.add_done_callback(partial(self._done_soon, lane, task))
            return True
        # Retryable: the inbox row stays open and the next daemon start redoes the capture.
        self._finish(task, Outcome(task.capture, error=f"pipeline unavailable: {why}", retry=True))
        return False

    def _done_soon(self, lane: _Lane, task: _Task, fut: cf.Future[ProcessedTrace]) -> None:
        # On the executor's manager thread: hand over to the loop, which owns the lanes.
        self.reactor.call_soon(self._finished, lane, task, fut)

    def _finished(self, lane: _Lane, task: _Task, fut: cf.Future[ProcessedTrace]) -> None:
        if lane.task is task:
            lane.task = None
        c = task.capture
        try:
            res = fut.result()
        except BrokenProcessPool:
            self._worker_died(lane, task)
        except PipelineError as exc:
            self._finish(task, Outcome(c, error=f"pipeline: {exc}"))
        except Exception as exc:
            if is_disk_full(exc):
                # Outputs half written were removed by the pipeline; the raw trace is in
                # place: the capture waits, and is done once space is back.
                self.storage.failed("spool", exc, f"the outputs of capture {c.key}")
                self._parked.append((task, None))
            else:
                # The raw trace is still in place, so the next daemon start tries again
                # (the inbox row stays open).
                log.error("pipeline failed on %s: %r", c.key, exc)
                why = f"pipeline error: {type(exc).__name__}: {exc}"
                self._finish(task, Outcome(c, error=why, retry=True))
        else:
            self.storage.ok("spool")
            self._finish(task, Outcome(c, trace=res))
        if not self.closing:
            self._dispatch()

    def _start_failed(self, lane: _Lane, task: _Task, exc: Exception) -> None:
        """``lane``'s worker for ``task`` did not start: a death of that capture, said in one
        line (the exception is multiprocessing's plumbing, its traceback says nothing)."""
        pool, lane.pool = lane.pool, None
        popen = _popen_of(exc)
        pid = getattr(popen, "pid", None)
        code: int | None = None
        if popen is not None and pid is not None:
            with contextlib.suppress(Exception):
                code = popen.wait(STARTED_WAIT_S)  # reaped, and its exit status known
                if code is None:  # alive but useless: it will never be given a job
                    popen.kill()
                    code = popen.wait(STARTED_WAIT_S)
        if pool is not None:
            # Nothing runs in it: no worker joined it, its manager thread never started.
            with contextlib.suppress(Exception):
                pool.shutdown(wait=True, cancel_futures=True)
        death = WorkerDeath(pid, code, time.time(), task.capture.key)
        self.restarts += 1
        self.last_death = death
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        why = f"{death.cause}; {error}" if code is not None else error
        self._retry_or_fail(lane, task, death, f"while starting ({why}), before processing")

    def _worker_died(self, lane: _Lane, task: _Task) -> None:
        c = task.capture
        if self.closing:
            # Its executor is shut down already; the inbox row brings the capture back.
            why = "pipeline worker died while the daemon stopped"
            self._finish(task, Outcome(c, error=why, retry=True))
            return
        death = self._replace(lane, c.key)
        self._retry_or_fail(lane, task, death, f"({death.cause}) while processing")

    def _retry_or_fail(self, lane: _Lane, task: _Task, death: WorkerDeath, how: str) -> None:
        """``lane``'s worker died ``how`` ``task``: run it once more, or the second time fail
        it. One line each: the lane, the worker, its exit status."""
        c = task.capture
        who = f"pipeline lane {lane.n}: worker {death.pid if death.pid is not None else '?'}"
        task.deaths += 1
        if task.deaths == 1:
            log.warning("%s died %s %s: running it once more", who, how, c.key)
            self._queue.appendleft(task)
            return
        # Twice on the same trace is the trace (too big for this node's memory, most
        # likely), not bad luck. The raw trace and the open inbox row stay: a later daemon
        # start (more memory, fewer jobs) tries again, or an operator deletes the file.
        log.error(
            "%s died %s %s again: giving up; the raw trace %s stays"
            " (check the kernel log for the OOM killer)",
            who,
            how,
            c.key,
            task.placement.spool.joinpath(*c.raw_dir, c.raw_trace or ""),
        )
        # A signal is a guess worth making (9: the OOM killer); an exit code is a fact.
        guess = "?" if death.signal is not None else ""
        why = f"pipeline worker died twice ({death.cause}{guess})"
        self._finish(task, Outcome(c, error=why, retry=True))

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
            log.warning(
                "pipeline lane %d: idle worker %s died (%s); replaced",
                lane.n,
                death.pid,
                death.cause,
            )
        return death

    def _finish(self, task: _Task, outcome: Outcome) -> None:
        try:
            self.on_done(outcome)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            # The index is full: its write waits; the outputs are written already.
            self.storage.failed("index", exc, f"the result of capture {task.capture.key}")
            self._parked.append((task, outcome))
            return
        self.storage.ok("index")
        self.in_flight -= 1

    def retry_parked(self) -> None:
        """Try again what a full disk stopped (called every housekeeping tick)."""
        parked, self._parked = self._parked, []
        for task, outcome in parked:
            if outcome is not None:
                self._finish(task, outcome)
            else:
                self._queue.append(task)
        if not self.closing:
            self._dispatch()

    @property
    def parked(self) -> int:
        return len(self._parked)

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
