"""The fallback source of stacks: a client's agent thread sends its own
(``sys._current_frames()``) when py-spy may not trace the process. Owned by the event loop:
requests wait here for their ``stacks_result`` until a deadline (``expire``, each tick)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from profd.daemon.clients.registry import Client
from profd_client import protocol as P

#: Seconds a client's agent thread has to answer.
ANSWER_S = 2.0

#: ``(threads, None)`` on an answer, ``(None, why)`` without one.
Answered = Callable[[list[dict[str, Any]] | None, str | None], None]


class AgentStacks:
    def __init__(self, send: Callable[[bytes, bytes], None], timeout: float = ANSWER_S) -> None:
        self.send = send
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[bytes, float, Answered]] = {}

    def ask(self, c: Client, done: Answered) -> None:
        rid = next(self._ids)
        self._pending[rid] = (c.ident, time.monotonic() + self.timeout, done)
        self.send(c.ident, P.encode(P.STACKS_REQUEST, v=c.version, id=rid))

    def result(self, c: Client, m: dict[str, Any]) -> None:
        """A client's ``stacks_result``: only the client asked may answer its request."""
        entry = self._pending.get(m["id"])
        if entry is None or entry[0] != c.ident:
            return
        del self._pending[m["id"]]
        threads = [
            {"name": t["name"], "tid": t["tid"], "frames": t["frames"]} for t in m["threads"]
        ]
        entry[2](threads, None)

    def expire(self, now: float) -> None:
        late = [rid for rid, (_, deadline, _) in self._pending.items() if deadline <= now]
        for rid in late:
            _, _, done = self._pending.pop(rid)
            done(None, f"its agent thread did not answer in {self.timeout:g}s")
