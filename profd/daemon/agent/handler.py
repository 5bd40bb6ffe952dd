"""Messages from training processes on ``agent.sock``.

An agent peer can only report about itself: every message is looked up by its ZeroMQ
routing id, so a process can neither start sessions nor speak for another process. Each
client is answered in the protocol version it spoke in its ``hello``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from profd.daemon.agent.attach import Attach
from profd.daemon.agent.intake import Intake
from profd.daemon.agent.liveness import Liveness
from profd.daemon.agent.send import Send
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.runtime.peers import PeerCred
from profd.daemon.sessions.starts import Starter
from profd.daemon.sessions.state import Session, Sessions
from profd_client import protocol as P

log = logging.getLogger("profd.agents")


class AgentHandler:
    """The router of ``agent.sock``: one decoded message to the part that owns it (a hello to
    :class:`Attach`, a capture report to :class:`Intake`, progress to the sessions)."""

    def __init__(
        self,
        registry: Registry,
        sessions: Sessions,
        starter: Starter,
        liveness: Liveness,
        attach: Attach,
        intake: Intake,
        send: Send,
        ledgers: Ledgers,
        stacks_result: Callable[[Client, P.StacksResult], None] | None = None,
        blackbox_result: Callable[[Client, P.BlackboxResult], None] | None = None,
    ) -> None:
        self.registry = registry
        self.sessions = sessions
        self.starter = starter
        self.liveness = liveness
        self.attach = attach
        self.intake = intake
        self.send = send
        self.ledgers = ledgers
        self.rejected = 0  # malformed frames seen, for status
        #: Where a client's own stacks go (``stacks_result``).
        self.stacks_result = stacks_result
        #: Where a client's black box goes (``blackbox_result``).
        self.blackbox_result = blackbox_result
        self._heartbeats: dict[int, bytes] = {}  # the same reply bytes for every client
        #: Heartbeat answers owed to ``quiet`` clients: (routing id, frame), sent together
        #: once a tick (:meth:`answer_owed`).
        self._owed: list[tuple[bytes, bytes]] = []

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
            if exc.code == P.ErrorCode.VERSION:
                self._incompatible(ident, P.version_of(exc.raw), exc.raw)
            self.send(ident, exc.reply())
            return
        if type(msg) is P.Hello:
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
            self.send(ident, P.error(P.ErrorCode.UNKNOWN_CLIENT, "say hello first", v=msg.v))
            return
        HANDLERS[msg.t](self, c, msg, time.monotonic())

    # --- one handler per message type from a registered client (``HANDLERS``) ------------
    def heartbeat(self, c: Client, m: P.Heartbeat, now: float) -> None:
        step = None if m.step is P.UNSET else m.step
        sps = None if m.sps is P.UNSET else m.sps
        state = None if m.state is P.UNSET else m.state
        self.registry.heartbeat(c, now, step, sps, state)
        self.ledgers.heartbeat(c, step, None if m.ledger is P.UNSET else m.ledger, now)
        if m.training_tid is not P.UNSET:
            self.registry.training_thread(c, m.training_tid)
        if now - c.answered_at >= c.quiet_s:
            c.answered_at = now
            if c.quiet_s:
                self._owed.append((c.ident, self._heartbeat(c.version)))
            else:
                self.send(c.ident, self._heartbeat(c.version))

    def answer_owed(self) -> None:
        """Send the heartbeat answers owed to ``quiet`` clients, all at once. Sent as their
        heartbeats came, they left with every batch the loop read (50 a second at 1,024
        clients), and each burst of sends wakes ZeroMQ's I/O thread: one burst a tick costs
        a third of the CPU (docs/benchmarks.md). A quiet client waits three answer intervals
        before it calls us silent, so an answer a tick late changes nothing for it."""
        owed, self._owed = self._owed, []
        for ident, frame in owed:
            self.send(ident, frame)

    def _armed(self, c: Client, m: P.Armed, now: float) -> None:
        self.registry.seen(c, now)
        self.armed(c, m)

    def _progress(self, c: Client, m: P.Progress, now: float) -> None:
        self.registry.seen(c, now)
        self.send(c.ident, P.encode(P.ACK, v=c.version, id=m.id))
        self.progress(c, m)

    def _captured(self, c: Client, m: P.Captured, now: float) -> None:
        self.registry.seen(c, now)
        self.intake.captured(c, m)

    def bye(self, c: Client, m: P.Bye, now: float) -> None:
        self.registry.seen(c, now)
        self.liveness.drop(c, "detached")

    def hello_from(self, ident: bytes, m: P.Hello, peer: PeerCred | None) -> None:
        problem = self.attach.problem(m.pid, peer)
        if problem is not None:
            self.rejected += 1
            log.warning("refused a hello (job %r): %s", m.job, problem)
            self.send(ident, P.error(P.ErrorCode.IDENTITY, problem, v=m.v))
            return
        assert peer is not None
        limit = self.attach.over_limit(m, peer)
        if limit is not None:
            self.send(ident, P.error(P.ErrorCode.LIMIT, limit, v=m.v))
            return
        self.attach.hello(ident, m, peer)

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

    def _target(self, c: Client, m: P.Armed | P.Progress) -> tuple[Session, Any] | None:
        """The session and target a report is about, if it is current."""
        s = self.sessions.exact(m.session)
        t = s.targets.get(c.key) if s is not None else None
        if s is None or t is None or m.plan < s.revision:
            return None  # unknown, or about steps the session has since moved away from
        return s, t

    def _stacks_result(self, c: Client, m: P.StacksResult, now: float) -> None:
        self.registry.seen(c, now)
        if self.stacks_result is not None:
            self.stacks_result(c, m)

    def _blackbox_result(self, c: Client, m: P.BlackboxResult, now: float) -> None:
        self.registry.seen(c, now)
        if self.blackbox_result is not None:
            self.blackbox_result(c, m)

    def armed(self, c: Client, m: P.Armed) -> None:
        hit = self._target(c, m)
        if hit is not None:
            self.sessions.armed(*hit)

    def progress(self, c: Client, m: P.Progress) -> None:
        hit = self._target(c, m)
        if hit is None:
            return
        s, t = hit
        if m.state == "late":
            self.starter.late(s, t, c, m.step)
            return
        self.sessions.reported(s, t, m.state, m.error)


#: The handler of each message type a registered client sends (``hello`` comes first, from a
#: process not registered yet: :meth:`AgentHandler.hello_from`).
HANDLERS: dict[str, Callable[[AgentHandler, Client, Any, float], None]] = {
    P.HEARTBEAT: AgentHandler.heartbeat,
    P.ARMED: AgentHandler._armed,
    P.PROGRESS: AgentHandler._progress,
    P.CAPTURED: AgentHandler._captured,
    P.BYE: AgentHandler.bye,
    P.STACKS_RESULT: AgentHandler._stacks_result,
    P.BLACKBOX_RESULT: AgentHandler._blackbox_result,
}
