"""Waiting for several answers that arrive one by one (worker threads, agent threads) and
acting once, after the last."""

from __future__ import annotations

import threading
from collections.abc import Callable


class FanIn:
    """``done()`` runs once, on whichever thread brings the last of ``parts`` answers
    (:meth:`arrived`). Thread-safe: worker threads may answer at once."""

    def __init__(self, parts: int, done: Callable[[], None]) -> None:
        if parts < 1:
            raise ValueError(f"a fan-in waits for at least one part, not {parts}")
        self._left = parts
        self._done = done
        self._lock = threading.Lock()

    def arrived(self) -> None:
        """One part arrived."""
        with self._lock:
            if self._left == 0:
                raise RuntimeError("more parts arrived than the fan-in waited for")
            self._left -= 1
            last = self._left == 0
        if last:
            self._done()

    @property
    def left(self) -> int:
        return self._left
