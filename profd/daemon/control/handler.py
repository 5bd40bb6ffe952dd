"""Requests from profctl on ``control.sock``: the only socket that can start sessions.

A router: it decodes, dispatches to the handler of the request's type (one module per family
of requests, ``requests/``), and replies in the request's envelope and protocol version.
Every request gets exactly one reply (a REQ peer that got none could not send again).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from profd import control_schema as C
from profd.daemon.clients.blackbox_collect import BlackboxCollector
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Registry
from profd.daemon.clients.stack_sources import RankStacks
from profd.daemon.control import servable
from profd.daemon.control.requests import HANDLERS
from profd.daemon.control.requests.context import Context, DaemonFacts, Later
from profd.daemon.runtime import gcpauses
from profd.daemon.runtime.peers import PeerCred, Requester
from profd.daemon.sessions.starts import Starter
from profd.daemon.sessions.state import Sessions
from profd.daemon.watch.incident_store import Incidents
from profd.scheduling.refusal import Refused
from profd.store.index import (
    FileRepo,
    SessionRepo,
    StepMinuteRepo,
    TraceRepo,
    UploadQueueRepo,
    WarehouseQueueRepo,
)
from profd_client import protocol as P

if TYPE_CHECKING:  # pyarrow, imported by a daemon that exports only
    from profd.warehouse.export import Exporter

__all__ = ["HANDLERS", "ControlHandler", "DaemonFacts", "Later", "bounded_reply"]

log = logging.getLogger("profd.control")

SendFrames = Callable[[list[bytes]], None]


class ControlHandler:
    def __init__(
        self,
        facts: DaemonFacts,
        registry: Registry,
        ledgers: Ledgers,
        sessions: Sessions,
        session_rows: SessionRepo,
        traces: TraceRepo,
        files: FileRepo,
        queue: UploadQueueRepo,
        minutes: StepMinuteRepo,
        starter: Starter,
        flush: Callable[[], None],
        send: SendFrames,
        live_status: Callable[[], dict[str, Any]],
        retry: Callable[[str | None], int],
        incidents: Incidents,
        stacks: RankStacks | None = None,
        blackboxes: BlackboxCollector | None = None,
        warehouse: Exporter | None = None,
        warehouse_rows: WarehouseQueueRepo | None = None,
    ) -> None:
        self.facts = facts
        self.send = send
        #: What every request's handler is given (``requests/``): never this router.
        self.context = Context(
            facts,
            registry,
            ledgers,
            sessions,
            session_rows,
            traces,
            files,
            queue,
            minutes,
            starter,
            flush,
            live_status,
            retry,
            incidents,
            stacks,
            rejected=lambda: self.rejected,
            blackboxes=blackboxes,
            warehouse=warehouse,
            warehouse_rows=warehouse_rows,
        )
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
        with gcpauses.deferred():
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
            if exc.code == P.ErrorCode.VERSION:
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
        return HANDLERS[m["t"]](self.context, m, by)


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
