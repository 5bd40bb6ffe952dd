"""Every attached rank's step times (the step ledger), in bounded memory. Owned by the loop.

Each heartbeat of a protocol-3 client carries a ledger: the steps that ended since the last
one, summarised by the client (count, total, p50/p90/p99/max, histogram counts, region
times). :class:`Ledgers` keeps, per rank, the last :data:`FULL` of those intervals at full
resolution and the last :data:`MINUTES` minutes as per-minute summaries (a fixed budget per
rank: about 25 KB), the histogram and counters since the rank attached (``/metrics``), and
closes each rank's minute into a :class:`MinuteSummary` that the loop writes to the index.

Protocol-2 clients send no ledger: their steps are counted from the step numbers of their
heartbeats, and ``top`` shows their step time as the inverse of their rate.

What one rank can make the daemon keep is bounded whatever its client sends: at most
``max_regions`` region names (time in any other region counts as :data:`OTHER_REGION`), and
at most ``rate`` heartbeats a second each become an interval (the ring and ``top``'s window
hold intervals); a ledger over the rate is coalesced into the rank's next one, so its steps,
histogram and region time still count, a tick late at most. The peer is never dropped or
slowed for it: its heartbeats keep it alive as always. Both are counted (``status``).

A rank that attaches to a restarted daemon has no ledger yet: until its first one arrives,
its p50 is its last minute in the index (``source`` "index") when that minute ended at most
:data:`SEED_MAX_AGE_S` ago, through the ``seed`` lookup the loop passes in (no SQL here).
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import add
from statistics import median
from typing import Any, NamedTuple

import msgspec

from profd.daemon.clients.registry import Client
from profd.watch.kinds.kind import TickRank
from profd.watch.snapshot import RankSeries
from profd.watch.stats import weighted_quantile
from profd_client import protocol as P

log = logging.getLogger("profd.agents")

#: Heartbeat intervals kept at full resolution per rank (5 minutes at 1 Hz).
FULL = 300
#: Closed minutes kept in memory per rank (the index keeps them for ``keep_history``).
MINUTES = 60
#: What ``top``'s step-time figures cover.
TOP_WINDOW_S = 60.0
#: How long after its end a rank's last minute in the index stands in for its ledger.
SEED_MAX_AGE_S = 120.0
#: Where the time of a rank's regions beyond its first ``max_regions`` names goes.
OTHER_REGION = "(other)"
#: Defaults of the bounds (``[daemon] max_regions_per_rank``, ``max_heartbeat_rate``).
MAX_REGIONS = 64
MAX_RATE = 10.0

#: ``seed(job, role, rank, since)``: the newest (minute start, p50 ms) of that rank that
#: starts at ``since`` (unix) or later, or None.
SeedLookup = Callable[[str, str, int, float], "tuple[int, float] | None"]

_NBUCKETS = len(P.STEP_BUCKETS) + 1


class _Interval(NamedTuple):
    """One heartbeat's interval, as the ring holds it: ``_W`` floats from ``index * _W``
    (a flat array, not objects: the ring's fixed 22 KB per rank is most of its budget)."""

    end: float  # monotonic
    steps: float
    sum_s: float
    p50: float
    p90: float
    p99: float
    max_s: float
    wait_s: float  # collective wait (``Ledger.wait``) applied with this interval, 0: none
    wait_n: float  # the steps that wait covers


# Offsets of the ring's fields, read in place by the detectors' and ``top``'s reads.
_T, _N, _SUM, _P50, _P90, _P99, _MAX, _WS, _WN = range(len(_Interval._fields))
_W = len(_Interval._fields)


class KeptMinute(NamedTuple):
    """One closed minute of a rank as the ledger keeps it in memory (``_MW`` floats in
    ``Ledger.minutes``), in seconds; the index's row of it is ``store.index.MinuteRow`` (ms)."""

    start: int  # unix time of the minute's start
    steps: int
    sum_s: float
    p50_s: float  # NaN where unknown
    p90_s: float  # NaN where unknown
    max_s: float


_MW = len(KeptMinute._fields)


@dataclass(frozen=True)
class MinuteSummary:
    """One rank's steps in one minute of wall time (a row of the index's ``step_minutes``)."""

    minute: int  # unix time of the minute's start
    host: str
    job: str
    role: str
    rank: int
    pid: int
    steps: int
    sum_s: float
    p50_ms: float | None
    p90_ms: float | None
    max_ms: float | None
    regions: dict[str, float]  # seconds inside each region in this minute


class Figures(NamedTuple):
    """A rank's step times over ``top``'s window (made for every rank at each ``top``: a
    tuple, a fifth of a frozen dataclass's cost to make)."""

    p50_ms: float | None
    p99_ms: float | None
    window_s: float | None
    source: str | None  # "ledger", "index", "rate" or None
    regions: dict[str, float]  # share of the step time
    wait_ms: float | None = None  # collective wait per step; None: unknown


@dataclass
class _Minute:
    """The minute being accumulated."""

    start: int
    steps: int = 0
    sum_s: float = 0.0
    # Each interval's p50 and p90 and the steps they cover, in arrays rather than lists of
    # pairs: a minute of them per rank is numbers the garbage collector need not walk.
    p50s: array[float] = field(default_factory=lambda: array("d"))
    p90s: array[float] = field(default_factory=lambda: array("d"))
    weights: array[float] = field(default_factory=lambda: array("d"))
    max_s: float = 0.0
    regions: dict[str, float] = field(default_factory=dict)


class Ledger:
    """One rank's step times. Only :class:`Ledgers` changes it."""

    __slots__ = (
        "buckets",
        "epoch",
        "head",
        "held",
        "identity",
        "last_step",
        "limited",
        "minute",
        "minutes",
        "names",
        "nmin",
        "region_total",
        "ring",
        "size",
        "steps_total",
        "sum_total",
        "timed",
        "tokens",
        "tokens_at",
        "wait_held",
        "window_base",
        "window_cum",
        "window_p50",
        "window_p99",
        "window_regions",
        "window_wait_n",
        "window_wait_s",
    )

    def __init__(self, identity: _Identity, step: int, now_unix: float) -> None:
        self.identity = identity
        self.ring = array("d", bytes(8 * _W * FULL))
        self.head = 0  # the slot the next interval goes to
        self.size = 0
        self.minutes = array("d", bytes(8 * _MW * MINUTES))
        self.nmin = 0  # closed minutes held (at most MINUTES), newest at (nmin - 1) % MINUTES
        self.minute = _Minute(_minute_of(now_unix))
        self.buckets = [0] * _NBUCKETS  # since attach, for the histogram
        self.sum_total = 0.0
        self.steps_total = 0
        self.region_total: dict[str, float] = {}
        #: The intervals of the last :data:`TOP_WINDOW_S` (as of the last heartbeat), newest
        #: last, for ``top``. A window's sums are the newest totals
        #: less those before its first interval, and its intervals' p50s and p99s are kept
        #: sorted as they come and go: ``top`` reads 1,024 ranks at once, and going over
        #: each one's minute of intervals again cost it ~80 ms.
        self.window_regions: deque[_Window] = deque()
        self.window_cum = 0.0  # step seconds of every interval so far
        #: Collective wait (seconds) and the steps it covers, of every interval so far.
        self.window_wait_s = 0.0
        self.window_wait_n = 0
        #: Wait that came with a ledger of no steps: it goes with the rank's next interval.
        self.wait_held = (0.0, 0)
        #: The entry before the oldest interval held (the last one dropped).
        self.window_base = _NO_WINDOW
        # Sorted arrays, not lists: numbers the garbage collector need not walk.
        self.window_p50: array[float] = array("d")
        self.window_p99: array[float] = array("d")
        self.last_step = step
        self.epoch: int | None = None
        self.timed = False  # a ledger arrived: its figures are the client's own
        #: The region names this rank may keep (at most ``max_regions``), taken as they come.
        self.names: set[str] = set()
        #: The heartbeat rate's token bucket: tokens left as of monotonic ``tokens_at``.
        self.tokens = 0.0
        self.tokens_at: float | None = None
        #: Ledgers over the rate not yet applied.
        self.held: _Held | None = None
        self.limited = 0  # the bounds it ran into (_FOLDED, _COALESCED), each logged once


class _Identity(NamedTuple):
    """Who a rank's ledger was opened for: another identity on its key is another ledger."""

    host: str
    job: str
    role: str
    rank: int
    pid: int


class _Window(msgspec.Struct, frozen=True, gc=False):
    """An interval of ``top``'s window, with the rank's running totals as of its end.

    A window's sums are the newest totals less those of the entry before its first interval.
    Outside the cyclic collector (``gc=False``): a minute of them per rank is most of what
    the daemon keeps at 1,024 ranks (63,000 objects), and as tracked tuples each full pass of
    the collector walked them all, ~30 ms on the loop every 20-30 s (the ``ps`` round trip's
    p99). They cannot be part of a cycle: floats, ints and a dict of str to float.
    """

    end: float  # monotonic
    cum_s: float  # step seconds of every interval so far
    regions: dict[str, float]  # region seconds since the rank attached (never changed)
    p50: float
    p99: float
    steps: int  # steps since the rank attached
    wait_s: float  # collective wait (seconds) so far
    wait_n: int  # the steps it covers


_NO_WINDOW = _Window(0.0, 0.0, {}, 0.0, 0.0, 0, 0.0, 0)
_NO_WAIT = (0.0, 0)


class _Held(NamedTuple):
    """Ledgers over the heartbeat rate not yet applied, merged into one."""

    ledger: P.Ledger
    regions: dict[str, float]  # folded (see ``Ledgers._fold``)


_FOLDED, _COALESCED = 1, 2


def _nth_without(values: array[float], i: int, gone: list[float]) -> float:
    """The ``i``-th of sorted ``values`` once ``gone`` (some of them) are taken out."""
    if not gone:
        return values[i]
    if len(gone) == 1:  # the usual stale head: one heartbeat just out of the window
        return values[i] if i < bisect_left(values, gone[0]) else values[i + 1]
    rest = values[:]
    for v in gone:
        del rest[bisect_left(rest, v)]
    return rest[i]


def _newest(led: Ledger, k: int, col: int) -> list[float]:
    """Field ``col`` of the ring's newest ``k`` intervals, sorted (slices, not a loop)."""
    return sorted(_column(led, k, col))


def _column(led: Ledger, k: int, col: int) -> array[float]:
    """Field ``col`` of the ring's newest ``k`` intervals, oldest first."""
    ring, head = led.ring, led.head
    first = head - k
    if first >= 0:
        return ring[first * _W + col : head * _W : _W]
    first += FULL  # the window wraps around the ring's end
    return ring[first * _W + col :: _W] + ring[col : head * _W : _W]


#: Intervals of ``top``'s window that may end before a detector's window starts for it to
#: be read from ``top``'s window; more (a shorter ``[watch] window``): from the ring.
_FEW_STALE = 4


def _median_after(led: Ledger, t: float) -> float:
    """The median p50 (seconds) of the ring's intervals that ended after ``t``."""
    return median(_column(led, _count_after(led, t), _P50))


def _count_after(led: Ledger, t: float) -> int:
    """How many of the ring's newest intervals ended after monotonic ``t``: a binary search,
    as their end times rise from the oldest held to the newest."""
    ring, head = led.ring, led.head
    lo, hi = 0, led.size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ring[((head - mid) % FULL) * _W] > t:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _merge(older: _Held, newer: _Held) -> _Held:
    """Two ledgers of one rank as one, as if its client had sent them together: counts,
    sums and histograms add up, the max is the max, and p50/p90/p99 are the means of the
    two weighted by their steps (the steps themselves are not here to take them from)."""
    (a, ra), (b, rb) = older, newer
    na, nb = a.n, b.n
    n = na + nb
    qa, qb = a.q, b.q
    q = [((x * na + y * nb) / n if n else max(x, y)) for x, y in zip(qa[:3], qb[:3], strict=True)]
    q.append(max(qa[3], qb[3]))
    regions = dict(ra)
    for name, sec in rb.items():
        regions[name] = regions.get(name, 0.0) + sec
    waits = [w for w in (a.wait, b.wait) if w is not None]
    merged = P.Ledger(
        at=b.at,
        n=n,
        sum=a.sum + b.sum,
        q=q,
        b=[x + y for x, y in zip(a.b, b.b, strict=True)],
        epoch=b.epoch,
        # Each wait says how many steps it covers: together they cover the sum.
        wait=(sum(w[0] for w in waits), sum(w[1] for w in waits)) if waits else None,
    )
    return _Held(merged, regions)


def _wait_ms(seconds: float, steps: int) -> float | None:
    """Collective wait per step (ms); None where no wait covers a step."""
    return seconds / steps * 1000.0 if steps > 0 else None


def _minute_of(unix: float) -> int:
    return int(unix // 60) * 60


class Ledgers:
    """The ledger of every attached rank, keyed like the registry (host, pid)."""

    def __init__(
        self,
        clock: Any = time.time,
        seed: SeedLookup | None = None,
        max_regions: int = MAX_REGIONS,
        rate: float = MAX_RATE,
    ) -> None:
        self.by_key: dict[tuple[str, int], Ledger] = {}
        self.max_regions = max_regions
        self.rate = rate
        #: A rank may send this many heartbeats at once before the rate applies.
        self.burst = max(2.0, rate)
        #: Region entries of ledgers counted as :data:`OTHER_REGION`, since the start.
        self.regions_folded = 0
        #: Ledgers coalesced into a later one for the heartbeat rate, since the start.
        self.coalesced = 0
        self._pending: list[MinuteSummary] = []
        self._unix = clock
        self._seed = seed
        #: (host, pid, job, role, rank) -> what ``seed`` found, looked up once per rank.
        self._seeded: dict[tuple[str, int, str, str, int], tuple[int, float] | None] = {}

    def __len__(self) -> int:
        return len(self.by_key)

    # --- transitions ---------------------------------------------------------------------
    def heartbeat(self, c: Client, step: int | None, ledger: P.Ledger | None, now: float) -> None:
        """A heartbeat from ``c`` at monotonic ``now``: its step and, from protocol 3, its
        ledger (validated by the protocol: every number within its bounds)."""
        led = self._own(c, now)
        if ledger is None:
            if step is not None:
                if step > led.last_step:
                    led.steps_total += step - led.last_step
                led.last_step = step
            return
        regions = self._fold(led, ledger.r)
        if not self._admit(led, now):
            held = led.held
            mine = _Held(ledger, regions)
            led.held = mine if held is None else _merge(held, mine)
            self.coalesced += 1
            self._warn(led, _COALESCED, f"sends more than {self.rate:g} heartbeats a second")
            return
        if led.held is not None:
            ledger, regions = _merge(led.held, _Held(ledger, regions))
            led.held = None
        self._apply(led, ledger, regions, now)

    def _apply(self, led: Ledger, ledger: P.Ledger, regions: dict[str, float], now: float) -> None:
        # A new epoch: the process set its step count (or began timing after its untimed
        # first step). The client times only the steps after the jump, so the ledger counts
        # as it is; the steps jumped over are not steps it ran.
        led.epoch = ledger.epoch
        led.last_step = ledger.at
        n = ledger.n
        led.steps_total += n
        m = led.minute
        unix = self._unix()
        if _minute_of(unix) != m.start:
            self._close(led, unix)
            m = led.minute
        # Region time counts also in a heartbeat no step ended in (steps longer than the
        # heartbeat interval): the step that ends later carries the rest of its time.
        for name, sec in regions.items():
            led.region_total[name] = led.region_total.get(name, 0.0) + sec
            m.regions[name] = m.regions.get(name, 0.0) + sec
        if ledger.wait is not None:
            ws, wn = led.wait_held
            led.wait_held = (ws + ledger.wait[0], wn + ledger.wait[1])
        if n <= 0:
            return
        led.timed = True
        total = ledger.sum
        b = ledger.b
        led.buckets = list(map(add, led.buckets, b))  # C's loop, not Python's: every heartbeat
        # The histogram's sum covers the steps its buckets count (a sample above the ring).
        counted = sum(b)
        led.sum_total += total if counted >= n else total * counted / n
        p50, p90, p99, top = ledger.q  # the protocol's order (exactly 4, validated)
        self._interval(led, now, n, total, p50, p90, p99, top)
        m.steps += n
        m.sum_s += total
        m.p50s.append(p50)
        m.p90s.append(p90)
        m.weights.append(n)
        m.max_s = max(m.max_s, top)

    def _interval(
        self,
        led: Ledger,
        now: float,
        n: int,
        total: float,
        p50: float,
        p90: float,
        p99: float,
        top: float,
    ) -> None:
        base = led.head * _W
        wait_s, wait_n = led.wait_held
        led.wait_held = _NO_WAIT
        # In _Interval's order, as a plain tuple: building the named one cost each heartbeat
        # about a tenth more CPU, for a value that only goes into the array.
        led.ring[base : base + _W] = array("d", (now, n, total, p50, p90, p99, top, wait_s, wait_n))
        led.head = (led.head + 1) % FULL
        led.size = min(led.size + 1, FULL)
        wr = led.window_regions
        led.window_cum += total
        # ``region_total`` already holds this interval's regions (the caller added them). The
        # copies are never changed, so an interval without new region time shares the one
        # before (most heartbeats of a process without regions: one comparison of {}).
        before = (wr[-1] if wr else led.window_base).regions
        totals = before if before == led.region_total else dict(led.region_total)
        p50, p99 = float(p50), float(p99)
        if wait_n:
            led.window_wait_s += wait_s
            led.window_wait_n += wait_n
        wr.append(
            _Window(
                now,
                led.window_cum,
                totals,
                p50,
                p99,
                led.steps_total,
                led.window_wait_s,
                led.window_wait_n,
            )
        )
        p50s, p99s = led.window_p50, led.window_p99
        insort(p50s, p50)
        insort(p99s, p99)
        while wr[0].end < now - TOP_WINDOW_S:
            gone = led.window_base = wr.popleft()
            del p50s[bisect_left(p50s, gone.p50)]
            del p99s[bisect_left(p99s, gone.p99)]

    def _own(self, c: Client, now: float) -> Ledger:
        # A plain tuple to compare with (equal to the named one): every heartbeat asks.
        ident = (c.host, c.job, c.role, c.rank, c.pid)
        led = self.by_key.get(c.key)
        if led is not None and led.identity == ident:
            return led
        new = self.by_key[c.key] = Ledger(_Identity(*ident), c.step, self._unix())
        if led is not None:
            # Re-registered as someone else (a new rank): its old rank's minute ends here,
            # with what it held back. The rate is the process's, whoever it says it is now.
            self._release(led, now)
            self._close(led, self._unix(), reopen=False)
            new.tokens, new.tokens_at = led.tokens, led.tokens_at
        return new

    def _fold(self, led: Ledger, entries: Iterable[tuple[str, float, int]]) -> dict[str, float]:
        """A ledger's region times by name, a name the rank may not keep more counted as
        :data:`OTHER_REGION`: the first ``max_regions`` names it sends are the ones kept."""
        out: dict[str, float] = {}
        names = led.names
        for name, sec, _ in entries:
            if name not in names:
                if len(names) < self.max_regions:
                    names.add(name)
                else:
                    name = OTHER_REGION
                    self.regions_folded += 1
                    self._warn(led, _FOLDED, f"has more than {self.max_regions} region names")
            out[name] = out.get(name, 0.0) + float(sec)
        return out

    def _admit(self, led: Ledger, now: float) -> bool:
        """Whether a ledger arriving at ``now`` may be an interval of its own (a token
        bucket of :attr:`burst` tokens, refilled at :attr:`rate` a second)."""
        if led.tokens_at is None:
            led.tokens = self.burst
        else:
            led.tokens = min(self.burst, led.tokens + (now - led.tokens_at) * self.rate)
        led.tokens_at = now
        if led.tokens < 1.0:
            return False
        led.tokens -= 1.0
        return True

    def _release(self, led: Ledger, now: float) -> None:
        """Apply what ``led`` held back over the rate, as an interval ending at ``now``."""
        if led.held is not None:
            ledger, regions = led.held
            led.held = None
            self._apply(led, ledger, regions, max(now, led.tokens_at or now))

    def _warn(self, led: Ledger, bound: int, what: str) -> None:
        if not led.limited & bound:
            led.limited |= bound
            host, job, role, rank, pid = led.identity
            log.warning(
                "%s pid %s (job %s %s rank %s) %s: %s",
                host[:64],
                pid,
                job[:64],
                role[:64],
                rank,
                what,
                "the rest counts as region (other)"
                if bound == _FOLDED
                else "the rest are coalesced into later ones",
            )

    def _close(self, led: Ledger, unix: float, reopen: bool = True) -> None:
        """End the rank's current minute: keep it in memory and queue it for the index."""
        m = led.minute
        if m.steps > 0:
            p50 = weighted_quantile(zip(m.p50s, m.weights, strict=True), 0.5)
            p90 = weighted_quantile(zip(m.p90s, m.weights, strict=True), 0.9)
            host, job, role, rank, pid = led.identity
            self._pending.append(
                MinuteSummary(
                    minute=m.start,
                    host=host,
                    job=job,
                    role=role,
                    rank=rank,
                    pid=pid,
                    steps=m.steps,
                    sum_s=m.sum_s,
                    p50_ms=None if p50 is None else p50 * 1000.0,
                    p90_ms=None if p90 is None else p90 * 1000.0,
                    max_ms=m.max_s * 1000.0,
                    regions=m.regions,
                )
            )
            base = (led.nmin % MINUTES) * _MW
            row = KeptMinute(m.start, m.steps, m.sum_s, p50 or math.nan, p90 or math.nan, m.max_s)
            led.minutes[base : base + _MW] = array("d", row)
            led.nmin += 1
        if reopen:
            led.minute = _Minute(_minute_of(unix))

    def tick(self, clients: Iterable[Client], now: float | None = None) -> None:
        """Once a tick (monotonic ``now``): apply ledgers held back over the heartbeat rate,
        close minutes that ended, forget ranks that left (their last minute is queued for
        the index first)."""
        unix = self._unix()
        minute = _minute_of(unix)
        mono = time.monotonic() if now is None else now
        live = {c.key: c for c in clients}
        for key, led in list(self.by_key.items()):
            self._release(led, mono)
            c = live.get(key)
            if c is None:
                self._close(led, unix, reopen=False)  # gone from the registry
                del self.by_key[key]
            elif led.minute.start != minute:
                self._close(led, unix)
        if self._seeded:
            for k in [k for k in self._seeded if (k[0], k[1]) not in live]:
                del self._seeded[k]

    def take_minutes(self) -> list[MinuteSummary]:
        """The closed minutes not yet written to the index (the loop writes them)."""
        out, self._pending = self._pending, []
        return out

    # --- reads -----------------------------------------------------------------------------
    def figures(self, c: Client, now: float) -> Figures:
        """``c``'s step times over the last :data:`TOP_WINDOW_S` seconds (monotonic ``now``)."""
        led = self.by_key.get(c.key)
        if led is None or not led.timed:
            seeded = self._from_index(c)
            if seeded is not None:
                return seeded
            if c.sps > 0:
                return Figures(1000.0 / c.sps, None, None, "rate", {})
            return Figures(None, None, None, None, {})
        since = now - TOP_WINDOW_S
        # The window's intervals are the ring's newest: as many as the heartbeats kept in
        # ``window_regions``, less those older than ``since`` (a rank silent since its last
        # one; none or one mostly). Sorted lists and running totals kept as heartbeats come,
        # no loop over intervals: ``top`` reads every rank at once.
        wr = led.window_regions
        stale = 0
        for e in wr:
            if e.end >= since:
                break
            stale += 1
        k = min(len(wr) - stale, led.size)
        if k <= 0:
            return Figures(None, None, None, "ledger", {})
        oldest = wr[len(wr) - k].end
        # The median of the intervals' medians: each heartbeat's summary is the client's
        # own over its steps; exact for steady steps, cheap for 1,024 ranks a second.
        i50, i99 = k // 2, min(k - 1, int(k * 0.99))
        if k == len(wr) - stale:
            # The window is all of ``window_regions`` but its stale head: sorted already.
            gone = [wr[j] for j in range(stale)]
            p50 = _nth_without(led.window_p50, i50, [e.p50 for e in gone])
            p99 = _nth_without(led.window_p99, i99, [e.p99 for e in gone])
        else:  # more heartbeats in the minute than the ring holds: its newest k
            p50, p99 = _newest(led, k, _P50)[i50], _newest(led, k, _P99)[i99]
        j = len(wr) - k
        before = wr[j - 1] if j else led.window_base
        total, regions0 = led.window_cum - before.cum_s, before.regions
        shares: dict[str, float] = {}
        if total > 0:
            inv = 1.0 / total
            get = regions0.get
            # At most 1: regions that overlap or span steps can add up to more than the steps.
            # Rounding below 1e-9 s is no time spent in a region (one not entered lately).
            for n, v in led.region_total.items():
                d = v - get(n, 0.0)
                if d > 1e-9:
                    share = round(d * inv, 4)
                    shares[n] = share if share < 1.0 else 1.0
        wait_ms = _wait_ms(led.window_wait_s - before.wait_s, led.window_wait_n - before.wait_n)
        return Figures(
            p50 * 1000.0, p99 * 1000.0, max(0.0, now - oldest), "ledger", shares, wait_ms
        )

    def _from_index(self, c: Client) -> Figures | None:
        """``c``'s last minute in the index, if recent enough (see :data:`SEED_MAX_AGE_S`)."""
        if self._seed is None:
            return None
        key = (c.host, c.pid, c.job, c.role, c.rank)
        if key in self._seeded:
            found = self._seeded[key]
        else:
            since = self._unix() - SEED_MAX_AGE_S - 60.0
            found = self._seeded[key] = self._seed(c.job, c.role, c.rank, since)
        if found is None:
            return None
        minute, p50_ms = found
        if self._unix() - (minute + 60) > SEED_MAX_AGE_S:
            return None
        return Figures(p50_ms, None, 60.0, "index", {})

    # --- the detectors' read (profd.daemon.watch), once a tick for every rank ----------------
    def watch(self, c: Client, since: float, window_from: float, q: float) -> TickRank:
        """What the detectors need of rank ``c``, in one call (they ask it of every rank each
        tick), all times monotonic:

        - the median of the p50s (ms) of its intervals that ended after ``since`` (the last
          tick) and the steps they cover;
        - its ledger's epoch (None: no ledger yet);
        - the ``q`` quantile (ms) of the p50s of its intervals that ended after
          ``window_from`` and the steps they cover.

        (None, 0, ...) where it has no such intervals. A window that starts
        :data:`TOP_WINDOW_S` before now (the default ``[watch] window``) is read from the
        sorted p50s and running totals ``top`` keeps, in constant time; any other from the
        ring.
        """
        led = self.by_key.get(c.key)
        if led is None or not led.timed:
            epoch = None if led is None else led.epoch
            return TickRank(c.host, c.pid, c.role, c.rank, c.step, epoch=epoch)
        ring = led.ring
        i = led.head
        tick_ms: float | None = None
        tick_n = intervals = 0
        top = 0.0
        for _ in range(led.size):  # mostly one interval a tick: a short walk back
            i = i - 1 if i else FULL - 1
            b = i * _W
            if ring[b] <= since:
                break
            tick_ms = ring[b + _P50]
            tick_n += int(ring[b + _N])
            if ring[b + _MAX] > top:
                top = ring[b + _MAX]
            intervals += 1
        if intervals > 1:  # several heartbeats in one tick: their median
            tick_ms = _median_after(led, since)
        wq, wn, wait_ms, wait_n = self._window(led, window_from, q)
        return TickRank(
            c.host,
            c.pid,
            c.role,
            c.rank,
            c.step,
            None if tick_ms is None else tick_ms * 1000.0,
            tick_n,
            led.epoch,
            wq,
            wn,
            top * 1000.0,
            wait_ms,
            wait_n,
        )

    def median_ms(self, key: tuple[str, int], window_from: float) -> tuple[float | None, int]:
        """The median (ms) of one rank's interval p50s that ended after monotonic
        ``window_from``, and the steps they cover ((None, 0): none)."""
        led = self.by_key.get(key)
        if led is None or not led.timed:
            return None, 0
        return self._window(led, window_from, 0.5)[:2]

    def _window(
        self, led: Ledger, t: float, q: float
    ) -> tuple[float | None, int, float | None, int]:
        """The ``q`` quantile (ms) of the p50s of ``led``'s intervals that ended after ``t``
        and the steps they cover; their collective wait per step (ms) and the steps it
        covers."""
        wr = led.window_regions
        # ``top``'s window holds every interval that ended after ``t`` when ``t`` is at most
        # :data:`TOP_WINDOW_S` before the newest (older ones are all it drops); read from it
        # when only a few of its oldest ended before ``t`` (the default window: none or one).
        if wr and t >= wr[-1].end - TOP_WINDOW_S:
            stale = 0
            for e in wr:
                if e.end > t:
                    break
                stale += 1
                if stale > _FEW_STALE:
                    break
            if stale <= _FEW_STALE:
                k = len(wr) - stale
                if k <= 0:
                    return None, 0, None, 0
                gone = [wr[j].p50 for j in range(stale)]
                p50 = _nth_without(led.window_p50, min(k - 1, int(q * k)), gone)
                base = wr[stale - 1] if stale else led.window_base
                wait_n = led.window_wait_n - base.wait_n
                return (
                    p50 * 1000.0,
                    led.steps_total - base.steps,
                    _wait_ms(led.window_wait_s - base.wait_s, wait_n),
                    wait_n,
                )
        k = _count_after(led, t)
        if k <= 0:
            return None, 0, None, 0
        p50s = _newest(led, k, _P50)
        wait_n = int(sum(_column(led, k, _WN)))
        return (
            p50s[min(k - 1, int(q * k))] * 1000.0,
            int(sum(_column(led, k, _N))),
            _wait_ms(sum(_column(led, k, _WS)), wait_n),
            wait_n,
        )

    def recent_minutes(self, c: Client) -> list[KeptMinute]:
        """``c``'s closed minutes in memory, oldest first."""
        led = self.by_key.get(c.key)
        if led is None:
            return []
        out = []
        count = min(led.nmin, MINUTES)
        for j in range(led.nmin - count, led.nmin):
            base = (j % MINUTES) * _MW
            start, steps, sum_s, p50, p90, max_s = led.minutes[base : base + _MW]
            out.append(KeptMinute(int(start), int(steps), sum_s, p50, p90, max_s))
        return out

    def series(self, clients: Iterable[Client]) -> tuple[RankSeries, ...]:
        """Every attached rank's counters, for ``/metrics``."""
        out = []
        for c in clients:
            led = self.by_key.get(c.key)
            if led is None:
                out.append(RankSeries(c.host, c.job, c.role, c.rank, (), 0.0, 0))
                continue
            out.append(
                RankSeries(
                    c.host,
                    c.job,
                    c.role,
                    c.rank,
                    tuple(led.buckets) if led.timed else (),
                    led.sum_total,
                    led.steps_total,
                    tuple(led.region_total.items()),
                )
            )
        return tuple(out)
