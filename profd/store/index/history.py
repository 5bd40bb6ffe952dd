"""Step history: every rank's step times per minute (``step_minutes``, written by the event
loop's ``StepHistory``, kept ``keep_history``), and the per-minute statistics read from them."""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from profd.store.index.db import Repo, in_range
from profd.watch.stats import sorted_median, weighted_quantile

#: Rank-minutes one ``history`` request reads at most (about 4 hours of 1,024 ranks, a month
#: of 8; some 0.4 s): a longer range is answered for its newest minutes.
HISTORY_MAX_ROWS = 250_000


class StepMinuteRepo(Repo):
    def add_step_minutes(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Closed minutes of ranks (the ledger's ``MinuteSummary`` fields), in one
        transaction: 1,024 ranks' minute is one commit, not 1,024."""
        with self.transaction():
            self.conn.executemany(
                "INSERT INTO step_minutes (job, host, role, rank, pid, minute, steps, sum_s,"
                " p50_ms, p90_ms, max_ms, regions) VALUES (:job, :host, :role, :rank, :pid,"
                " :minute, :steps, :sum_s, :p50_ms, :p90_ms, :max_ms, :regions)",
                ({**r, "regions": json.dumps(r.get("regions") or {})} for r in rows),
            )

    def step_history(
        self, job: str, since: float, until: float, max_rows: int = HISTORY_MAX_ROWS
    ) -> tuple[list[dict[str, Any]], float]:
        """``job``'s minutes that overlap ``[since, until)``, one row per minute and role
        (``HISTORY_ROW``), oldest first; and the ``since`` they cover: later than asked when
        the range holds more than ``max_rows`` rank-minutes (the newest are kept, whole
        minutes only), so one request never holds the loop for long."""
        cur = self.conn.cursor()
        cur.row_factory = None
        # Newest first, the (job, minute) index's own order read backwards: no sort.
        cur.execute(
            "SELECT minute, role, host, rank, steps, p50_ms, p90_ms, max_ms FROM step_minutes"
            " WHERE job = ? AND minute > ? AND minute < ? ORDER BY minute DESC LIMIT ?",
            (job, since - 60.0, until, max_rows + 1),
        )
        rows = list(map(MinuteRow._make, cur.fetchall()))
        if len(rows) > max_rows:
            cut = rows[-1].minute  # the oldest minute read may be cut short: none of it
            rows = [r for r in rows if r.minute != cut]
            since = float(cut + 60)
        return history_rows(rows), since

    def last_step_minute(
        self, job: str, role: str, rank: int, since: float
    ) -> tuple[int, float] | None:
        """The newest minute of ``job``'s ``role`` rank ``rank`` that starts at ``since`` or
        later and has a p50: (minute start, p50 ms)."""
        r = self.conn.execute(
            "SELECT minute, p50_ms FROM step_minutes WHERE job = ? AND minute >= ?"
            " AND role = ? AND rank = ? AND p50_ms IS NOT NULL ORDER BY minute DESC LIMIT 1",
            (job, int(since), role, rank),
        ).fetchone()
        return None if r is None else (int(r["minute"]), float(r["p50_ms"]))

    def prune_step_minutes(self, before: float, chunk: int = 20_000) -> int:
        """Forget minutes that start before ``before``; how many. In chunks, each its own
        transaction, so a week of a large job goes without one long write lock."""
        n = 0
        while True:
            k = self.conn.execute(
                "DELETE FROM step_minutes WHERE rowid IN"
                " (SELECT rowid FROM step_minutes WHERE minute < ? LIMIT ?)",
                (before, chunk),
            ).rowcount
            n += k
            if k < chunk:
                return n

    def minute_rows(self, since: float, until: float, job: str | None = None) -> list[StoredMinute]:
        """Step minutes starting in ``[since, until)``, as the index holds them (a rank that
        re-attached within a minute has a row for each process)."""
        sql = (
            "SELECT job, host, role, rank, minute, steps, p50_ms, p90_ms, max_ms, regions"
            " FROM step_minutes WHERE minute >= ? AND minute < ?"
        )
        sql, args = in_range(sql, since, until, job)
        cur = self.conn.cursor()
        cur.row_factory = None
        return list(map(StoredMinute._make, cur.execute(sql, args).fetchall()))


class StoredMinute(NamedTuple):
    """One ``step_minutes`` row, column by column."""

    job: str
    host: str
    role: str
    rank: int
    minute: int
    steps: int
    p50_ms: float | None
    p90_ms: float | None
    max_ms: float | None
    regions: str  # JSON: name -> seconds


class MinuteRow(NamedTuple):
    """One rank's minute as ``step_history`` reads it."""

    minute: int
    role: str
    host: str
    rank: int
    steps: int
    p50_ms: float | None
    p90_ms: float | None
    max_ms: float | None


def history_rows(rows: Iterable[MinuteRow]) -> list[dict[str, Any]]:
    """Rank-minutes as ``HISTORY_ROW`` dicts, oldest first: per minute and role the ranks
    that stepped, their steps, the median over ranks of each rank's p50 (and p90), the
    longest step and the 3 ranks with the highest p50. A rank with two rows in one minute
    (it re-attached) counts once: its steps summed, its quantiles combined weighted by
    steps."""
    groups: dict[tuple[int, str], list[MinuteRow]] = {}
    for r in rows:
        key = (r.minute, r.role)
        g = groups.get(key)
        if g is None:
            groups[key] = [r]
        else:
            g.append(r)
    return [
        _minute_of_role(minute, role, groups[(minute, role)]) for minute, role in sorted(groups)
    ]


def _minute_of_role(minute: int, role: str, members: list[MinuteRow]) -> dict[str, Any]:
    if len({(r.host, r.rank) for r in members}) < len(members):
        members = _one_per_rank(members)
    p50s = sorted(r.p50_ms for r in members if r.p50_ms is not None)
    p90s = sorted(r.p90_ms for r in members if r.p90_ms is not None)
    maxes = [r.max_ms for r in members if r.max_ms is not None]
    slow = heapq.nsmallest(
        3,
        (r for r in members if r.p50_ms is not None),
        key=lambda r: (-(r.p50_ms or 0.0), r.host, r.rank),  # (never None: filtered)
    )
    return {
        "minute": int(minute),
        "role": role,
        "ranks": len(members),
        "steps": sum(r.steps for r in members),
        "p50_ms": _ms(sorted_median(p50s)) if p50s else None,
        "p90_ms": _ms(sorted_median(p90s)) if p90s else None,
        "max_ms": _ms(max(maxes)) if maxes else None,
        "slowest": [
            {"host": r.host, "role": role, "rank": r.rank, "p50_ms": _ms(r.p50_ms)} for r in slow
        ],
    }


def _one_per_rank(members: list[MinuteRow]) -> list[MinuteRow]:
    by_rank: dict[tuple[str, int], list[MinuteRow]] = {}
    for r in members:
        by_rank.setdefault((r.host, r.rank), []).append(r)
    return [p[0] if len(p) == 1 else p[0]._replace(**merged_figures(p)) for p in by_rank.values()]


class RankFigures(Protocol):
    """A rank's minute as one process's row has it (:class:`MinuteRow`, a ``StoredMinute``)."""

    @property
    def steps(self) -> int: ...
    @property
    def p50_ms(self) -> float | None: ...
    @property
    def p90_ms(self) -> float | None: ...
    @property
    def max_ms(self) -> float | None: ...


def merged_figures(parts: Sequence[RankFigures]) -> dict[str, Any]:
    """One rank's minute from the rows of its processes (a rank that re-attached within the
    minute has one for each): steps summed, p50 and p90 weighted by steps, the longest step;
    as ``_replace`` keywords."""
    maxes = [p.max_ms for p in parts if p.max_ms is not None]
    return {
        "steps": sum(p.steps for p in parts),
        "p50_ms": weighted_quantile(
            ((p.p50_ms, p.steps) for p in parts if p.p50_ms is not None), 0.5
        ),
        "p90_ms": weighted_quantile(
            ((p.p90_ms, p.steps) for p in parts if p.p90_ms is not None), 0.9
        ),
        "max_ms": max(maxes) if maxes else None,
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(float(v), 3)
