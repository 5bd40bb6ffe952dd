"""Thread-safe hand-off into the event loop: workers report back, the loop acts.

Worker threads (pipeline callbacks, the process-statistics thread, uploaders) call
:meth:`Reactor.call_soon`; the loop polls :attr:`fd` together with its ZeroMQ sockets and
runs the calls in order. This keeps one owner (the loop thread) for the registry and the sessions.
"""

from __future__ import annotations

import logging
import os
import queue
from collections.abc import Callable
from typing import Any

log = logging.getLogger("profd")


class Reactor:
    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def fd(self) -> int:
        return self._r

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self._calls.put((fn, args))
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass  # the pipe is full, so the loop is already due to wake

    def run_pending(self) -> int:
        try:
            os.read(self._r, 65536)
        except BlockingIOError:
            pass
        n = 0
        while True:
            try:
                fn, args = self._calls.get_nowait()
            except queue.Empty:
                return n
            try:
                fn(*args)
            except Exception:
                # One bad result (a report that breaks indexing, say) must not stop the
                # daemon, nor the calls queued behind it.
                log.exception("error in %s", getattr(fn, "__qualname__", fn))
            n += 1

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
