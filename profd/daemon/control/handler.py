"""Requests from profctl on ``control.sock``: the only socket that can start sessions.

A router: it decodes, dispatches to the collaborator that owns the answer, and replies in
the request's envelope and protocol version. Every request gets exactly one reply (a REQ
peer that got none could not send again).
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
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.runtime.peers import PeerCred, Requester
from profd.daemon.sessions.selector import Selector
from profd.daemon.sessions.starts import Starter, StartRequest, started
from profd.daemon.sessions.state import Sessions
from profd.scheduling import schedule as sch
from profd.scheduling.refusal import Refused
from profd.store.index import Index, TraceFilter
from profd_client import protocol as P

log = logging.getLogger("profd.control")

SendFrames = Callable[[list[bytes]], None]


@dataclass(frozen=True)
class DaemonFacts:
    """What ``status`` reports about the daemon itself; fixed at start."""

    host: str  # the node name: ``[daemon] node_name``, else the hostname
    started: float
    runtime_dir: Path
    state_dir: Path
    spool: Path
    max_spool_bytes: int | None
    #: The machine's boot id: tells profctl --cluster pull whether spool paths are its own.
    boot_id: str | None = None


class ControlHandler:
    def __init__(
        self,
        facts: DaemonFacts,
        registry: Registry,
        sessions: Sessions,
        index: Index,
        starter: Starter,
        flush: Callable[[], None],
        send: SendFrames,
        live_status: Callable[[], dict[str, Any]],
        retry: Callable[[str | None], int],
        admin_gid: int | None = None,
    ) -> None:
        self.facts = facts
        self.registry = registry
        self.sessions = sessions
        self.index = index
        self.starter = starter
        self.flush = flush
        self.send = send
        #: Counters owned elsewhere (pipeline, uploads, rejected agent frames).
        self.live_status = live_status
        self.retry = retry
        self.own_uid = os.geteuid()
        self.admin_gid = admin_gid
        self.rejected = 0

    def handle(self, frames: list[bytes], peer: PeerCred | None) -> None:
        """A request on ``control.sock``: the kernel says who asks."""
        self.serve(frames, lambda: Requester.of(peer, self.own_uid, self.admin_gid), self.send)

    def handle_operator(self, frames: list[bytes], send: SendFrames) -> None:
        """A request over TCP: its key passed the CURVE handshake and ZAP, so it is one of
        ``[cluster] authorized_keys``, and those operators act on every user's processes."""
        self.serve(frames, Requester.operator, send)

    def serve(self, frames: list[bytes], who: Callable[[], Requester], send: SendFrames) -> None:
        try:
            envelope, frame = P.split_envelope(frames)
        except P.ProtocolError:
            self.rejected += 1
            return  # no REQ peer sends this: nobody waits for an answer
        v = P.VERSION
        try:
            raw = P.unpack(frame)
            v = _reply_version(raw)
            msg = P.validate(raw, P.CONTROL_INBOUND)
            reply = P.encode(P.OK, v=v, data=self.dispatch(msg, who()))
        except P.ProtocolError as exc:
            self.rejected += 1
            if exc.code == "version":
                log.warning("control request in protocol version %s refused", P.version_of(raw))
            reply = P.error(exc.code, str(exc), v=v)
        except Refused as exc:
            reply = P.error(exc.code, str(exc), v=v)
        except Exception as exc:
            log.exception("control request failed")
            reply = P.error("internal", f"{type(exc).__name__}: {exc}", v=v)
        send(P.join_envelope(envelope, bounded_reply(reply, v)))

    def dispatch(self, m: dict[str, Any], by: Requester) -> Any:
        t = m["t"]
        if t in (P.C_SESSIONS, P.C_SHOW, P.C_TRACES):
            self.flush()  # answer reads from an index that has every change so far
        data = self._dispatch(m, by)
        if t in (P.C_PS, P.C_SESSIONS, P.C_TRACES):
            self._stamp(data)
        elif t == P.C_SHOW:
            self._stamp([data, *data["targets"]])
        elif t == P.C_START:
            self._stamp(data.get("targets") or data.get("candidates") or [])
        return data

    def _stamp(self, rows: list[dict[str, Any]]) -> None:
        # Which daemon a row came from, for profctl --cluster: a row's own ``host`` is what
        # the client called its machine (a pod's name, or the same host for several test
        # daemons), which does not tell nodes apart.
        for r in rows:
            r["node"] = self.facts.host

    def _dispatch(self, m: dict[str, Any], by: Requester) -> Any:
        t = m["t"]
        if t == P.C_STATUS:
            return self.status()
        if t == P.C_PS:
            return self.ps(m.get("job"), m.get("role"))
        if t == P.C_START:
            req = StartRequest.parse(m["spec"], validated=True)
            if req.probe:
                return {"candidates": self.starter.candidates(req, by)}
            return started(self.starter.start(req, by=by))
        if t in (P.C_STOP, P.C_CANCEL):
            return self.stop(m["session"], keep=t == P.C_STOP, by=by)
        if t == P.C_SESSIONS:
            return self.index.sessions(m.get("state"), m.get("job"), m.get("limit") or 50)
        if t == P.C_SHOW:
            live = self.sessions.get(m["session"])
            if live is not None:
                # From memory: right even while the index cannot be written (a full disk).
                return live.summary()
            s = self.index.session(m["session"])
            if s is None:
                raise Refused("unknown_session", f"no session {m['session']!r}")
            s["steps"] = sch.steps_of([tuple(c) for c in s["cycles"]])
            return s
        if t == P.C_TRACES:
            try:
                flt = TraceFilter.from_map(m["filters"])
            except (TypeError, ValueError) as exc:
                raise Refused("bad_request", str(exc)) from None
            return self.index.traces(flt)
        if t == P.C_RETRY:
            if not by.privileged:
                self._check_owner(m.get("session"), by)
            return {"requeued": self.retry(m.get("session"))}
        raise Refused("type", f"unhandled request {t}")

    def status(self) -> dict[str, Any]:
        f = self.facts
        total, unsafe = self.index.spool_usage()
        live = self.sessions.live()
        out: dict[str, Any] = {
            "version": __version__,
            "protocol": [P.MIN_VERSION, P.VERSION],
            "pid": os.getpid(),
            "host": f.host,
            "boot_id": f.boot_id,
            "uptime_s": round(time.time() - f.started, 1),
            "runtime_dir": str(f.runtime_dir),
            "state_dir": str(f.state_dir),
            "spool_dir": str(f.spool),
            "clients": len(self.registry),
            "incompatible_clients": len(self.registry.incompatible),
            "sessions": {
                "live": len(live),
                "by_state": {
                    st: sum(s.state == st for s in live) for st in {s.state for s in live}
                },
            },
            "spool": {
                "bytes": total,
                "bytes_not_uploaded": unsafe,
                "max_bytes": f.max_spool_bytes,
            },
            "queue": self.index.queue_stats(),
        }
        live_status = self.live_status()
        live_status["rejected_messages"] = live_status.get("rejected_messages", 0) + self.rejected
        out.update(live_status)
        return out

    def ps(self, job: str | None, role: str | None) -> list[dict[str, Any]]:
        sel = Selector(job=job, roles=(role,) if role else ())
        rows = [c.row() for c in by_identity(self.registry) if sel.matches(c)]
        # Peers of another protocol version are listed so nobody wonders where a job went.
        rows += [
            r
            for r in (p.row() for p in self.registry.incompatible.values())
            if (job is None or r["job"] == job)
        ]
        return rows

    def _check_owner(self, session_id: str | None, by: Requester) -> None:
        if session_id is None:
            raise Refused(
                "permission", f"profctl as uid {by.uid} may retry only its own sessions: name one"
            )
        row = self.index.session(session_id)
        if row is not None and not by.may_act_on(row.get("owner")):
            raise Refused(
                "permission", f"session {row['id']} is not uid {by.uid}'s; ask root to retry it"
            )

    def stop(self, session_id: str, keep: bool, by: Requester) -> dict[str, Any]:
        s = self.starter.stop(session_id, keep, by)
        if s is None:
            row = self.index.session(session_id)
            if row is None:
                raise Refused("unknown_session", f"no session {session_id!r}")
            raise Refused("finished", f"session {row['id']} already ended: {row['state']}")
        return {"session": s.id, "state": s.state}


def bounded_reply(reply: bytes, v: int, limit: int = P.MAX_REPLY_BYTES) -> bytes:
    """``reply``, or an error saying it is too large: profctl drops a frame over its limit
    (``zmq.MAXMSGSIZE``) unread and would wait for an answer that never comes."""
    if len(reply) <= limit:
        return reply
    log.warning("control reply of %d bytes not sent (at most %d)", len(reply), limit)
    return P.error(
        "too_large",
        f"the reply is {len(reply)} bytes, over the {limit} bytes profctl accepts:"
        " ask for less (filters, --limit)",
        v=v,
    )


def _reply_version(raw: object) -> int:
    """Answer in the version asked, so a peer of another version can read the error."""
    v = P.version_of(raw)
    return v if v is not None and 0 <= v < (1 << 16) else P.VERSION


def by_identity(clients: Any) -> list[Client]:
    return sorted(clients, key=lambda c: (c.job, c.role, c.rank, c.host, c.pid))
