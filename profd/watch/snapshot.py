"""What the event loop publishes once a tick for readers on other threads (``/metrics``).

Immutable: the loop builds a new one and swaps one reference, so a scrape never touches the
loop's state and never waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankSeries:
    """One attached rank's counters since it attached."""

    host: str
    job: str
    role: str
    rank: int
    #: Steps per ``protocol.STEP_BUCKETS`` bucket, plus one for steps above the last bound
    #: (not cumulative); empty for a client that sends no ledger (protocol 2).
    buckets: tuple[int, ...]
    #: Seconds of the steps counted in ``buckets``.
    sum_s: float
    #: Steps completed since it attached (every client, ledger or not).
    steps: int
    #: Seconds inside each region since it attached: ``((name, seconds), ...)``.
    regions: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """The daemon at one tick."""

    at: float  # unix time
    ranks: tuple[RankSeries, ...] = ()
    attached: int = 0
    sessions: tuple[tuple[str, int], ...] = ()  # (state, count) of live sessions
    incidents: tuple[tuple[str, int], ...] = ()  # (kind, total since start)
    upload_queue_bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)
