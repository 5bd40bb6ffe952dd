"""nsys collections for ``--backend nsys`` sessions. Owned by the event loop.

The targets of one profd session that run under the same ``nsys launch`` share one nsys
collection (nsys collects per launched process tree), so they share one report per cycle:
a :class:`Collection`. Its life:

1. ``nsys start`` runs on a worker thread; targets are armed only once it succeeded, so no
   rank calls ``cudaProfilerStart`` before nsys listens for it.
2. Each rank reports the end of each cycle (``captured`` with no files). When every live
   target of the collection has, the cycle waits for its report.
3. ``tick`` polls the output path the daemon chose; a report whose size is stable is moved into
   the cycle dir and summarised on a worker thread, then indexed for each target.
4. A report that does not appear within ``[nsys] finalize_timeout`` gets ``nsys stop`` (nsys
   finalises what it collected); if still nothing comes, the cycle fails with the path it
   expected, never silently.
5. An nsys that cannot import (no ``QdstrmImporter``, or one that cannot load, as the copy
   inside Nsight Compute) is refused in :meth:`NsysRuns.check`, before anything is armed: it
   would hold the armed ranks in ``cudaProfilerStop`` for minutes and leave only a ``.qdstrm``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profd import nsys
from profd.config import NsysConfig
from profd.daemon.captures.record import CaptureReport, Outcome
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.sessions.arming import Arms
from profd.daemon.sessions.state import Session, Sessions, Target
from profd.daemon.spool.incoming import Incoming
from profd.pipeline.nsys_report import finish_report
from profd.pipeline.process import ProcessedTrace
from profd.reactor import Reactor
from profd.scheduling.refusal import Refused
from profd_client import protocol as P

log = logging.getLogger("profd.nsys")

Key = tuple[str, int]
#: After ``nsys stop``: how long nsys may take to write what it had.
STOP_GRACE_S = 30.0


@dataclass
class Collection:
    session: str  # the profd session
    job: str
    nsys_session: str
    base: Path  # the output path given to ``nsys start``
    keys: list[Key]
    ranges: int
    started: bool = False
    stopped: bool = False  # ``nsys stop`` was sent: no report comes after what it flushed
    dead: bool = False  # gave up on a report: later cycles fail rather than guess
    busy: bool = False  # an nsys command or a report move is in flight
    reported: dict[int, dict[Key, CaptureReport]] = field(default_factory=dict)
    ended: list[int] = field(default_factory=list)  # cycles whose range is over, in order
    collected: int = 0  # reports taken so far; ended[collected] is the one awaited
    deadline: float | None = None
    sizes: dict[Path, int] = field(default_factory=dict)

    def stem(self, s: Session) -> str:
        if len(self.keys) == 1:
            return s.targets[self.keys[0]].stem
        return f"nsys-{self.nsys_session}"


class NsysRuns:
    def __init__(
        self,
        cfg: NsysConfig,
        host: str,
        sessions: Sessions,
        registry: Registry,
        arms: Arms,
        incoming: Incoming,
        reactor: Reactor,
        on_done: Callable[[Outcome], None],
    ) -> None:
        self.cfg = cfg
        self.host = host
        self.sessions = sessions
        self.registry = registry
        self.arms = arms
        self.incoming = incoming
        self.reactor = reactor
        self.on_done = on_done
        self.by_session: dict[str, list[Collection]] = {}
        self.pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="profd-nsys")

    @property
    def binary(self) -> str | None:
        return nsys.find(self.cfg.path)

    # --- start ---------------------------------------------------------------------------------
    def check(self, spec: dict[str, Any], options: dict[str, Any], targets: list[Client]) -> None:
        """Refuse what the nsys backend cannot do, with the reason, before anything starts."""
        if self.binary is None:
            where = self.cfg.path or "nsys on PATH"
            raise Refused(
                P.ErrorCode.UNSUPPORTED, f"nsys not found ({where}): set [nsys] path or PROFD_NSYS"
            )
        cannot = nsys.import_problem(self.binary)
        if cannot is not None:
            # Refused before anything is armed: such an nsys holds every armed rank's
            # training thread inside cudaProfilerStop for about two minutes and then leaves
            # only a raw .qdstrm, so the capture would cost the job and give nothing.
            raise Refused(P.ErrorCode.UNSUPPORTED, f"{cannot}; {nsys.INSTALL}")
        if spec.get("region"):
            raise Refused(
                P.ErrorCode.UNSUPPORTED,
                "--region is torch-only for now; use --backend torch --region NAME",
            )
        if spec.get("warmup"):
            raise Refused(
                P.ErrorCode.BAD_REQUEST,
                "--warmup is torch.profiler's; nsys records from the first step",
            )
        torch_only = sorted(k for k in P.BOOL_OPTIONS if options.get(k))
        if torch_only:
            flag = "--" + torch_only[0].replace("_", "-")
            raise Refused(
                P.ErrorCode.BAD_REQUEST,
                f"{flag} is a torch.profiler option; choose nsys's tracing with"
                " `profctl run --nsys --nsys-trace ...`",
            )
        busy = {
            coll.nsys_session: sid
            for sid, colls in self.by_session.items()
            for coll in colls
            if coll.collected < coll.ranges and not coll.stopped
        }
        for c in targets:
            if c.nsys_session in busy:
                raise Refused(
                    P.ErrorCode.BUSY,
                    f"nsys session {c.nsys_session} (pid {c.pid}) is collecting for session"
                    f" {busy[c.nsys_session]}: nsys runs one collection per launch at a time",
                )
            if not c.nsys_session:
                raise Refused(
                    P.ErrorCode.UNSUPPORTED,
                    f"{c.role} rank {c.rank} (pid {c.pid}) does not run under nsys: launch"
                    " the job with `profctl run --nsys -- <command>`",
                )

    def begin(self, s: Session, targets: list[Client]) -> None:
        """Start one collection per nsys launch; the (held) targets are armed once it runs."""
        base_dir = self.incoming.nsys_dir(s.job, s.id)
        groups: dict[str, list[Client]] = {}
        for c in targets:
            groups.setdefault(c.nsys_session or "", []).append(c)
        colls = self.by_session.setdefault(s.id, [])
        for name, members in sorted(groups.items()):
            coll = Collection(
                session=s.id,
                job=s.job,
                nsys_session=name,
                base=base_dir / name,
                keys=[c.key for c in members],
                ranges=len(s.cycles),
                busy=True,
            )
            colls.append(coll)
            self._submit(coll, self._start, self._started)

    def _start(self, coll: Collection, binary: str) -> str | None:
        coll.base.parent.mkdir(parents=True, exist_ok=True)
        argv = nsys.start_argv(binary, coll.nsys_session, coll.base, coll.ranges)
        try:
            nsys.run(argv, self.cfg.command_timeout)
            return None
        except nsys.NsysError as first:
            # A collection left running (a daemon killed mid-session) blocks every later
            # start in that nsys session: cancel it and try once more.
            try:
                nsys.run(nsys.cancel_argv(binary, coll.nsys_session), self.cfg.command_timeout)
                nsys.run(argv, self.cfg.command_timeout)
                return None
            except nsys.NsysError:
                return str(first)

    def _started(self, coll: Collection, err: str | None) -> None:
        coll.busy = False
        s = self.sessions.exact(coll.session)
        if s is None:
            return
        coll.started = err is None
        for key in coll.keys:
            t = s.targets[key]
            self.sessions.release(s, t)
            if err is not None:
                self.sessions.fail(s, t, f"nsys start failed: {err}")
                continue
            c = self.registry.lookup(key)
            if c is not None:
                self.arms.arm(s, c)
        if err is None:
            log.info("session %s: nsys collection on %s -> %s*", s.id, coll.nsys_session, coll.base)

    # --- reports from the ranks ----------------------------------------------------------------
    def cycle_reported(self, s: Session, t: Target, c: CaptureReport) -> None:
        coll = self._collection(s.id, t.key)
        if coll is None:
            return
        self.sessions.queued(s, t)
        coll.reported.setdefault(c.cycle, {})[t.key] = c
        self._check_ended(s, coll, time.monotonic())

    def _collection(self, session: str, key: Key) -> Collection | None:
        for coll in self.by_session.get(session, ()):
            if key in coll.keys:
                return coll
        return None

    def _check_ended(self, s: Session, coll: Collection, now: float) -> None:
        for cycle in sorted(coll.reported):
            if cycle in coll.ended:
                continue
            done = coll.reported[cycle]
            waiting = [k for k in coll.keys if k not in done and not s.targets[k].finished]
            if waiting:
                return  # cycles end in order: a later one cannot have ended first
            coll.ended.append(cycle)
            if coll.deadline is None:
                coll.deadline = now + self.cfg.finalize_timeout

    # --- polling for reports (the loop's tick) --------------------------------------------------
    def poll(self, now: float) -> None:
        for sid, colls in list(self.by_session.items()):
            s = self.sessions.exact(sid)
            if s is None:
                continue
            for coll in colls:
                if coll.busy or not coll.started:
                    continue
                self._check_ended(s, coll, now)
                if coll.collected < len(coll.ended):
                    self._look(s, coll, now)

    def _look(self, s: Session, coll: Collection, now: float) -> None:
        if coll.dead:
            # After a give-up a late report could be mistaken for a later cycle's.
            self._give_up(s, coll)
            return
        found = nsys.reports(coll.base)
        if found:
            # Collected reports are moved away, so the oldest one left is the one awaited.
            report = found[0]
            try:
                size = report.stat().st_size
            except OSError:
                return
            # nsys may still be writing: take a report once its size held for one tick.
            if size > 0 and coll.sizes.get(report) == size:
                coll.busy = True
                cycle = coll.ended[coll.collected]
                header = self._header(s, coll, cycle)
                stem = coll.stem(s)
                final = self.incoming.final_dir(s.job, s.id, cycle)
                self._submit(
                    coll,
                    lambda c, b: finish_report(
                        b, report, final, stem, header, self.cfg.command_timeout
                    ),
                    lambda c, res: self._collected(c, cycle, res, None),
                    on_error=lambda c, e: self._collected(c, cycle, None, e),
                )
            else:
                coll.sizes[report] = size
            return
        if coll.deadline is None or now < coll.deadline:
            return
        if not coll.stopped:
            coll.stopped = True
            coll.busy = True
            log.warning(
                "session %s: no nsys report at %s* after %.0fs; running nsys stop",
                s.id,
                coll.base,
                self.cfg.finalize_timeout,
            )
            self._submit(coll, self._stop, self._after_stop)
            return
        self._give_up(s, coll)

    def _stop(self, coll: Collection, binary: str) -> str | None:
        try:
            nsys.run(nsys.stop_argv(binary, coll.nsys_session), self.cfg.command_timeout)
            return None
        except nsys.NsysError as exc:
            return str(exc)

    def _after_stop(self, coll: Collection, err: str | None) -> None:
        coll.busy = False
        coll.deadline = time.monotonic() + STOP_GRACE_S
        if err:
            log.warning("session %s: %s", coll.session, err)

    def _give_up(self, s: Session, coll: Collection, why: str | None = None) -> None:
        """Every ended cycle still without a report fails; after a stop none will come."""
        if why is None:
            lone = nsys.lone_streams(coll.base)
            why = (
                nsys.left_only(lone[0], None)
                if lone
                else f"nsys report not written: expected {coll.base}*{nsys.REPORT_SUFFIX}"
                " (nsys stop did not produce it)"
            )
        if not coll.dead:
            log.warning("session %s: %s", s.id, why)
        coll.dead = True
        while coll.collected < len(coll.ended):
            self._collected(coll, coll.ended[coll.collected], None, why)

    def _collected(
        self, coll: Collection, cycle: int, res: ProcessedTrace | None, err: str | None
    ) -> None:
        coll.busy = False
        coll.collected += 1
        coll.deadline = (
            time.monotonic() + self.cfg.finalize_timeout
            if coll.collected < len(coll.ended)
            else None
        )
        s = self.sessions.exact(coll.session)
        if s is None:
            return
        for c in coll.reported.get(cycle, {}).values():
            # One report of several ranks is indexed for each of them, by design.
            self.on_done(Outcome(c, res, err, shared=len(coll.keys) > 1))

    def _header(self, s: Session, coll: Collection, cycle: int) -> dict[str, str]:
        ms = coll.reported[cycle]
        steps = next(iter(ms.values())).steps
        targets = ", ".join(
            f"{s.targets[k].role}:{s.targets[k].rank} (pid {k[1]})" for k in sorted(ms)
        )
        return {
            "session": s.id,
            "job": s.job,
            "host": self.host,
            "nsys_session": coll.nsys_session,
            "cycle": str(cycle),
            "steps": ",".join(map(str, steps)),
            "targets": targets,
        }

    # --- session end and restarts ----------------------------------------------------------------
    def session_ended(self, s: Session) -> None:
        binary = self.binary
        for coll in self.by_session.pop(s.id, ()):
            if s.state == "cancelled":
                for p in coll.base.parent.glob(coll.base.name + "*"):
                    p.unlink(missing_ok=True)
            if coll.started and not coll.stopped and coll.collected < coll.ranges and binary:
                # Cycles were missed or ranks left: the collection still waits for ranges,
                # and would refuse the next session's `nsys start`.
                argv = nsys.cancel_argv(binary, coll.nsys_session)
                self.pool.submit(_quiet, argv, self.cfg.command_timeout)

    def restored(self, s: Session) -> None:
        """A session left open by a killed daemon: its collection state is gone with it."""
        base = self.incoming.nsys_dir(s.job, s.id)
        why = f"the daemon restarted during this nsys session; reports nsys wrote stay in {base}"
        for t in s.targets.values():
            if not t.terminal:
                self.sessions.fail(s, t, why, gone=True)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # --- plumbing ------------------------------------------------------------------------------
    def _submit(
        self,
        coll: Collection,
        work: Callable[[Collection, str], Any],
        done: Callable[[Collection, Any], None],
        on_error: Callable[[Collection, str], None] | None = None,
    ) -> None:
        """Run ``work`` on a worker thread; ``done`` (or ``on_error``) runs on the loop."""
        binary = self.binary or (self.cfg.path or "nsys")

        def finished(fut: cf.Future[Any]) -> None:
            try:
                res = fut.result()
            except Exception as exc:
                log.error("nsys work for session %s failed: %r", coll.session, exc)
                msg = f"{type(exc).__name__}: {exc}"
                if on_error is not None:
                    self.reactor.call_soon(on_error, coll, msg)
                else:
                    self.reactor.call_soon(done, coll, msg)
                return
            self.reactor.call_soon(done, coll, res)

        self.pool.submit(work, coll, binary).add_done_callback(finished)


def _quiet(argv: list[str], timeout: float) -> None:
    try:
        nsys.run(argv, timeout)
    except nsys.NsysError as exc:
        log.info("%s", exc)
