"""Sending ``arm`` to a target's process: one frame per session revision, any client version."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from profd.daemon.clients.registry import Client
from profd.daemon.sessions.state import Session
from profd.daemon.spool.clientfiles import UnsafeFile
from profd.daemon.spool.incoming import Incoming
from profd_client import protocol as P

log = logging.getLogger("profd.arming")

Send = Callable[[bytes, bytes], None]


class Arms:
    def __init__(self, send: Send, homes: Incoming) -> None:
        self._send = send
        self._homes = homes
        # The frame is the same for every target of a session revision, so a 1024-rank
        # start encodes it once per protocol version, not 1024 times.
        self._frames: dict[tuple[str, int, int], bytes] = {}

    def arm_all(self, s: Session, clients: Iterable[Client]) -> None:
        """Arm many processes, then make their incoming dirs in one walk.

        Arms first: a process writes into its dir only when its capture ends, at least two
        step boundaries after the arm reaches it, while making a thousand dirs (a ``mkdir``
        each) before sending would hold every arm back by tens of milliseconds.
        """
        clients = list(clients)
        for c in clients:
            self._send_arm(s, c)
        self._homes.make_homes(
            s.job, s.id, s.revision, [(c.host, c.pid, c.uid, c.gid) for c in clients]
        )
        for c in clients:
            self._make_home(s, c)  # made above, unless the batch could not: then it says why

    def arm(self, s: Session, c: Client) -> None:
        """Arm one process (it attached, or asked again), its dir made first."""
        self._make_home(s, c)
        self._send_arm(s, c)

    def _make_home(self, s: Session, c: Client) -> None:
        try:
            self._homes.make_home(s.job, s.id, s.revision, c.host, c.pid, c.uid, c.gid)
        except (OSError, UnsafeFile) as exc:
            # Armed all the same: its capture then fails writing and says why, per rank.
            log.error("session %s: no incoming dir for pid %s: %s", s.id, c.pid, exc)

    def _send_arm(self, s: Session, c: Client) -> None:
        if P.adapter.per_peer(P.ARM, c.version):
            # The peer's version names this process's own dir in its arm: one frame each.
            fields = s.arm_fields(self._homes.incoming_dir(s.job, s.id))
            peer = P.Peer(c.host, c.pid)
            self._send(c.ident, P.encode(P.ARM, v=c.version, peer=peer, **fields))
            return
        key = (s.id, s.revision, c.version)
        frame = self._frames.get(key)
        if frame is None:
            self._forget(s.id, keep=s.revision)
            fields = s.arm_fields(self._homes.incoming_dir(s.job, s.id))
            frame = self._frames[key] = P.encode(P.ARM, v=c.version, **fields)
        self._send(c.ident, frame)

    def disarm(self, s: Session, c: Client, keep: bool) -> None:
        key = (s.id, -1 if keep else -2, c.version)  # beside the arm frames, same lifetime
        frame = self._frames.get(key)
        if frame is None:
            frame = self._frames[key] = P.encode(P.DISARM, v=c.version, session=s.id, keep=keep)
        self._send(c.ident, frame)

    def ended(self, session_id: str) -> None:
        self._forget(session_id)

    def _forget(self, session_id: str, keep: int | None = None) -> None:
        """Drop a session's frames (but those of revision ``keep``, and its disarms)."""
        for k in [
            k
            for k in self._frames
            if k[0] == session_id and (keep is None or (k[1] != keep and k[1] >= 0))
        ]:
            del self._frames[k]
