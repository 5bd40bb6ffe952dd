"""Every rank's closed minutes, from the step ledger to the index, written by the loop's tick.

Heartbeats never write: :class:`Ledgers` queues a rank's minute when it closes, and once a
tick the loop hands what it queued to :meth:`StepHistory.tick`, one transaction for all of
them. A write that fails (a full disk, a locked index) keeps the minutes for the next tick,
at most :data:`MAX_PENDING` (the oldest are dropped first: the newest say most about a job
that is still running). Minutes older than ``[watch] keep_history`` are deleted at start and
then at most once an hour. ``profctl history`` reads only the index, so a job's history
outlives the job and the daemon.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Iterable

from profd.daemon.clients.ledger import MinuteSummary
from profd.daemon.spool.storage import Storage
from profd.store.index import StepMinuteRepo

log = logging.getLogger("profd.history")

#: Minutes held while the index cannot be written: a full hour of 512 ranks (about 15 MB).
MAX_PENDING = 32_768
#: Seconds between two retention passes.
PRUNE_EVERY_S = 3600.0


class StepHistory:
    """The loop's writer of ``step_minutes`` rows; owns the minutes not written yet."""

    def __init__(
        self,
        minutes: StepMinuteRepo,
        storage: Storage,
        keep_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.minutes = minutes
        self.storage = storage
        self.keep_s = keep_s
        self._clock = clock
        self.pending: deque[MinuteSummary] = deque(maxlen=MAX_PENDING)
        self.dropped = 0  # minutes lost to MAX_PENDING while the index was unwritable
        self.failing = False  # the last write failed (and Storage was told)
        self._next_prune = 0.0  # the first tick prunes

    def reconfigure(self, keep_s: float) -> None:
        """A new ``keep_history`` (SIGHUP): rows older than it go at the next prune."""
        self.keep_s = keep_s

    def tick(self, minutes: Iterable[MinuteSummary]) -> None:
        """Write ``minutes`` and any left from a failed write; prune when it is time."""
        for m in minutes:
            if len(self.pending) == MAX_PENDING:
                self.dropped += 1
            self.pending.append(m)
        if self.pending:
            self._write()
        now = self._clock()
        if now >= self._next_prune:
            self._prune(now)

    def _write(self) -> None:
        rows = [vars(m) for m in self.pending]  # asdict's deep copy: 30 ms at 1,024
        try:
            self.minutes.add_step_minutes(rows)
        except Exception as exc:  # unwritable now (full, locked): the rows wait, bounded
            self.storage.failed("index", exc, f"{len(rows)} step-time minutes")
            self.failing = True
            return
        self.pending.clear()
        if self.failing:
            # Only after a failure of its own: a small write getting through must not clear
            # a problem another writer of the index still has (its next failure would log
            # it again, and again).
            self.failing = False
            self.storage.ok("index")
        if self.dropped:
            log.warning(
                "%d step-time minutes were dropped while the index could not be written",
                self.dropped,
            )
            self.dropped = 0

    def _prune(self, now: float) -> None:
        try:
            n = self.minutes.prune_step_minutes(now - self.keep_s)
        except sqlite3.Error as exc:
            log.warning("cannot delete old step-time minutes: %s; trying again in a minute", exc)
            self._next_prune = now + 60.0
            return
        self._next_prune = now + PRUNE_EVERY_S
        if n:
            log.info("deleted %d step-time minutes older than %.0fs (keep_history)", n, self.keep_s)

    def seed(self, job: str, role: str, rank: int, since: float) -> tuple[int, float] | None:
        """The ``Ledgers`` seed lookup: a rank's newest minute since ``since`` in the index;
        None when there is none or the index cannot be read (``top`` then says less)."""
        try:
            return self.minutes.last_step_minute(job, role, rank, since)
        except sqlite3.Error as exc:
            log.debug("no seed for %s/%s/%d: %s", job, role, rank, exc)
            return None
