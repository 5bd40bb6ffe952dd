"""When a writer seals a day of an hourly table, and what stands for a sealed day's rows.

A writer's hourly objects of a date are replaced by one day object once the day has been
closed ``seal_after`` seconds (rows of its last minutes are indexed just after midnight, and
each row that comes after the seal costs a rewrite of the whole day object). The day object
then takes every later change of that day. The hourly objects it supersedes are deleted
``sweep_after`` seconds after the seal: a reader that listed them before the seal has that
long to read them. :class:`Merging` says when a closed date is merged across writers into
fleet objects (the merge itself: :mod:`profd.warehouse.merge`). No pyarrow here: the daemon
uses it for its overlays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from profd.warehouse.tables import HOURLY, cutoff_date

#: Days older than this are never sealed: the index may no longer hold every row of them
#: (it keeps step minutes 7 days), and a day object built from part of a day would supersede
#: hourly objects that hold all of it.
SEAL_WITHIN_DAYS = 3


@dataclass(frozen=True)
class Seals:
    seal_after: float = 3600.0
    sweep_after: float = 3600.0

    def sealable(self, date: str, now: float) -> bool:
        """``date``'s day objects may be written now (each table's once, then kept)."""
        return cutoff_date(now, SEAL_WITHIN_DAYS) <= date < cutoff_date(now - self.seal_after, 0)


def due(
    unsealed: Iterable[tuple[str, str]],
    seals: Seals,
    now: float,
    expired: Callable[[str, str], bool],
) -> list[tuple[str, str]]:
    """The (table, date) among ``unsealed`` (oldest first) that are to be sealed now: closed
    long enough, inside the horizon, not past their retention."""
    return [(t, d) for t, d in unsealed if seals.sealable(d, now) and not expired(t, d)]


def overlay_part(
    table: str, part: str, sealed: set[tuple[str, str]], seals: Seals, now: float
) -> str:
    """The partition a node's unflushed rows of ``part`` are sent as. A day of an hourly
    table that is ``sealed``, or that the next flush will seal, goes whole: the reader puts
    its rows in place of the writer's day object and its hourly objects of that date, however
    far the seal has got. Anything else as it is: a reader that finds the writer's day object
    beside such an hour asks again (the seal landed in between; profd/warehouse/reader.py)."""
    date = part[:10]
    if table in HOURLY and "/" in part and ((table, date) in sealed or seals.sealable(date, now)):
        return date
    return part


#: The most a writer waits, once fleet objects hold its object, before it deletes it (a reader
#: that listed the object just before has that long to read it; queries take seconds).
#: Every object still there is one more a query over today opens: docs/benchmarks.md.
MERGE_GRACE_S = 600.0


@dataclass(frozen=True)
class Merging:
    """When: a writer's hourly object may be merged ``merge_after`` seconds after its hour
    ends, a day object ``merge_after`` seconds after its date ends; a writer deletes its
    own object ``grace`` seconds after a fleet object holding it appeared."""

    merge_after: float = 1800.0
    grace: float = MERGE_GRACE_S

    @classmethod
    def of(cls, merge_after: float, sweep_after: float) -> Merging:
        """``[warehouse]``'s merging: the grace as the seal's sweep, at most
        :data:`MERGE_GRACE_S`."""
        return cls(merge_after, min(sweep_after, MERGE_GRACE_S))

    def cutoff(self, now: float) -> str:
        """Dates before this one (``YYYY-MM-DD``) may have their day objects merged at
        ``now``."""
        return datetime.fromtimestamp(now - self.merge_after, UTC).strftime("%Y-%m-%d")

    def due_at(self, date: str, hour: int | None = None) -> float:
        """When a writer's object of ``date`` (of its ``hour``; None: its day object) may
        be merged."""
        start = datetime.strptime(date, "%Y-%m-%d").replace(tzinfo=UTC)
        end = start + (timedelta(days=1) if hour is None else timedelta(hours=hour + 1))
        return end.timestamp() + self.merge_after

    def mergers(self, due: float, now: float) -> int:
        """How many of a date's writers (by stem) may merge at ``now`` an object that was
        ``due`` to be merged: none before, the first at once, one more each hour nobody has
        (a dead first writer stops nothing for long)."""
        late = now - due
        return 0 if late < 0 else 1 + int(late // 3600.0)
