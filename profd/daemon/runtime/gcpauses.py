"""How long Python's cyclic garbage collector has stopped the daemon, by generation.

Every collection runs on whichever thread allocated last, usually the event loop, and holds
the GIL throughout: a full pass over what 1,024 ranks' ledgers keep took ~30 ms before their
window entries were taken out of the collector's view (docs/benchmarks.md). ``status``
reports these figures so that a slow ``ps`` can be told apart from a collector pause.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

GENERATIONS = 3


class GcPauses:
    """Counts, total and longest collector pause per generation since :meth:`install`.

    The callback only reads the clock and adds: it runs for every collection (tens a
    second at 1,024 ranks) and must cost next to nothing."""

    def __init__(self) -> None:
        self.count = [0] * GENERATIONS
        self.total_s = [0.0] * GENERATIONS
        self.longest_s = [0.0] * GENERATIONS
        self._began = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        g = info["generation"]
        self.count[g] += 1
        self.total_s[g] += took
        if took > self.longest_s[g]:
            self.longest_s[g] = took

    def status(self) -> dict[str, Any]:
        """``status``'s ``gc``: per generation (0 youngest, 2 the full pass), passes since
        the daemon started, their total and the longest, in ms; and the objects the
        collector watches now (what start-up built is frozen out of it)."""
        return {
            "passes": list(self.count),
            "total_ms": [round(s * 1000, 1) for s in self.total_s],
            "longest_ms": [round(s * 1000, 2) for s in self.longest_s],
            # A list of them all is made to count them: a few ms at 1,024 ranks, on a request.
            "tracked_objects": len(gc.get_objects()),
            "frozen_objects": gc.get_freeze_count(),
        }


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """No collection inside the block; the collector runs again after it, as it would have.

    For a control request: its reply for 1,024 ranks is tens of thousands of short-lived,
    acyclic containers, enough to start several young collections and now and then a full
    one (~25 ms on the loop, the ``ps`` round trip's p99; docs/benchmarks.md). Freed before
    the block ends, they leave the collector's allocation count where it was, so deferring
    costs nothing later. Heartbeats alone start a young collection a few times a minute."""
    if not gc.isenabled():  # already deferred (or disabled by whoever embeds the daemon)
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
