"""Questions to clients' agent threads, answered by a message with the question's ``id``:
their own stacks (``dump_stacks``, the fallback when py-spy may not trace the process) and
their black box (``blackbox``). Owned by the event loop: a question waits here for its
answer until a deadline, or until its client is gone (``expire``, each tick)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from profd.daemon.clients.registry import Client
from profd_client import protocol as P

#: Seconds a client's agent thread has to answer.
ANSWER_S = 2.0

#: ``(answer, None)`` on an answer (the client's ``stacks_result`` as sent: its ``threads``,
#: and ``flight`` or ``flight_error`` when asked), ``(None, why)`` without one.
Answered = Callable[[P.StacksResult | None, str | None], None]

A = TypeVar("A")


class Questions(Generic[A]):
    """Questions in flight, each to one client: ``id`` -> who was asked, the deadline, the
    seconds it had and whom to tell. ``gone(ident)`` says a client asked has left (exited,
    detached, re-registered under another routing id): its question ends at the next
    :meth:`expire`, named, instead of at its deadline."""

    def __init__(self, gone: Callable[[bytes], bool] | None = None) -> None:
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[bytes, float, float, Callable[[A | None, str | None], None]]]
        self._pending = {}
        self.gone = gone

    def open(self, c: Client, wait: float, done: Callable[[A | None, str | None], None]) -> int:
        rid = next(self._ids)
        self._pending[rid] = (c.ident, time.monotonic() + wait, wait, done)
        return rid

    def close(self, c: Client, rid: int) -> Callable[[A | None, str | None], None] | None:
        """Whom to tell of ``c``'s answer to ``rid``: only the client asked may answer."""
        entry = self._pending.get(rid)
        if entry is None or entry[0] != c.ident:
            return None
        del self._pending[rid]
        return entry[3]

    def expire(self, now: float) -> None:
        for rid, (ident, deadline, wait, done) in list(self._pending.items()):
            if deadline <= now:
                del self._pending[rid]
                done(None, f"its agent thread did not answer in {wait:g}s")
            elif self.gone is not None and self.gone(ident):
                del self._pending[rid]
                done(None, "it exited or detached before answering")

    def __len__(self) -> int:
        return len(self._pending)


class AgentStacks:
    def __init__(self, send: Callable[[bytes, bytes], None], timeout: float = ANSWER_S) -> None:
        self.send = send
        self.timeout = timeout
        self.questions: Questions[P.StacksResult] = Questions()

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
        rid = self.questions.open(c, self.timeout if timeout is None else timeout, done)
        extra: dict[str, Any] = {} if stacks else {"stacks": False}
        if flight:
            extra["flight"] = True
        self.send(c.ident, P.encode(P.STACKS_REQUEST, v=c.version, id=rid, **extra))

    def result(self, c: Client, m: P.StacksResult) -> None:
        """A client's ``stacks_result``: only the client asked may answer its request."""
        done = self.questions.close(c, m.id)
        if done is not None:
            done(m, None)

    def expire(self, now: float) -> None:
        self.questions.expire(now)


class AgentBlackboxes:
    """``blackbox`` questions: the answer is the client's ``blackbox_result`` as sent."""

    def __init__(self, send: Callable[[bytes, bytes], None], gone: Callable[[bytes], bool]) -> None:
        self.send = send
        self.questions: Questions[P.BlackboxResult] = Questions(gone)

    def ask(
        self,
        c: Client,
        done: Callable[[P.BlackboxResult | None, str | None], None],
        timeout: float,
    ) -> None:
        rid = self.questions.open(c, timeout, done)
        self.send(c.ident, P.encode(P.BLACKBOX_REQUEST, v=c.version, id=rid))

    def result(self, c: Client, m: P.BlackboxResult) -> None:
        done = self.questions.close(c, m.id)
        if done is not None:
            done(m, None)

    def expire(self, now: float) -> None:
        self.questions.expire(now)
