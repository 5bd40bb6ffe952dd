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

from profd import __version__, claims
from profd import control_schema as C
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.rankstacks import RankStacks
from profd.daemon.clients.registry import Client, Registry, step_now
from profd.daemon.clients.stacks import job_doc
from profd.daemon.control import servable
from profd.daemon.runtime.peers import PeerCred, Requester
from profd.daemon.sessions.selector import Selector
from profd.daemon.sessions.starts import Starter, StartRequest, started
from profd.daemon.sessions.state import Sessions
from profd.daemon.watch.incidents import Incidents
from profd.scheduling import schedule as sch
from profd.scheduling.refusal import Refused
from profd.store.index import Index, TraceFilter
from profd.watch.incident import seen_by
from profd.watch.stats import mark_vs_role, slowest_first
from profd_client import protocol as P

log = logging.getLogger("profd.control")

SendFrames = Callable[[list[bytes]], None]
#: Ids an ambiguous session name lists.
SHOWN_AMBIGUOUS = 5
#: What ``history`` covers when the request gives no ``since``: the last hour.
HISTORY_DEFAULT_S = 3600.0


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
    #: Members of ``[daemon] admin_group`` may stop and retry any user's sessions.
    admin_gid: int | None = None
    #: The clients' heartbeat interval (``[daemon] heartbeat_interval``): how long a rank's
    #: step is moved on at its rate (``step_now``).
    heartbeat_interval: float = 1.0


class Later:
    """A handler's answer that is not ready yet (stacks read by worker threads). ``start``
    is given the function that sends the reply; the work must call it exactly once, on the
    loop (through the Reactor), so the REQ peer gets its one reply."""

    def __init__(self, start: Callable[[Callable[[Any], None]], None]) -> None:
        self.start = start


class ControlHandler:
    def __init__(
        self,
        facts: DaemonFacts,
        registry: Registry,
        ledgers: Ledgers,
        sessions: Sessions,
        index: Index,
        starter: Starter,
        flush: Callable[[], None],
        send: SendFrames,
        live_status: Callable[[], dict[str, Any]],
        retry: Callable[[str | None], int],
        incidents: Incidents,
        stacks: RankStacks | None = None,
    ) -> None:
        self.facts = facts
        self.registry = registry
        self.ledgers = ledgers
        self.sessions = sessions
        self.index = index
        self.starter = starter
        self.flush = flush
        self.send = send
        #: Counters owned elsewhere (pipeline, uploads, rejected agent frames).
        self.live_status = live_status
        self.retry = retry
        self.incidents = incidents
        self.stacks = stacks
        self.own_uid = os.geteuid()
        self.rejected = 0

    def handle(self, frames: list[bytes], peer: PeerCred | None) -> None:
        """A request on ``control.sock``: the kernel says who asks."""
        self.serve(
            frames, lambda: Requester.of(peer, self.own_uid, self.facts.admin_gid), self.send
        )

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
        reply = self.answer(frame, who, lambda late: send(P.join_envelope(envelope, late)))
        if reply is not None:
            send(P.join_envelope(envelope, reply))

    def answer(
        self,
        frame: bytes,
        who: Callable[[], Requester],
        later: Callable[[bytes], None] | None = None,
    ) -> bytes | None:
        """The one reply to a request, in the request's protocol version; None when a
        handler answers :class:`Later` (its reply goes to ``later`` when ready)."""
        try:
            msg = P.decode(frame, C.CONTROL_INBOUND)
        except P.ProtocolError as exc:
            self.rejected += 1
            if exc.code == "version":
                log.warning("control request in protocol version %s refused", P.version_of(exc.raw))
            return exc.reply()
        v = msg["v"]
        try:
            data = self.dispatch(msg, who())
            if isinstance(data, Later):
                if later is None:
                    raise RuntimeError(f"{msg['t']} answers later, and nobody waits")
                send_late = later
                data.start(lambda result: send_late(self._late_reply(msg, result)))
                return None
            return bounded_reply(self._reply(msg, data), v)
        except Refused as exc:
            return P.error(exc.code, str(exc), v=v)
        except Exception as exc:
            log.exception("control request failed")
            return P.error(P.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", v=v)

    def _late_reply(self, msg: dict[str, Any], data: Any) -> bytes:
        """A :class:`Later` result as the reply, on the loop, errors answered as at once."""
        v = msg["v"]
        try:
            return bounded_reply(self._reply(msg, data), v)
        except Exception as exc:
            log.exception("control request failed")
            return P.error(P.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", v=v)

    @staticmethod
    def _reply(msg: dict[str, Any], data: Any) -> bytes:
        """``ok`` with ``data``, checked once. Rows read back from the index may hold a value an
        older daemon stored beyond the protocol's bounds: then (only then) ``servable`` makes
        them sendable, so one bad value costs its own row's field, not the listing. Any other
        reply that breaks its schema is a bug here (ProtocolError: "internal")."""
        try:
            return C.reply(msg, data)
        except servable.UNSENDABLE:
            repaired = servable.repair(msg["t"], data)
            if repaired is data:
                raise
        return C.reply(msg, repaired)

    def dispatch(self, m: dict[str, Any], by: Requester) -> Any:
        return HANDLERS[m["t"]](self, m, by)

    def _stamp(self, rows: list[dict[str, Any]]) -> None:
        # Which daemon a row came from, for profctl --cluster: a row's own ``host`` is what
        # the client called its machine (a pod's name, or the same host for several test
        # daemons), which does not tell nodes apart.
        for r in rows:
            r["node"] = self.facts.host

    # --- one handler per request type (``HANDLERS``) ----------------------------------------
    # Requests that read the index flush first, so the answer has every change so far.
    def _status(self, m: dict[str, Any], by: Requester) -> Any:
        return self.status()

    def _ps(self, m: dict[str, Any], by: Requester) -> Any:
        rows = self.ps(m.get("job"), m.get("role"))
        self._stamp(rows)
        return rows

    def _top(self, m: dict[str, Any], by: Requester) -> Any:
        rows = self.top(m.get("job"), m.get("role"))
        self._stamp(rows)
        return rows

    def _start(self, m: dict[str, Any], by: Requester) -> Any:
        req = StartRequest.parse(m["spec"], validated=True)
        if req.probe:
            out = {"candidates": self.starter.candidates(req, by)}
        else:
            out = started(self.starter.start(req, by=by))
        self._stamp(out.get("targets") or out.get("candidates") or [])
        return out

    def _stop(self, m: dict[str, Any], by: Requester) -> Any:
        return self.stop(m["session"], keep=m["t"] == C.C_STOP, by=by)

    def _sessions(self, m: dict[str, Any], by: Requester) -> Any:
        self.flush()
        rows = self.index.sessions(m.get("state"), m.get("job"), m.get("limit") or 50)
        self._stamp(rows)
        return rows

    def _show(self, m: dict[str, Any], by: Requester) -> Any:
        self.flush()
        sid = self.session_id(m["session"])
        live = self.sessions.exact(sid)
        if live is not None:
            # From memory: right even while the index cannot be written (a full disk).
            s = live.summary()
        else:
            row = self.index.session(sid)
            if row is None:
                raise Refused("unknown_session", f"no session {m['session']!r}")
            s = row
            s["steps"] = sch.steps_of([tuple(c) for c in s["cycles"]])
            for t in s["targets"]:
                t["stem"] = t.get("stem") or claims.stem(t["role"], t["rank"])
            s["notes"] = claims.notes(
                (t["role"], t["rank"], t["pid"], t["stem"]) for t in s["targets"]
            )
        self._stamp([s, *s["targets"]])
        return s

    def _traces(self, m: dict[str, Any], by: Requester) -> Any:
        self.flush()
        try:
            flt = TraceFilter.from_map(m["filters"])
        except (TypeError, ValueError) as exc:
            raise Refused("bad_request", str(exc)) from None
        rows = self.index.traces(flt)
        self._stamp(rows)
        return rows

    def _history(self, m: dict[str, Any], by: Requester) -> Any:
        # From the index alone: a job's history outlives the job and this daemon. Minutes
        # still open for live ranks are not in it yet (the loop writes closed ones).
        now = time.time()
        since = m.get("since")
        until = m.get("until")
        since = now - HISTORY_DEFAULT_S if since is None else since
        until = now if until is None else until
        if since >= until:
            raise Refused("bad_request", "history: since must be before until")
        minutes, since = self.index.step_history(m["job"], since, until)
        return {
            "job": m["job"],
            "since": since,  # later than asked when the range held too many rows
            "until": until,
            "node": self.facts.host,
            "minutes": minutes,
        }

    def _incidents(self, m: dict[str, Any], by: Requester) -> Any:
        # From the index (incidents outlive their job and this daemon's start).
        rows = self.incidents.rows(
            job=m.get("job"), kind=m.get("kind"), since=m.get("since"), limit=m.get("limit") or 1000
        )
        # As ``stacks`` does: another user's stacks are theirs to see.
        rows = [seen_by(r, by.uid, by.privileged) for r in rows]
        self._stamp(rows)
        return rows

    def _incident(self, m: dict[str, Any], by: Requester) -> Any:
        self.flush()
        doc = seen_by(self.incidents.find(m["id"]), by.uid, by.privileged)
        doc["session_state"] = self._session_state(doc.get("session"))
        self._stamp([doc])
        return doc

    def _session_state(self, sid: str | None) -> str | None:
        if sid is None:
            return None
        live = self.sessions.exact(sid)
        if live is not None:
            return live.state
        row = self.index.session(sid)
        return None if row is None else str(row["state"])

    def _retry(self, m: dict[str, Any], by: Requester) -> Any:
        if not by.privileged:
            self._check_owner(m.get("session"), by)
        return {"requeued": self.retry(m.get("session"))}

    def _stacks(self, m: dict[str, Any], by: Requester) -> Any:
        clients = self.stack_clients(m.get("job"), m.get("rank"), by)
        reader = self.stacks
        if reader is None:
            raise Refused("unsupported", "this daemon reads no stacks")
        node = self.facts.host
        jobs = [c.job for c in clients]

        def start(reply: Callable[[Any], None]) -> None:
            def finish(rows: list[dict[str, Any]]) -> None:
                per_job: dict[str, list[dict[str, Any]]] = {}
                for job, row in zip(jobs, rows, strict=True):
                    per_job.setdefault(job, []).append(row)
                docs = [job_doc(j, per_job[j]) for j in sorted(per_job)]
                for d in docs:
                    d["node"] = node
                reply(docs)

            reader.read(clients, finish, native=bool(m.get("native")))

        return Later(start)

    def stack_clients(self, job: str | None, rank: int | None, by: Requester) -> list[Client]:
        """The served ranks ``stacks`` reads: of ``job`` and ``rank`` when given, and only
        the requester's own processes unless it may act on everyone's."""
        return [
            c
            for c in by_identity(self.registry)
            if (job is None or c.job == job)
            and (rank is None or c.rank == rank)
            and by.may_act_on(c.uid)
        ]

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
        served = by_identity(self.registry)
        # Processes that claim one identity are marked, whatever the filter shows of them.
        shared = claims.claimants(((c.job, c.role, c.rank), c.pid) for c in served)
        rows = []
        now, hb = time.monotonic(), self.facts.heartbeat_interval
        for c in served if job is None and role is None else filter(sel.matches, served):
            pids = shared.get((c.job, c.role, c.rank))
            row = c.row()  # a fresh dict: extended in place, not copied (1,024 rows per ps)
            row["duplicate"] = pids is not None
            row["claimed_by"] = pids or [c.pid]
            row["step"], row["step_extrapolated"], age = step_now(c, now, hb)
            row["age_s"] = round(age, 3)
            rows.append(row)
        # Peers of another protocol version are listed so nobody wonders where a job went.
        rows += [
            r
            for r in (p.row() for p in self.registry.incompatible.values())
            if (job is None or r["job"] == job)
        ]
        return rows

    def top(self, job: str | None, role: str | None) -> list[dict[str, Any]]:
        """One row per served rank (``C.TOP_ROW``), slowest against its role first."""
        clients: Any = self.registry
        if job is not None or role is not None:
            clients = filter(Selector(job=job, roles=(role,) if role else ()).matches, clients)
        now, hb = time.monotonic(), self.facts.heartbeat_interval
        figures = self.ledgers.figures
        rows = []
        for c in clients:
            f = figures(c, now)
            step, extrapolated, age = step_now(c, now, hb)
            rows.append(
                {
                    "host": c.host,
                    "pid": c.pid,
                    "job": c.job,
                    "role": c.role,
                    "rank": c.rank,
                    "world_size": c.world_size,
                    "step": step,
                    "step_extrapolated": extrapolated,
                    "age_s": round(age, 3),
                    "sps": round(c.sps, 2),
                    "step_ms_p50": _ms(f.p50_ms),
                    "step_ms_p99": _ms(f.p99_ms),
                    "window_s": None if f.window_s is None else round(f.window_s, 1),
                    "source": f.source,
                    "regions": f.regions,
                    "cpu_percent": c.cpu,
                    "rss_bytes": c.rss,
                    "gpu_util": c.gpu_util,
                    "gpu_mem_bytes": c.gpu_mem,
                }
            )
        # A role's ranks are all here whatever the filter (it selects whole jobs and roles),
        # so each is compared with its whole role on this node.
        mark_vs_role(rows)
        return slowest_first(rows)

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
        sid = self.session_id(session_id)
        s = self.starter.stop(sid, keep, by)
        if s is None:
            row = self.index.session(sid)
            if row is None:
                raise Refused("unknown_session", f"no session {session_id!r}")
            raise Refused("finished", f"session {row['id']} already ended: {row['state']}")
        return {"session": s.id, "state": s.state}

    def session_id(self, text: str) -> str:
        """The session ``text`` names: the one with that id, else the one whose id contains
        it (Refused when none does, or several do: a guess could stop the wrong one)."""
        if self.sessions.exact(text) is not None or self.index.has_session(text):
            return text
        # Live sessions may not be in the index yet (its writes are behind).
        hits = set(self.sessions.containing(text))
        hits.update(self.index.session_ids(text, SHOWN_AMBIGUOUS + 1))
        if len(hits) == 1:
            return hits.pop()
        if not hits:
            raise Refused("unknown_session", f"no session {text!r}")
        ids = sorted(hits, reverse=True)
        more = ", ..." if len(ids) > SHOWN_AMBIGUOUS else ""
        raise Refused(
            "ambiguous",
            f"session {text!r} is ambiguous: it is part of {', '.join(ids[:SHOWN_AMBIGUOUS])}"
            f"{more}; give more of the id",
        )


#: The handler of each request type: every type in ``C.CONTROL_INBOUND``, so a decoded
#: request always has one.
HANDLERS: dict[str, Callable[[ControlHandler, dict[str, Any], Requester], Any]] = {
    C.C_STATUS: ControlHandler._status,
    C.C_PS: ControlHandler._ps,
    C.C_START: ControlHandler._start,
    C.C_STOP: ControlHandler._stop,
    C.C_CANCEL: ControlHandler._stop,
    C.C_SESSIONS: ControlHandler._sessions,
    C.C_SHOW: ControlHandler._show,
    C.C_TRACES: ControlHandler._traces,
    C.C_RETRY: ControlHandler._retry,
    C.C_TOP: ControlHandler._top,
    C.C_HISTORY: ControlHandler._history,
    C.C_INCIDENTS: ControlHandler._incidents,
    C.C_INCIDENT: ControlHandler._incident,
    C.C_STACKS: ControlHandler._stacks,
}


def bounded_reply(reply: bytes, v: int, limit: int = P.MAX_REPLY_BYTES) -> bytes:
    """``reply``, or an error saying it is too large: profctl drops a frame over its limit
    (``zmq.MAXMSGSIZE``) unread and would wait for an answer that never comes."""
    if len(reply) <= limit:
        return reply
    log.warning("control reply of %d bytes not sent (at most %d)", len(reply), limit)
    return P.error(
        P.ErrorCode.TOO_LARGE,
        f"the reply is {len(reply)} bytes, over the {limit} bytes profctl accepts:"
        " ask for less (filters, --limit)",
        v=v,
    )


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def by_identity(clients: Any) -> list[Client]:
    return sorted(clients, key=lambda c: (c.job, c.role, c.rank, c.host, c.pid))
