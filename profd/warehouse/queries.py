"""The named questions profctl answers from the warehouse, each one SQL statement.

These strings are what ``profctl goodput``, ``nodes`` and ``trend`` run (``--sql`` prints
them) and what docs/warehouse.md shows, so anyone can paste them into DuckDB, Trino, Athena
or Spark. Parameters are named (``$since``: a UTC timestamp; ``$since_date``: its
``YYYY-MM-DD``, which lets a reader skip older partitions; ``$job``: a glob; ``$op``: an
operator name). Partitions are by the row's own date (an incident's ``detected``, a minute's
``minute``), so ``date >= $since_date`` never drops a row the time filter keeps.
"""

from __future__ import annotations

#: The tables each query reads: only these are listed.
GOODPUT_TABLES = frozenset({"incidents"})
NODES_TABLES = frozenset({"incidents", "job_minutes"})
TREND_TABLES = frozenset({"captures", "operators"})

#: What ``goodput --by`` groups on: the column, and the columns shown for each group.
GOODPUT_BY = ("job", "node", "kind", "incident")

_GOODPUT = """SELECT {keys},
       count(*) AS incidents,
       sum(lost_rank_s) / 3600.0 AS rank_hours_lost
FROM incidents
WHERE date >= $since_date AND detected >= $since
GROUP BY {group}
ORDER BY rank_hours_lost DESC NULLS LAST, {group}"""

_GOODPUT_INCIDENT = """SELECT id, kind, job, node, detected, state,
       lost_rank_s / 3600.0 AS rank_hours_lost
FROM incidents
WHERE date >= $since_date AND detected >= $since
ORDER BY rank_hours_lost DESC NULLS LAST, id"""


def goodput_sql(by: str) -> str:
    """Rank-hours lost to incidents detected since ``$since``, per ``by``."""
    if by == "incident":
        return _GOODPUT_INCIDENT
    if by not in GOODPUT_BY:
        raise ValueError(f"goodput by {by!r}")
    return _GOODPUT.format(keys=by, group=by)


#: Per node: the incidents whose suspects ran on it, per 1,000 rank-hours it hosted (from
#: job_minutes: each row is one minute of ``ranks`` ranks on that node), with the jobs hit.
NODES_SQL = """WITH hosted AS (
    SELECT node, sum(ranks) / 60.0 AS rank_hours
    FROM job_minutes
    WHERE date >= $since_date AND minute >= $since
    GROUP BY node
), suspected AS (
    SELECT DISTINCT id, job, s.node AS node
    FROM (SELECT id, job, unnest(suspects) AS s
          FROM incidents
          WHERE date >= $since_date AND detected >= $since)
), hits AS (
    SELECT node, count(*) AS incidents, string_agg(DISTINCT job, ',' ORDER BY job) AS jobs
    FROM suspected
    GROUP BY node
)
SELECT hits.node, hits.incidents, hosted.rank_hours,
       1000.0 * hits.incidents / hosted.rank_hours AS per_1000_rank_hours,
       hits.jobs
FROM hits LEFT JOIN hosted ON hosted.node = hits.node
ORDER BY hits.incidents DESC, per_1000_rank_hours DESC NULLS FIRST, hits.node"""

#: One row per capture (job, session, cycle) of jobs matching ``$job``: the operator
#: ``$op``'s self time per step on each rank (summed over its kinds), averaged over ranks,
#: and the fastest and slowest rank's, oldest capture first.
TREND_SQL = """WITH per_rank AS (
    SELECT job, session, cycle, node, role, rank,
           sum(self_ms) / nullif(max(steps), 0) AS ms_per_step
    FROM operators
    WHERE name = $op AND job GLOB $job
    GROUP BY job, session, cycle, node, role, rank
), caps AS (
    SELECT job, session, cycle, min(created) AS created
    FROM captures
    WHERE job GLOB $job
    GROUP BY job, session, cycle
)
SELECT caps.created, per_rank.job, per_rank.session, per_rank.cycle,
       count(*) AS ranks,
       avg(ms_per_step) AS ms_per_step,
       min(ms_per_step) AS min_ms,
       max(ms_per_step) AS max_ms
FROM per_rank
JOIN caps ON caps.job = per_rank.job AND caps.session = per_rank.session
         AND caps.cycle = per_rank.cycle
GROUP BY caps.created, per_rank.job, per_rank.session, per_rank.cycle
ORDER BY caps.created, per_rank.job, per_rank.session, per_rank.cycle"""


def all_sql() -> dict[str, str]:
    """Every named query's SQL, by the name docs/warehouse.md gives it."""
    out = {f"goodput --by {b}": goodput_sql(b) for b in GOODPUT_BY}
    out["nodes"] = NODES_SQL
    out["trend"] = TREND_SQL
    return out
