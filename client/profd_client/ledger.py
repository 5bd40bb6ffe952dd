"""The step ledger a heartbeat carries (protocol 3): what the agent thread reads from the
training thread's clock ring and region timers, and the summary it ships (``protocol.Ledger``).

:func:`summarize` is pure: durations in, the ``ledger`` map out. :class:`Reader` runs on the
agent thread; it never blocks or locks the training thread, it reads what the training thread
wrote and discards what it may have overwritten meanwhile (see ``steps.py``).

A heartbeat stays within 16 KiB at any step rate and region count: the statistics cover at
most the last ``LEDGER_RING`` steps (``n`` and ``sum`` count them all), and ``r`` names at
most ``MAX_LEDGER_REGIONS`` regions whose names take at most :data:`REGION_NAME_BYTES` bytes.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any, Final

from . import protocol as P
from .steps import RING, Stepper, slots

#: The UTF-8 bytes of region names one ledger carries at most: 32 names of 200 characters of
#: 4 bytes each would not fit a 16 KiB heartbeat; the regions with least time are left out.
REGION_NAME_BYTES: Final = 12 * 1024
#: Quantiles in a ledger's ``q`` (the last one, 1.0, is the maximum).
QUANTILES: Final = (0.5, 0.9, 0.99, 1.0)
_MASK: Final = RING - 1


def _seconds(x: float) -> float:
    # perf_counter never goes back, but a ledger the daemon refuses would cost the heartbeat.
    return min(max(x, 0.0), P.MAX_SECONDS) if math.isfinite(x) else 0.0


def quantile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank ``q`` quantile of ascending ``ordered`` (not empty): a value it holds."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def buckets(ordered: Sequence[float]) -> list[int]:
    """Counts of ascending ``ordered`` per ``STEP_BUCKETS`` bucket (``d <= bound``, above the
    previous bound), plus the count above the last bound."""
    out, below = [], 0
    for bound in P.STEP_BUCKETS:
        upto = bisect.bisect_right(ordered, bound)
        out.append(upto - below)
        below = upto
    out.append(len(ordered) - below)
    return out


def top_regions(regions: Iterable[tuple[str, float, int]]) -> list[list[Any]]:
    """``r``: the regions with most time first, at most ``MAX_LEDGER_REGIONS`` of them and
    :data:`REGION_NAME_BYTES` of names."""
    out: list[list[Any]] = []
    room = REGION_NAME_BYTES
    for name, seconds, entries in sorted(regions, key=lambda r: (-r[1], -r[2], r[0])):
        if len(out) == P.MAX_LEDGER_REGIONS:
            break
        size = len(name.encode())
        if size > room:
            continue  # a shorter name with less time may still fit
        room -= size
        out.append([name, _seconds(seconds), min(max(entries, 0), P.MAX_STEP)])
    return out


def summarize(
    durations: Sequence[float],
    *,
    n: int,
    total: float,
    at: int,
    epoch: int,
    regions: Iterable[tuple[str, float, int]] = (),
) -> dict[str, Any]:
    """The ``ledger`` map: ``n`` steps ended since the last heartbeat, the last of them step
    ``at``, ``total`` seconds in all; ``durations`` are the step times that could be read (the
    last ``len(durations) <= n`` of them); ``regions`` are ``(name, seconds, entries)`` deltas.
    With no durations ``q`` and ``b`` are zeros."""
    ordered = sorted(map(_seconds, durations))
    q = [quantile(ordered, x) for x in QUANTILES] if ordered else [0.0] * len(QUANTILES)
    return {
        "at": min(max(at, 0), P.MAX_STEP),
        "n": min(max(n, 0), P.MAX_STEP),
        "sum": _seconds(total),
        "q": q,
        "b": buckets(ordered),
        "r": top_regions(regions),
        "epoch": epoch,
    }


class Reader:
    """The agent thread's side of one :class:`~.steps.Stepper`'s ledger: what it shipped last
    (the step, its end time, the jump epoch it belongs to, each region's totals)."""

    def __init__(self, stepper: Stepper) -> None:
        self.st = stepper
        self._epoch: int | None = None
        self._step = 0
        self._t = 0.0
        self._regions: dict[str, tuple[float, int]] = {}
        self.restart()

    def restart(self) -> None:
        """Ship only what happens from now on (a new daemon, or one we said hello again to,
        has no use for steps from before it knew this process)."""
        st = self.st
        self._regions = {t.name: (t.seconds, t.entries) for t in list(st.regions.values())}
        base = st.base
        c = st.count
        t = st._ring[c & _MASK]
        # The slot is step c's (written before count said c) unless the training thread went
        # round the whole ring meanwhile; a jump meanwhile replaces ``base``.
        if base is None or st.base is not base or st.count - c >= RING - 1:
            self._epoch = None
            return
        self._epoch, self._step, self._t = base[0], c, t

    def take(self) -> dict[str, Any] | None:
        """The ledger since the last one taken, or None when this read cannot tell (a jump
        while reading, or the state unknown since :meth:`restart`): the next one will."""
        st = self.st
        if self._epoch is None:
            self.restart()
            return None
        base = st.base
        if base is None:
            return None
        epoch, jumped_to, jumped_at = base
        if epoch != self._epoch:
            # step(n) jumped the count: time the steps after it, from the jump.
            self._epoch, self._step, self._t = epoch, jumped_to, jumped_at
        b, tb = self._step, self._t
        c1 = st.count
        n = c1 - b
        if n < 0:
            return None
        first = max(b + 1, c1 - P.LEDGER_RING + 1)
        times = self._slots(first, c1)
        c2 = st.count
        if st.base is not base:
            return None  # a jump meanwhile: the next ledger starts from it
        # A slot is written just before count moves on, so with count at c2 the training
        # thread may have written the slots of steps up to c2 + 1: each overwrote the step
        # RING before it.
        oldest = c2 + 2 - RING
        if n and c1 < oldest:
            return None  # went round the whole ring while we copied: not in practice
        if first < oldest:
            times = times[oldest - first :]
            first = oldest
        chain = [tb, *times] if first == b + 1 else times
        durations = [y - x for x, y in itertools.pairwise(chain)]
        last_t = times[-1] if n else tb
        ledger = summarize(
            durations,
            n=n,
            total=last_t - tb,
            at=c1,
            epoch=epoch,
            regions=self._region_deltas(),
        )
        self._step, self._t = c1, last_t
        return ledger

    def _slots(self, first: int, last: int) -> list[float]:
        """The ring's times of steps ``first..last`` (at most ``RING``), oldest first."""
        return slots(self.st._ring, first, last)

    def _region_deltas(self) -> list[tuple[str, float, int]]:
        out = []
        last = self._regions
        for t in list(self.st.regions.values()):  # one C call: safe against a new name
            seconds, entries = t.seconds, t.entries
            s0, e0 = last.get(t.name, (0.0, 0))
            if entries != e0 or seconds != s0:
                out.append((t.name, seconds - s0, entries - e0))
                last[t.name] = (seconds, entries)
        return out
