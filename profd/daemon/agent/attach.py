"""A process's ``hello``: who it is (its claim checked against the kernel's word), what it is
armed for again, which ``[[auto]]`` rules now match it, and its ``welcome``."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from profd import __version__
from profd.config import PeerLimits
from profd.daemon.agent.liveness import Liveness
from profd.daemon.agent.pace import HeartbeatPace
from profd.daemon.agent.send import Send
from profd.daemon.clients.registry import MAX_MOVES, MOVES_S, Client, Registry
from profd.daemon.runtime.peers import PeerCred, claim_problem
from profd.daemon.sessions.arming import Arms
from profd.daemon.sessions.autorules import AutoRules
from profd.daemon.sessions.state import Sessions
from profd_client import protocol as P

log = logging.getLogger("profd.agents")

#: Seconds between two log lines about refused peers (a refused client says hello again
#: every heartbeat, so each refusal is counted, not logged).
REFUSAL_LOG_EVERY_S = 60.0
#: A ``quiet`` client's heartbeats are answered once every this many intervals. Each answer
#: is a send on the loop and a wakeup of ZeroMQ's I/O thread: at 1,024 clients, every third
#: heartbeat answered cost 1.3 % of a core, every tenth 0.2 % (docs/benchmarks.md). The client
#: waits that many times longer before it calls us silent (30 s at 1 s heartbeats); a
#: restarted daemon it learns of at once, from the "say hello first" of its next heartbeat.
QUIET_ACKS = 10


@dataclass(frozen=True)
class Welcome:
    """What every client is told on attach (its heartbeat interval comes from the pace)."""

    spool: str
    #: ``[blackbox]`` as the welcome carries it (None: the client's defaults).
    blackbox: dict[str, Any] | None = None


class Attach:
    def __init__(
        self,
        welcome: Welcome,
        pace: HeartbeatPace,
        registry: Registry,
        sessions: Sessions,
        arms: Arms,
        auto_rules: AutoRules,
        liveness: Liveness,
        send: Send,
        limits: PeerLimits,
    ) -> None:
        self.welcome = welcome
        self.pace = pace
        self.limits = limits
        self.peers_refused = 0  # hellos refused for the peer limits, for status
        self._refusals_logged = 0
        self._refusal_logged_at = -REFUSAL_LOG_EVERY_S
        self.registry = registry
        self.sessions = sessions
        self.arms = arms
        self.auto_rules = auto_rules
        self.liveness = liveness
        self.send = send
        self.own_uid = os.geteuid()

    def problem(self, claimed_pid: int, peer: PeerCred | None) -> str | None:
        """Why a hello claiming ``claimed_pid`` from ``peer`` is refused, or None."""
        problem = claim_problem(claimed_pid, peer)
        if problem is None and peer is not None and self.own_uid not in (0, peer.uid):
            # It could not give this uid its own incoming dir: only root can chown.
            problem = (
                f"uid {peer.uid} cannot use a daemon run by uid {self.own_uid}"
                " (run profd as root, e.g. the systemd unit, to serve other users)"
            )
        return problem

    def over_limit(self, m: P.Hello, peer: PeerCred) -> str | None:
        """Why a hello would register one peer too many for its process or its user, or
        move a peer to another rank too often (and count it), or None. Saying hello again
        as a peer already registered is no new peer."""
        lim = self.limits
        now = time.monotonic()
        old = self.registry.lookup((m.host, m.pid))
        if old is not None:
            same = (m.job, m.role, m.rank, m.world_size) == old.identity
            if same or len(old.recent_moves(now)) < MAX_MOVES:
                return None
            why = (
                f"pid {peer.pid} re-registered as another rank {MAX_MOVES} times in"
                f" {MOVES_S:.0f} s, the most the daemon takes; it stays job {old.job}"
                f" {old.role} rank {old.rank}"
            )
        elif self.registry.peers_of_process(peer.pid) >= lim.max_peers_per_process:
            why = (
                f"pid {peer.pid} already has {lim.max_peers_per_process} peers attached, the most"
                " [daemon] max_peers_per_process allows"
            )
        elif self.registry.peers_of_user(peer.uid) >= lim.max_peers_per_user:
            why = (
                f"uid {peer.uid} already has {lim.max_peers_per_user} peers attached, the most"
                " [daemon] max_peers_per_user allows"
            )
        else:
            return None
        self.peers_refused += 1
        if now - self._refusal_logged_at >= REFUSAL_LOG_EVERY_S:
            log.warning(
                "refused %d hello(s) for the peer limits; the last (job %r): %s",
                self.peers_refused - self._refusals_logged,
                m.job[:64],
                why,
            )
            self._refusals_logged, self._refusal_logged_at = self.peers_refused, now
        return why

    def hello(self, ident: bytes, m: P.Hello, peer: PeerCred) -> None:
        c = Client(
            ident=ident,
            host=m.host,
            pid=m.pid,
            job=m.job,
            role=m.role,
            rank=m.rank,
            local_rank=m.local_rank,
            world_size=m.world_size,
            step_mode=m.step_mode,
            allowed=m.allowed,
            torch=m.torch,
            device=m.device,
            nsys_session=m.nsys_session,
            step=m.step,
            attaching=m.waiting and m.step == 0,
            version=m.v,
            client_version=m.client_version,
            node_pid=peer.pid,
            uid=peer.uid,
            gid=peer.gid,
            identity_source=_sources(m.identity_source),
            training_tid=m.training_tid,
            flight=m.flight,
            blackbox=m.blackbox,
            quiet=m.quiet,
        )
        old = self.registry.add(c)
        moved = old is not None and old.identity != c.identity
        if old is not None and moved:
            self.registry.moved(c, old, time.monotonic())
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
            self._welcome(c)

    def _welcome(self, c: Client) -> None:
        """Tell ``c`` what it needs to heartbeat: again whenever the pace changes (a client
        takes each welcome's interval and answer period as they come)."""
        pace = self.pace
        extra: dict[str, Any] = {}
        if self.welcome.blackbox is not None:
            extra["blackbox"] = self.welcome.blackbox
        if c.quiet:
            extra["acks"] = pace.acks
            # Half an interval early: a heartbeat sent a little before its time is answered.
            c.quiet_s = (pace.acks - 0.5) * pace.interval
        self.send(
            c.ident,
            P.encode(
                P.WELCOME,
                v=c.version,
                spool=self.welcome.spool,
                hb_interval=pace.interval,
                daemon=__version__,
                protocol=[P.MIN_VERSION, P.VERSION],
                **extra,
            ),
        )

    def repace(self, now: float) -> None:
        """The pace for the processes attached now (monotonic ``now``); when it changed,
        every one of them is told."""
        if not self.pace.update(len(self.registry), now):
            return
        log.info(
            "%d processes attached: heartbeats every %g s (answers every %d)",
            len(self.registry),
            self.pace.interval,
            self.pace.acks,
        )
        for c in list(self.registry):
            self._welcome(c)

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


def _sources(value: dict[str, Any]) -> dict[str, str]:
    """The identity fields' sources a hello names (validated; other keys dropped)."""
    return {k: v for k, v in value.items() if k in P.IDENTITY_FIELDS and isinstance(v, str)}
