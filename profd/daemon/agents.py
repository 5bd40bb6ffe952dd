"""Messages from training processes on ``agent.sock``.

An agent peer can only report about itself: every message is looked up by its ZeroMQ
routing id, so a process can neither start sessions nor speak for another process.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from profd_client import protocol as P

from .. import __version__
from .captures import Job, inside
from .registry import Client
from .sessions import Session

if TYPE_CHECKING:
    from .loop import Daemon

log = logging.getLogger("profd.agents")

_HEARTBEAT = P.encode(P.HEARTBEAT)  # the same bytes for every reply
TERMINAL_REPORTS = frozenset({"done", "failed", "stopped", "cancelled"})


class AgentHandler:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.rejected = 0  # malformed frames seen, for status

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.rejected += 1
            if frames:
                self.d.send_agent(frames[0], P.error("malformed", "expected one frame"))
            return
        ident, frame = frames
        try:
            msg = P.decode(frame, P.AGENT_INBOUND)
        except P.ProtocolError as exc:
            self.rejected += 1
            self.d.send_agent(ident, P.error(exc.code, str(exc)))
            return
        t = msg["t"]
        if t == P.HELLO:
            try:
                P.safe_name(msg["job"], "job")
                P.safe_name(msg["role"], "role")
                if msg.get("nsys_session") is not None:
                    P.safe_name(msg["nsys_session"], "nsys_session")
            except P.ProtocolError as exc:
                self.rejected += 1
                self.d.send_agent(ident, P.error(exc.code, str(exc)))
                return
            self.hello(ident, msg)
            return
        c = self.d.registry.get(ident)
        if c is None:
            self.d.send_agent(ident, P.error("unknown_client", "say hello first"))
            return
        c.last_seen = time.monotonic()
        if t == P.HEARTBEAT:
            if "step" in msg:
                c.step = msg["step"]
                c.step_at = c.last_seen
            if "sps" in msg:
                c.sps = float(msg["sps"])
            if "state" in msg:
                c.state = msg["state"][:32]
            self.d.send_agent(ident, _HEARTBEAT)
        elif t == P.ARMED:
            self.armed(c, msg)
        elif t == P.PROGRESS:
            self.d.send_agent(ident, P.encode(P.ACK, id=msg["id"]))
            self.progress(c, msg)
        elif t == P.CAPTURED:
            self.captured(c, msg)
        elif t == P.BYE:
            self.d.drop_client(c, "detached")

    def hello(self, ident: bytes, m: dict[str, Any]) -> None:
        c = Client(
            ident=ident,
            host=m["host"][:255],
            pid=m["pid"],
            job=m["job"][:255],
            role=m["role"][:255],
            rank=m["rank"],
            local_rank=m["local_rank"],
            world_size=m["world_size"],
            step_mode=m["step_mode"][:16],
            allowed=m["allowed"],
            torch=m.get("torch"),
            device=m.get("device"),
            nsys_session=m.get("nsys_session"),
            step=m["step"],
            attaching=bool(m.get("waiting")) and m["step"] == 0,
        )
        old = self.d.registry.add(c)
        if old is None:
            log.info("attached: %s pid %s job %s %s rank %s", c.host, c.pid, c.job, c.role, c.rank)
        self.d.orphans.pop(c.key, None)
        # Arms go out before the welcome: a client waiting in attach() applies them before
        # its first step, which is what lets an [[auto]] rule capture step 1.
        # An arm lost with the old connection (or sent by a daemon that died before the ack)
        # is sent again; a client ignores an arm for a session it already holds.
        try:
            for s in self.d.sessions.live():
                t = s.targets.get(c.key)
                if t is not None and t.state == "pending" and t.client_final is None and not t.hold:
                    self.d.control.arm(s, c)
            if old is None:
                self.d.control.apply_auto_rules(c)
        finally:
            # Whatever went wrong with the rules, the process must not wait for nothing.
            c.attaching = False
            self.d.send_agent(
                ident,
                P.encode(
                    P.WELCOME,
                    spool=str(self.d.spool),
                    hb_interval=self.d.cfg.heartbeat_interval,
                    daemon=__version__,
                ),
            )

    def armed(self, c: Client, m: dict[str, Any]) -> None:
        s = self.d.sessions.get(m["session"])
        t = s.targets.get(c.key) if s is not None else None
        if s is None or t is None or m.get("plan", 0) < s.plan:
            return
        if t.state == "pending":
            t.state = "armed"
            self.d.save(s, t)

    def progress(self, c: Client, m: dict[str, Any]) -> None:
        s = self.d.sessions.get(m["session"])
        t = s.targets.get(c.key) if s is not None else None
        if s is None or t is None or m.get("plan", 0) < s.plan:
            return  # unknown, or about steps the session has since moved away from
        state = m["state"]
        if state == "late":
            self.d.control.late(s, t, c, m["step"])
            return
        if m.get("error"):
            t.error = str(m["error"])[:1000]
        if state == "capturing" and t.state in ("pending", "armed"):
            t.state = "capturing"
        elif state in TERMINAL_REPORTS:
            t.client_final = state
            t.settle()
        self.d.save(s, t)

    def captured(self, c: Client, m: dict[str, Any]) -> None:
        s = self.d.sessions.get(m["session"])
        row = self.d.index.session(m["session"]) if s is None else None
        if s is None and row is None:
            self.d.send_agent(c.ident, P.encode(P.ACK, id=m["id"]))
            log.warning("dropping report for unknown session %r from pid %s", m["session"], c.pid)
            return
        if s is not None and m.get("plan", 0) < s.plan:
            # A capture of steps the session moved away from (a re-plan raced with it).
            self.d.send_agent(c.ident, P.encode(P.ACK, id=m["id"]))
            self.discard(s, c, m)
            return
        if s is not None and s.backend == "nsys":
            # nsys writes the report itself: the rank only says its range is over.
            self.d.send_agent(c.ident, P.encode(P.ACK, id=m["id"]))
            t = s.targets.get(c.key)
            if t is not None:
                self.d.nsys.cycle_reported(s, t, m)
            return
        # Paths come from the session, never from what the client claims.
        m["session"] = s.id if s is not None else row["id"]  # type: ignore[index]
        m["job"] = s.job if s is not None else row["job"]  # type: ignore[index]
        key = f"{m['session']}/{c.host}/{c.pid}/{m['cycle']}"
        stored = {
            "report": m,
            "client": {
                "host": c.host,
                "pid": c.pid,
                "role": c.role,
                "rank": c.rank,
                "world_size": c.world_size,
            },
        }
        fresh = self.d.index.inbox_put(key, stored)
        # Ack only once the report is durable: a daemon killed now redoes it on restart.
        self.d.send_agent(c.ident, P.encode(P.ACK, id=m["id"]))
        if not fresh:
            return
        t = s.targets.get(c.key) if s is not None else None
        if s is not None and t is not None:
            t.outstanding += 1
        self.submit(key, stored)

    def discard(self, s: Session, c: Client, m: dict[str, Any]) -> None:
        log.info("session %s: dropping a capture of superseded steps from pid %s", s.id, c.pid)
        home = self.d.captures.incoming_dir(s.job, s.id)
        for f in m["files"]:
            path = f.get("path") if isinstance(f, dict) else None
            p = inside(home, path) if isinstance(path, str) else None
            if p is not None:
                p.unlink(missing_ok=True)

    def resubmit(self, key: str, stored: dict[str, Any]) -> None:
        s = self.d.sessions.get(stored["report"]["session"])
        cl = stored["client"]
        t = s.targets.get((cl["host"], cl["pid"])) if s is not None else None
        if t is not None:
            t.outstanding += 1
        self.submit(key, stored)

    def submit(self, key: str, stored: dict[str, Any]) -> None:
        m, cl = stored["report"], stored["client"]
        self.d.captures.submit(
            Job(
                key=key,
                session=m["session"],
                job=m["job"],
                host=cl["host"],
                pid=cl["pid"],
                role=cl["role"],
                rank=cl["rank"],
                world_size=cl["world_size"],
                cycle=m["cycle"],
                report=m,
            )
        )
