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

#: ``(answer, None)`` on an answer (``threads``, and ``flight`` or ``flight_error`` when
#: asked), ``(None, why)`` without one.
Answered = Callable[[dict[str, Any] | None, str | None], None]


class AgentStacks:
    def __init__(self, send: Callable[[bytes, bytes], None], timeout: float = ANSWER_S) -> None:
        self.send = send
        self.timeout = timeout
        self._ids = itertools.count(1)
        #: id -> (who was asked, deadline, seconds it had, whom to tell)
        self._pending: dict[int, tuple[bytes, float, float, Answered]] = {}

    def ask(
        self,
        c: Client,
        done: Answered,
        stacks: bool = True,
        flight: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Ask ``c``'s agent thread for its threads' stacks and, when ``flight``, its flight
        recorder's summary; ``timeout`` seconds to answer (default: the reader's)."""
        rid = next(self._ids)
        wait = self.timeout if timeout is None else timeout
        self._pending[rid] = (c.ident, time.monotonic() + wait, wait, done)
        extra: dict[str, Any] = {} if stacks else {"stacks": False}
        if flight:
            extra["flight"] = True
        self.send(c.ident, P.encode(P.STACKS_REQUEST, v=c.version, id=rid, **extra))

    def result(self, c: Client, m: P.StacksResult) -> None:
        """A client's ``stacks_result``: only the client asked may answer its request."""
        entry = self._pending.get(m.id)
        if entry is None or entry[0] != c.ident:
            return
        del self._pending[m.id]
        answer: dict[str, Any] = {
            "threads": [
                {"name": t["name"], "tid": t["tid"], "frames": t["frames"]} for t in m.threads
            ]
        }
        if m.flight is not P.UNSET:
            answer["flight"] = m.flight
        if m.flight_error is not P.UNSET:
            answer["flight_error"] = m.flight_error
        entry[3](answer, None)

    def expire(self, now: float) -> None:
        late = [rid for rid, entry in self._pending.items() if entry[1] <= now]
        for rid in late:
            _, _, wait, done = self._pending.pop(rid)
            done(None, f"its agent thread did not answer in {wait:g}s")
