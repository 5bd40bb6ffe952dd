"""Sending ``arm`` to a target's process: one frame per session revision, any client version."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from profd_client import protocol as P

from .registry import Client
from .sessions import Session

Send = Callable[[bytes, bytes], None]


class Arms:
    def __init__(self, send: Send, incoming_dir: Callable[[str, str], Path]) -> None:
        self._send = send
        self._incoming_dir = incoming_dir
        # The frame is the same for every target of a session revision, so a 1024-rank
        # start encodes it once per protocol version, not 1024 times.
        self._frames: dict[tuple[str, int, int], bytes] = {}

    def arm(self, s: Session, c: Client) -> None:
        key = (s.id, s.revision, c.version)
        frame = self._frames.get(key)
        if frame is None:
            self._forget(s.id, keep=s.revision)
            fields = s.arm_fields(self._incoming_dir(s.job, s.id))
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
