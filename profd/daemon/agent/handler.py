"""Messages from training processes on ``agent.sock``.

An agent peer can only report about itself: every message is looked up by its ZeroMQ
routing id, so a process can neither start sessions nor speak for another process. Each
client is answered in the protocol version it spoke in its ``hello``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd import __version__
from profd.daemon.agent.liveness import Liveness
from profd.daemon.captures.lanes import Captures
from profd.daemon.captures.record import CaptureReport
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.runtime import faults
from profd.daemon.runtime.peers import PeerCred, claim_problem
from profd.daemon.sessions.arming import Arms
from profd.daemon.sessions.autorules import AutoRules
from profd.daemon.sessions.nsysruns import NsysRuns
from profd.daemon.sessions.starts import Starter
from profd.daemon.sessions.state import Session, Sessions, Target
from profd.daemon.spool.incoming import Incoming
from profd.daemon.spool.storage import Storage, is_disk_full
from profd.store.index import Index
from profd_client import protocol as P

log = logging.getLogger("profd.agents")

Send = Callable[[bytes, bytes], None]


@dataclass(frozen=True)
class Welcome:
    """What every client is told on attach."""

    spool: str
    hb_interval: float


class AgentHandler:
    def __init__(
        self,
        welcome: Welcome,
        registry: Registry,
        sessions: Sessions,
        index: Index,
        arms: Arms,
        starter: Starter,
        auto_rules: AutoRules,
        liveness: Liveness,
        captures: Captures,
        incoming: Incoming,
        nsys: NsysRuns,
        send: Send,
        storage: Storage,
    ) -> None:
        self.welcome = welcome
        self.registry = registry
        self.sessions = sessions
        self.index = index
        self.arms = arms
        self.starter = starter
        self.auto_rules = auto_rules
        self.liveness = liveness
        self.captures = captures
        self.incoming = incoming
        self.nsys = nsys
        self.send = send
        self.storage = storage
        #: Reports the index could not store (a full disk), not acked: key -> (ident, report,
        #: ack). Their clients keep them; :meth:`retry_deferred` stores and acks them.
        self._deferred: dict[str, tuple[bytes, CaptureReport, bytes]] = {}
        self.own_uid = os.geteuid()
        self.rejected = 0  # malformed frames seen, for status
        self._heartbeats: dict[int, bytes] = {}  # the same reply bytes for every client

    def handle(self, frames: list[bytes], peer: PeerCred | None) -> None:
        try:
            envelope, frame = P.split_envelope(frames)
        except P.ProtocolError as exc:
            self.rejected += 1
            if frames:
                self.send(frames[0], exc.reply())
            return
        ident = envelope[0]
        try:
            msg = P.decode(frame, P.AGENT_INBOUND)
        except P.ProtocolError as exc:
            self.rejected += 1
            if exc.code == "version":
                self._incompatible(ident, P.version_of(exc.raw), exc.raw)
            self.send(ident, exc.reply())
            return
        t = msg["t"]
        if t == P.HELLO:
            # From a process not registered yet: the kernel's word is all there is.
            self.hello_from(ident, msg, peer)
            return
        c = self.registry.get(ident)
        if c is not None and (peer is None or peer.pid != c.node_pid):
            # Another connection under a registered routing id (a peer that set its own
            # ROUTING_ID to a client's): it is not that client, whatever it says.
            self.rejected += 1
            c = None
        if c is None:
            self.send(ident, P.error("unknown_client", "say hello first", v=msg["v"]))
            return
        HANDLERS[t](self, c, msg, time.monotonic())

    # --- one handler per message type from a registered client (``HANDLERS``) ------------
    def heartbeat(self, c: Client, m: dict[str, Any], now: float) -> None:
        self.registry.heartbeat(c, now, m.get("step"), m.get("sps"), m.get("state"))
        self.send(c.ident, self._heartbeat(c.version))

    def _armed(self, c: Client, m: dict[str, Any], now: float) -> None:
        self.registry.seen(c, now)
        self.armed(c, m)

    def _progress(self, c: Client, m: dict[str, Any], now: float) -> None:
        self.registry.seen(c, now)
        self.send(c.ident, P.encode(P.ACK, v=c.version, id=m["id"]))
        self.progress(c, m)

    def _captured(self, c: Client, m: dict[str, Any], now: float) -> None:
        self.registry.seen(c, now)
        self.captured(c, m)

    def bye(self, c: Client, m: dict[str, Any], now: float) -> None:
        self.registry.seen(c, now)
        self.liveness.drop(c, "detached")

    def hello_from(self, ident: bytes, m: dict[str, Any], peer: PeerCred | None) -> None:
        problem = self._identity_problem(m["pid"], peer)
        if problem is not None:
            self.rejected += 1
            log.warning("refused a hello (job %r): %s", m["job"], problem)
            self.send(ident, P.error("identity", problem, v=m["v"]))
            return
        assert peer is not None
        self.hello(ident, m, peer)

    def _heartbeat(self, v: int) -> bytes:
        frame = self._heartbeats.get(v)
        if frame is None:
            frame = self._heartbeats[v] = P.encode(P.HEARTBEAT, v=v)
        return frame

    def _incompatible(self, ident: bytes, v: int | None, raw: object) -> None:
        if self.registry.incompatible_peer(ident, v, raw):
            fields = raw if isinstance(raw, dict) else {}
            log.warning(
                "refused a client speaking protocol version %r (this daemon serves %d..%d):"
                " pid %r job %r; it keeps training but cannot be profiled until one side is"
                " upgraded",
                v,
                P.MIN_VERSION,
                P.VERSION,
                fields.get("pid"),
                str(fields.get("job"))[:200],
            )

    def _identity_problem(self, claimed_pid: int, peer: PeerCred | None) -> str | None:
        problem = claim_problem(claimed_pid, peer)
        if problem is None and peer is not None and self.own_uid not in (0, peer.uid):
            # It could not give this uid its own incoming dir: only root can chown.
            problem = (
                f"uid {peer.uid} cannot use a daemon run by uid {self.own_uid}"
                " (run profd as root, e.g. the systemd unit, to serve other users)"
            )
        return problem

    def hello(self, ident: bytes, m: dict[str, Any], peer: PeerCred) -> None:
        c = Client(
            ident=ident,
            host=m["host"],
            pid=m["pid"],
            job=m["job"],
            role=m["role"],
            rank=m["rank"],
            local_rank=m["local_rank"],
            world_size=m["world_size"],
            step_mode=m["step_mode"],
            allowed=m["allowed"],
            torch=m.get("torch"),
            device=m.get("device"),
            nsys_session=m.get("nsys_session"),
            step=m["step"],
            attaching=bool(m.get("waiting")) and m["step"] == 0,
            version=m["v"],
            node_pid=peer.pid,
            uid=peer.uid,
            gid=peer.gid,
            identity_source=_sources(m.get("identity_source")),
        )
        old = self.registry.add(c)
        moved = old is not None and old.identity != c.identity
        if old is None:
            log.info("attached: %s pid %s job %s %s rank %s", c.host, c.pid, c.job, c.role, c.rank)
        elif moved:
            log.info(
                "re-registered: %s pid %s as job %s %s rank %s/%s (was job %s %s rank %s/%s)",
                c.host,
                c.pid,
                *c.identity,
                *old.identity,
            )
        self._void_stale_targets(c)
        self.liveness.attached(c)
        # Arms go out before the welcome: a client waiting in attach() applies them before
        # its first step, which is what lets an [[auto]] rule capture step 1.
        # An arm lost with the old connection (or sent by a daemon that died before the ack)
        # is sent again; a client ignores an arm for a session it already holds.
        try:
            for s in self.sessions.live():
                t = s.targets.get(c.key)
                if t is not None and t.awaiting_arm:
                    self.arms.arm(s, c)
            if old is None or moved:
                # A new job (or rank) may match rules the old identity did not.
                self.auto_rules.attached(c)
        finally:
            # Whatever went wrong with the rules, the process must not wait for nothing.
            self.registry.welcomed(c)
            extra: dict[str, Any] = {}
            if c.version >= 2:
                extra["protocol"] = [P.MIN_VERSION, P.VERSION]
            self.send(
                ident,
                P.encode(
                    P.WELCOME,
                    v=c.version,
                    spool=self.welcome.spool,
                    hb_interval=self.welcome.hb_interval,
                    daemon=__version__,
                    **extra,
                ),
            )

    def _void_stale_targets(self, c: Client) -> None:
        """Targets chosen by an identity the process no longer has, and not yet capturing,
        end here with the reason: their selector (job, role, ranks) matched someone else,
        and their files would be named after the old rank. A capture already running goes
        on under the identity it began with (the client names its files after the plan)."""
        for s in self.sessions.live():
            t = s.targets.get(c.key)
            if t is None or not t.voidable:
                continue
            if (t.job, t.role, t.rank, t.world_size) == c.identity:
                continue
            why = (
                f"the process re-registered as job {c.job} {c.role} rank {c.rank}/"
                f"{c.world_size} (was job {t.job} {t.role} rank {t.rank}/{t.world_size})"
                " before its capture began"
            )
            if s.auto_rule is not None:
                # Not what a user asked for, so not a failure: a rule arms the process
                # again if its new job matches it (see auto_rules.attached).
                self.sessions.reported(s, t, "cancelled", why)
            else:
                self.sessions.fail(s, t, why + "; start the session again")
            self.arms.disarm(s, c, keep=False)

    def _target(self, c: Client, m: dict[str, Any]) -> tuple[Session, Any] | None:
        """The session and target a report is about, if it is current."""
        s = self.sessions.exact(m["session"])
        t = s.targets.get(c.key) if s is not None else None
        if s is None or t is None or m.get("plan", 0) < s.revision:
            return None  # unknown, or about steps the session has since moved away from
        return s, t

    def armed(self, c: Client, m: dict[str, Any]) -> None:
        hit = self._target(c, m)
        if hit is not None:
            self.sessions.armed(*hit)

    def progress(self, c: Client, m: dict[str, Any]) -> None:
        hit = self._target(c, m)
        if hit is None:
            return
        s, t = hit
        if m["state"] == "late":
            self.starter.late(s, t, c, m["step"])
            return
        self.sessions.reported(s, t, m["state"], m.get("error"))

    def captured(self, c: Client, m: dict[str, Any]) -> None:
        ack = P.encode(P.ACK, v=c.version, id=m["id"])
        s = self.sessions.exact(m["session"])
        t = s.targets.get(c.key) if s is not None else None
        if s is None or t is None:
            # Another job's session, a finished one, or none at all: a peer reports only
            # about sessions it was armed for. Acked, so an honest late client stops resending.
            self.send(c.ident, ack)
            log.warning(
                "refused a capture report from pid %s for session %r: not one of its sessions",
                c.pid,
                m["session"][:64],
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
            fresh = self.index.inbox_put(capture.key, capture.to_row())
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
        own = self.incoming.own_files(capture.raw_dir, capture.stem)
        for kind, path in capture.files:
            if own.get(kind) != Path(path):
                return f"{kind} file {path[:200]!r} is not its own"
        return None

    def discard(self, s: Session, t: Target, capture: CaptureReport) -> None:
        """Delete the files of a superseded capture: only the target's own, never a path
        the report names elsewhere."""
        log.info("session %s: dropping a capture of superseded steps from pid %s", s.id, t.pid)
        own = self.incoming.own_files(capture.raw_dir, capture.stem)
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


#: The handler of each message type a registered client sends (``hello`` comes first, from a
#: process not registered yet: :meth:`AgentHandler.hello_from`).
HANDLERS: dict[str, Callable[[AgentHandler, Client, dict[str, Any], float], None]] = {
    P.HEARTBEAT: AgentHandler.heartbeat,
    P.ARMED: AgentHandler._armed,
    P.PROGRESS: AgentHandler._progress,
    P.CAPTURED: AgentHandler._captured,
    P.BYE: AgentHandler.bye,
}


def _sources(value: object) -> dict[str, str]:
    """The identity fields' sources a hello names (validated; other keys dropped)."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if k in P.IDENTITY_FIELDS and isinstance(v, str)}
