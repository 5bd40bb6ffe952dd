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
import stat
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from profd.daemon.runtime import faults
from profd.daemon.spool import clientfiles
from profd.daemon.spool.clientfiles import DirSpec
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.daemon.spool.storage import Storage, is_disk_full
from profd.pipeline.files import FilePerms, ProcessedFile
from profd.pipeline.process import PipelineError, ProcessedTrace, process_open
from profd.reactor import Reactor
from profd_client import protocol as P

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
    revision: int = 0  # the session revision (``plan``) the capture was armed with
    uid: int = -1  # the process's, from the kernel; -1 in reports of an older daemon
    gid: int = -1


TRACE_NAME = "{stem}.pt.trace.json"


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


#: What the pipeline made of a capture: result, error, and whether a restart may redo it.
_Outcome = tuple[ProcessedTrace | None, str | None, bool]


@dataclass
class _Lane:
    pool: cf.ProcessPoolExecutor | None = None
    task: _Task | None = None  # set from submit until its result is handled on the loop


def _run(a: dict[str, Any]) -> ProcessedTrace:
    """In a worker: the capture's files, opened through directory descriptors, processed."""
    spool = Path(a["spool"])
    perms = FilePerms(a["file_mode"], a["uid"], a["gid"])
    try:
        with (
            clientfiles.opened_dir(spool, a["src"]) as src,
            clientfiles.made_dir(spool, [DirSpec(**lv) for lv in a["final"]]) as dst,
        ):
            fd, st = clientfiles.open_regular(src, a["trace"], a["max_bytes"], a["uid"])
            with os.fdopen(fd, "rb") as fh:
                res = process_open(
                    fh,
                    st.st_size,
                    str(spool.joinpath(*(lv["name"] for lv in a["final"]))),
                    perms=perms,
                    name=a["trace"],
                    **a["process"],
                )
            extras = [
                ProcessedFile(kind, os.path.join(os.path.dirname(res.trace_path), name), size)
                for kind, name in a["extras"]
                for size in [_move_extra(src, dst, name, a)]
            ]
    except clientfiles.UnsafeFile as exc:
        raise PipelineError(str(exc)) from None
    except FileNotFoundError as exc:
        raise PipelineError(f"missing: {exc.filename or exc}") from None
    faults.point("outputs-written", os.getppid())
    return replace(res, files=res.files + tuple(extras))


def _move_extra(src: int, dst: int, name: str, a: dict[str, Any]) -> int:
    try:
        fd, st = clientfiles.open_regular(src, name, a["max_bytes"], a["uid"])
    except FileNotFoundError:
        # Moved by an attempt that died before its result was indexed: adopt it.
        st = os.stat(name, dir_fd=dst, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise
        return st.st_size
    try:
        return clientfiles.move(src, name, (fd, st), dst, a["file_mode"])
    finally:
        os.close(fd)


def _report_files(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, name) of a report's files: the agent handler matched each path to the
    process's own files already, so only the name is used, in that process's dir."""
    return [(f["kind"], Path(f["path"]).name) for f in report.get("files") or []]


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
        on_raw_deleted: Callable[[Job], None],
        perms: SpoolPerms,
        max_trace_bytes: int,
        storage: Storage,
    ) -> None:
        self.spool = spool
        self.storage = storage
        self.reactor = reactor
        self.on_done = on_done
        self.on_raw_deleted = on_raw_deleted
        self.perms = perms
        self.max_trace_bytes = max_trace_bytes
        self.in_flight = 0  # captures queued or running, until on_done
        self.restarts = 0  # workers replaced after they died
        self.last_death: WorkerDeath | None = None
        self.closing = False
        self._ctx = multiprocessing.get_context("spawn")
        self._lanes = [_Lane() for _ in range(max(1, workers))]
        self._queue: deque[_Task] = deque()
        #: Captures a full disk stopped, with their outcome when only its index write is
        #: left (None: the pipeline runs again): :meth:`retry_parked` tries them again.
        self._parked: list[tuple[_Task, _Outcome | None]] = []
        self._homes: set[tuple[str, int, str]] = set()  # (session, revision, target dir) made

    # --- where clients write --------------------------------------------------------------
    def incoming_dir(self, job: str, session: str) -> Path:
        return self.spool / INCOMING / job / session

    def _incoming_levels(self, job: str, session: str, revision: int) -> list[DirSpec]:
        names = [INCOMING, job, session] + ([f"plan{revision}"] if revision else [])
        return [self.perms.shared(n) for n in names]

    def home(self, job: str, session: str, revision: int, host: str, pid: int) -> Path:
        """The directory only this process writes its captures into (made by :meth:`make_home`)."""
        levels = self._incoming_levels(job, session, revision)
        return self.spool.joinpath(*(lv.name for lv in levels), P.target_dir(host, pid))

    def make_home(
        self, job: str, session: str, revision: int, host: str, pid: int, uid: int, gid: int
    ) -> None:
        """Create the process's own directory (its uid's, mode 0700) before it is armed."""
        name = P.target_dir(host, pid)
        if (session, revision, name) not in self._homes:
            with clientfiles.made_dir(
                self.spool,
                [*self._incoming_levels(job, session, revision), self._own(name, uid, gid)],
            ):
                pass
            self._homes.add((session, revision, name))

    def make_homes(
        self, job: str, session: str, revision: int, procs: Iterable[tuple[str, int, int, int]]
    ) -> None:
        """:meth:`make_home` for many processes (host, pid, uid, gid) in one walk of the
        shared levels. Best effort: one that fails here is tried alone when it is armed."""
        todo = [
            self._own(name, uid, gid)
            for host, pid, uid, gid in procs
            if (session, revision, name := P.target_dir(host, pid)) not in self._homes
        ]
        if not todo:
            return
        try:
            made = clientfiles.make_children(
                self.spool, self._incoming_levels(job, session, revision), todo
            )
        except (OSError, clientfiles.UnsafeFile):
            return
        self._homes.update((session, revision, name) for name in made)

    @staticmethod
    def _own(name: str, uid: int, gid: int) -> DirSpec:
        root = os.geteuid() == 0
        return DirSpec(name, 0o700, uid if root else -1, gid if root else -1)

    def own_files(
        self, job: str, session: str, revision: int, host: str, pid: int, cycle: int, stem: str
    ) -> dict[str, Path]:
        """The only files a process may report for a cycle, by kind."""
        d = self.home(job, session, revision, host, pid) / f"c{cycle}"
        return {"trace": d / TRACE_NAME.format(stem=stem), "memory": d / f"{stem}.memory.pickle"}

    def discard(self, j: Job, names: list[str]) -> None:
        """Delete files of a capture nobody will process (superseded steps): its own only."""
        try:
            with clientfiles.opened_dir(self.spool, self._src(j)) as src:
                for name in names:
                    clientfiles.unlink(src, name)
        except (OSError, clientfiles.UnsafeFile) as exc:
            log.warning("could not drop superseded capture %s: %s", j.key, exc)

    def _src(self, j: Job) -> list[str]:
        levels = self._incoming_levels(j.job, j.session, j.revision)
        return [lv.name for lv in levels] + [P.target_dir(j.host, j.pid), f"c{j.cycle}"]

    def remove_incoming(self, job: str, session: str) -> None:
        """Drop a finished session's emptied ``.incoming`` dirs; any holding a file stay."""
        self._homes = {k for k in self._homes if k[0] != session}
        try:
            with clientfiles.opened_dir(self.spool, [INCOMING, job]) as jfd:
                clientfiles.remove_empty_tree(jfd, session)
            with clientfiles.opened_dir(self.spool, [INCOMING]) as ifd:
                clientfiles.remove_empty_tree(ifd, job)
        except (OSError, clientfiles.UnsafeFile):
            pass

    def final_dir(self, job: str, session: str, cycle: int) -> Path:
        return self.spool / job / session / f"c{cycle}"

    def _file_owner(self, j: Job) -> tuple[int, int]:
        if os.geteuid() == 0:
            return j.uid, self.perms.owner_gid(j.gid) if j.gid >= 0 else -1
        group = self.perms.group
        return -1, group if group is not None and group in os.getgroups() else -1

    def submit(self, j: Job) -> None:
        """Validate and queue one capture; bad reports fail at once, without the pool."""
        trace: str | None = None
        extras: list[tuple[str, str]] = []
        for kind, name in _report_files(j.report):
            if kind == "trace" and trace is None:
                trace = name
            else:
                extras.append((kind, name))
        if trace is None:
            return self._fail(j, j.report.get("error") or "no trace file in report")
        uid, gid = self._file_owner(j)
        args = {
            "spool": str(self.spool),
            "src": self._src(j),
            "trace": trace,
            "extras": extras,
            "final": [
                asdict(self.perms.shared(j.job)),
                asdict(self.perms.final(j.session)),
                asdict(self.perms.final(f"c{j.cycle}")),
            ],
            "file_mode": self.perms.file_mode,
            "uid": uid,
            "gid": gid,
            "max_bytes": self.max_trace_bytes,
            "process": {
                "stem": f"{j.role}-r{j.rank}",
                "rank": j.rank,
                "world_size": j.world_size,
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
            if is_disk_full(exc):
                # Outputs half written were removed by the pipeline; the raw trace is in
                # place: the capture waits, and is done once space is back.
                self.storage.failed("spool", exc, f"the outputs of capture {j.key}")
                self._parked.append((task, None))
            else:
                # The raw trace is still in place, so the next daemon start tries again
                # (the inbox row stays open).
                log.error("pipeline failed on %s: %r", j.key, exc)
                self._finish(task, None, f"pipeline error: {type(exc).__name__}: {exc}", True)
        else:
            self.storage.ok("spool")
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
            os.path.join(task.args["spool"], *task.args["src"], task.args["trace"]),
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
        try:
            self.on_done(task.job, res, error, retryable)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            # The index is full: its write waits; the outputs are written already.
            self.storage.failed("index", exc, f"the result of capture {task.job.key}")
            self._parked.append((task, (res, error, retryable)))
            return
        self.storage.ok("index")
        self.in_flight -= 1
        if res is not None:
            faults.point("trace-indexed")
            # Only now, with the result in the index: a daemon killed before on_done
            # processes the raw trace again at its next start (the outputs it wrote the first
            # time are simply replaced), one killed after it deletes the raw trace then.
            self.drop_raw(task.job)
            faults.point("raw-deleted")

    def drop_raw(self, j: Job) -> None:
        """Delete an indexed capture's raw trace, and say so (``on_raw_deleted``)."""
        self.discard(j, [n for kind, n in _report_files(j.report) if kind == "trace"][:1])
        self.on_raw_deleted(j)

    def retry_parked(self) -> None:
        """Try again what a full disk stopped (called every housekeeping tick)."""
        parked, self._parked = self._parked, []
        for task, outcome in parked:
            if outcome is not None:
                self._finish(task, *outcome)
            else:
                self._queue.append(task)
        if not self.closing:
            self._dispatch()

    @property
    def parked(self) -> int:
        return len(self._parked)

    def _fail(self, j: Job, error: str) -> None:
        self.in_flight += 1
        self._finish(_Task(j, {}), None, error, False)

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
