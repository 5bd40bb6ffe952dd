"""A capture report, from the ``captured`` message to the pipeline.

The report is checked against the session (paths come from it, never from the client),
stored in the index's inbox, and only then acked: a daemon killed after the ack redoes it
from the inbox. A report a full disk could not store waits here, not acked (its client
keeps it), until :meth:`Intake.retry_deferred` stores it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from profd.daemon.agent.send import Send
from profd.daemon.captures.lanes import Captures
from profd.daemon.captures.record import CaptureReport
from profd.daemon.clients.registry import Client
from profd.daemon.runtime import faults
from profd.daemon.sessions.nsysruns import NsysRuns
from profd.daemon.sessions.state import Session, Sessions, Target
from profd.daemon.spool.incoming import Incoming
from profd.daemon.spool.storage import Storage, is_disk_full
from profd.store.index import InboxRepo
from profd_client import protocol as P

log = logging.getLogger("profd.agents")


class Intake:
    def __init__(
        self,
        sessions: Sessions,
        inbox: InboxRepo,
        captures: Captures,
        incoming: Incoming,
        nsys: NsysRuns,
        storage: Storage,
        send: Send,
    ) -> None:
        self.sessions = sessions
        self.inbox = inbox
        self.captures = captures
        self.incoming = incoming
        self.nsys = nsys
        self.storage = storage
        self.send = send
        #: Reports the index could not store (a full disk), not acked: key -> (ident, report,
        #: ack). Their clients keep them; :meth:`retry_deferred` stores and acks them.
        self._deferred: dict[str, tuple[bytes, CaptureReport, bytes]] = {}

    def captured(self, c: Client, m: P.Captured) -> None:
        ack = P.encode(P.ACK, v=c.version, id=m.id)
        s = self.sessions.exact(m.session)
        t = s.targets.get(c.key) if s is not None else None
        if s is None or t is None:
            # Another job's session, a finished one, or none at all: a peer reports only
            # about sessions it was armed for. Acked, so an honest late client stops resending.
            self.send(c.ident, ack)
            log.warning(
                "refused a capture report from pid %s for session %r: not one of its sessions",
                c.pid,
                m.session[:64],
            )
            return
        # Paths come from the session, never from what the client claims.
        capture = CaptureReport.from_message(m, s.job, t, c.uid, c.gid)
        if capture.revision < s.revision:
            # A capture of steps the session moved away from (a re-plan raced with it).
            self.send(c.ident, ack)
            self.discard(s, t, capture)
            return
        if s.backend == "nsys":
            # nsys writes the report itself: the rank only says its range is over.
            self.send(c.ident, ack)
            self.nsys.cycle_reported(s, t, capture)
            return
        problem = self._report_problem(s, t, capture)
        if problem is not None:
            self.send(c.ident, ack)
            log.warning(
                "refused a capture report from pid %s in session %s: %s", c.pid, s.id, problem
            )
            return
        if capture.key in self._deferred:  # sent again while it waits for space: answer that
            self._deferred[capture.key] = (c.ident, capture, ack)
            return
        fresh = self._store(capture)
        if fresh is None:
            # Not durable, so not acked: the target waits in "capturing"/"processing" (its
            # capture counted as outstanding), and status says why, until space is back.
            self._deferred[capture.key] = (c.ident, capture, ack)
            self.sessions.queued(s, t)
            return
        # Ack only once the report is durable: a daemon killed now redoes it on restart.
        self.send(c.ident, ack)
        faults.point("report-acked")
        if fresh:
            self.sessions.queued(s, t)
            self.captures.submit(capture)

    @property
    def deferred(self) -> int:
        return len(self._deferred)

    def retry_deferred(self) -> None:
        """Store and ack the reports a full index refused (every housekeeping tick)."""
        for key, (ident, capture, ack) in list(self._deferred.items()):
            fresh = self._store(capture)
            if fresh is None:
                return  # still full: the rest would fail the same way
            del self._deferred[key]
            self.send(ident, ack)
            if fresh:  # counted as outstanding when it was deferred
                self.captures.submit(capture)

    def _store(self, capture: CaptureReport) -> bool | None:
        """Put a report in the inbox: whether it is new there, or None when a full disk
        refused it (any other error is a bug, and raises)."""
        try:
            fresh = self.inbox.inbox_put(capture.key, capture.to_row())
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            self.storage.failed("index", exc, f"the capture report {capture.key}")
            return None
        self.storage.ok("index")
        return fresh

    def _report_problem(self, s: Session, t: Target, capture: CaptureReport) -> str | None:
        if not t.reportable:
            return f"its target is {t.state}, not capturing"
        cycle = capture.cycle
        if s.region is None and cycle >= len(s.cycles):
            return f"cycle {cycle} is not one of the session's {len(s.cycles)}"
        own = self.incoming.own_files(capture.raw_dir, capture.raw_stem)
        for kind, path in capture.files:
            if own.get(kind) != Path(path):
                return f"{kind} file {path[:200]!r} is not its own"
        return None

    def discard(self, s: Session, t: Target, capture: CaptureReport) -> None:
        """Delete the files of a superseded capture: only the target's own, never a path
        the report names elsewhere."""
        log.info("session %s: dropping a capture of superseded steps from pid %s", s.id, t.pid)
        own = self.incoming.own_files(capture.raw_dir, capture.raw_stem)
        names = [p.name for kind, path in capture.files if (p := own.get(kind)) == Path(path)]
        what = f"superseded capture {capture.key}"
        self.incoming.discard(capture.raw_dir, names, what)

    def resubmit(self, capture: CaptureReport) -> None:
        """Into the pipeline again: a report a previous daemon left in the inbox."""
        s = self.sessions.exact(capture.session_id)
        t = s.targets.get(capture.target) if s is not None else None
        if s is not None and t is not None:
            self.sessions.queued(s, t)
        self.captures.submit(capture)
