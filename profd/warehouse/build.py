"""The rows of one partition of one warehouse table, built from this node's index as columns
(plain lists, one per column of :data:`~profd.warehouse.tables.COLUMNS` ``[table]``, in
its order): :func:`profd.warehouse.arrow.arrow_table` makes them an Arrow table. No pyarrow
here: the daemon builds the ``warehouse`` request's overlays with it.

Every builder reads the whole partition (a day, or an hour for the minute tables): the
object it becomes replaces the one before it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from profd.store.index import (
    Database,
    IncidentRepo,
    MinuteRow,
    StepMinuteRepo,
    StoredMinute,
    TraceRepo,
    history_rows,
    merged_figures,
)
from profd.warehouse.tables import COLUMNS, HOURLY, check_part

#: The longest ``reason`` kept: one line, as ``profctl incidents`` prints it.
MAX_REASON = 300


class Source:
    """Where rows come from and what a row says about this node: ``node`` is
    ``[daemon] node_name``; ``job`` limits the rows to one job (None: all). The traces of a
    range are read once however many of the tables built from them ask: make one Source per
    read snapshot."""

    def __init__(
        self,
        trace_rows: TraceRepo,
        minute_rows: StepMinuteRepo,
        incident_rows: IncidentRepo,
        node: str,
        job: str | None = None,
    ) -> None:
        self.trace_rows = trace_rows
        self.minute_rows = minute_rows
        self.incident_rows = incident_rows
        self.node = node
        self.job = job
        self._traces: dict[tuple[float, float], list[dict[str, Any]]] = {}

    @classmethod
    def of(cls, db: Database, node: str, job: str | None = None) -> Source:
        """The rows of each area from its own repository over ``db``'s connection (read in
        the caller's snapshot: ``WarehouseQueueRepo.snapshot``)."""
        return cls(TraceRepo(db), StepMinuteRepo(db), IncidentRepo(db), node, job)

    def traces(self, since: float, until: float) -> list[dict[str, Any]]:
        key = (since, until)
        rows = self._traces.get(key)
        if rows is None:
            rows = self._traces[key] = self.trace_rows.trace_rows(
                since, until, stats=True, job=self.job
            )
        return rows


def part_range(table: str, part: str) -> tuple[float, float]:
    """The partition's ``[since, until)`` in unix seconds (UTC)."""
    check_part(table, part)
    date, _, hour = part.partition("/")
    start = datetime.strptime(date, "%Y-%m-%d").replace(tzinfo=UTC).timestamp()
    if table in HOURLY and hour:
        start += int(hour) * 3600
        return start, start + 3600.0
    return start, start + 86400.0


def build(table: str, part: str, src: Source) -> Columns:
    """The partition's rows, as its object holds them."""
    since, until = part_range(table, part)
    return _BUILDERS[table](src, since, until)


def _ts(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000.0)


#: A partition's rows, column by column.
Columns = dict[str, list[Any]]


def _columns(table: str) -> Columns:
    return {name: [] for name, _ in COLUMNS[table]}


# --- captures and what their statistics hold ------------------------------------------------------
def _trace_key(r: dict[str, Any]) -> str | None:
    # The S3 uri once uploaded; before that (or with no S3) the path below the spool, which
    # is also the key below the upload prefix.
    return r.get("s3_uri") or r.get("rel")


def captures(src: Source, since: float, until: float) -> Columns:
    cols = _columns("captures")
    for r in src.traces(since, until):
        steps = r["steps"]
        row = {
            "job": r["job"],
            "session": r["session"],
            "node": src.node,
            "host": r["host"],
            "role": r["role"],
            "rank": r["rank"],
            "world_size": r["world_size"],
            "cycle": r["cycle"],
            "step_first": min(steps) if steps else None,
            "step_last": max(steps) if steps else None,
            "backend": r["backend"],
            "label": r["label"],
            "state": r["state"],
            "bytes": r["bytes"],
            "stall_ms": r["stall_ms"],
            "trace_key": _trace_key(r),
            "created": _ts(r["created_at"]),
        }
        for k, v in row.items():
            cols[k].append(v)
    return cols


def _who(src: Source, r: dict[str, Any]) -> dict[str, Any]:
    return {
        "job": r["job"],
        "session": r["session"],
        "node": src.node,
        "role": r["role"],
        "rank": r["rank"],
        "cycle": r["cycle"],
    }


def _repeat(cols: Columns, values: dict[str, Any], n: int) -> None:
    for k, v in values.items():
        cols[k].extend([v] * n)


def rank_steps(src: Source, since: float, until: float) -> Columns:
    cols = _columns("rank_steps")
    parts = ("ms", "compute_ms", "collective_ms", "idle_ms")
    for r in src.traces(since, until):
        stats = r["stats"] or {}
        steps = stats.get("steps") or {}
        numbers = steps.get("step") or []
        n = len(numbers)
        if not n:
            continue
        _repeat(cols, _who(src, r), n)
        cols["step"].extend(numbers)
        for p in parts:
            col = list(steps.get(p) or [])[:n]
            cols[p].extend(col + [None] * (n - len(col)))
        cols["mode"].extend([stats.get("mode")] * n)
    return cols


def operators(src: Source, since: float, until: float) -> Columns:
    cols = _columns("operators")
    for r in src.traces(since, until):
        stats = r["stats"] or {}
        nsteps = len((stats.get("steps") or {}).get("step") or []) or None
        ops = stats.get("ops") or []
        gpu = stats.get("gpu_ops") or []
        coll = stats.get("collectives") or []
        n = len(ops) + len(gpu) + len(coll)
        if not n:
            continue
        _repeat(cols, _who(src, r), n)
        cols["kind"].extend(["cpu"] * len(ops) + ["gpu"] * len(gpu) + ["collective"] * len(coll))
        cols["steps"].extend([nsteps] * n)
        # Column by column (a list's columns are its rows transposed): 10^5 operators an
        # hour at one capture a second.
        for listed, total in ((ops, 3), (gpu, None), (coll, 2)):
            if not listed:
                continue
            fields = list(zip(*(op[:4] for op in listed), strict=False))
            cols["name"].extend(fields[0])
            cols["calls"].extend(fields[1])
            cols["self_ms"].extend(fields[2])
            # A kernel has no children (no total); a collective's ms is its wall time, both.
            if total is not None and total < len(fields):
                cols["total_ms"].extend(fields[total])
            else:
                cols["total_ms"].extend([None] * len(listed))
    return cols


# --- minutes -----------------------------------------------------------------------------------
def _rank_minutes(
    src: Source, since: float, until: float
) -> list[tuple[StoredMinute, dict[str, float]]]:
    """One row per rank and minute, with its region times (ms by name): a rank that
    re-attached within a minute has two rows in the index, merged here as ``profctl
    history`` merges them (steps summed, quantiles weighted by steps, the longest step,
    region times summed)."""
    by_key: dict[tuple[str, str, str, int, int], list[StoredMinute]] = {}
    for row in src.minute_rows.minute_rows(since, until, job=src.job):
        by_key.setdefault((row.job, row.host, row.role, row.rank, row.minute), []).append(row)
    out: list[tuple[StoredMinute, dict[str, float]]] = []
    for _, rows in sorted(by_key.items()):
        regions: dict[str, float] = {}
        for r in rows:
            for name, seconds in json.loads(r.regions or "{}").items():
                regions[name] = regions.get(name, 0.0) + float(seconds) * 1000.0
        row = rows[0] if len(rows) == 1 else rows[0]._replace(**merged_figures(rows))
        out.append((row, regions))
    return out


def rank_minutes(src: Source, since: float, until: float) -> Columns:
    cols = _columns("rank_minutes")
    for m, regions in _rank_minutes(src, since, until):
        cols["job"].append(m.job)
        cols["node"].append(src.node)
        cols["role"].append(m.role)
        cols["rank"].append(m.rank)
        cols["minute"].append(m.minute * 1000)
        cols["steps"].append(m.steps)
        cols["p50_ms"].append(m.p50_ms)
        cols["p90_ms"].append(m.p90_ms)
        cols["p99_ms"].append(None)  # the step ledger keeps no p99
        cols["max_ms"].append(m.max_ms)
        cols["regions"].append(regions)  # a map: name -> ms
    return cols


def job_minutes(src: Source, since: float, until: float) -> Columns:
    """This node's part of each job's minute: its ranks, their steps, and (as ``profctl
    history`` computes them, :func:`~profd.store.index.history_rows`) the median over its
    ranks of each rank's p50 and of each rank's p90, the longest step, and the rank with the
    highest p50. Readers merge the nodes' rows of one minute (``nodes`` adds up)."""
    cols = _columns("job_minutes")
    by_job: dict[str, list[MinuteRow]] = {}
    for m, _ in _rank_minutes(src, since, until):
        by_job.setdefault(m.job, []).append(
            MinuteRow(m.minute, m.role, m.host, m.rank, m.steps, m.p50_ms, m.p90_ms, m.max_ms)
        )
    for job in sorted(by_job):
        for h in history_rows(by_job[job]):
            slowest = h["slowest"][0] if h["slowest"] else None
            row = {
                "job": job,
                "role": h["role"],
                "minute": h["minute"] * 1000,
                "node": src.node,
                "nodes": 1,
                "ranks": h["ranks"],
                "steps": h["steps"],
                "p50_ms": h["p50_ms"],
                "p90_ms": h["p90_ms"],
                "max_ms": h["max_ms"],
                "slowest_rank": slowest["rank"] if slowest else None,
                "slowest_node": src.node if slowest else None,
                "vs_baseline": None,  # a baseline is the detectors' live state, not indexed
            }
            for k, v in row.items():
                cols[k].append(v)
    return cols


# --- incidents ---------------------------------------------------------------------------------
def reason(doc: dict[str, Any]) -> str | None:
    """The incident in one line: the detector's own words where it gave some."""
    ev = doc.get("evidence") or {}
    text = ev.get("why") or ev.get("verdict")
    if not text:
        ratio = ev.get("ratio")
        text = f"{doc.get('kind')} x{ratio:.2f}" if isinstance(ratio, int | float) else None
    if not text:
        return None
    line = " ".join(str(text).split())
    return line if len(line) <= MAX_REASON else line[: MAX_REASON - 3] + "..."


def _lost(doc: dict[str, Any]) -> float | None:
    v = doc.get("lost_rank_s")
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def incidents(src: Source, since: float, until: float) -> Columns:
    cols = _columns("incidents")
    for d in src.incident_rows.incident_docs(since, until, job=src.job):
        row = {
            "id": d["id"],
            "kind": d["kind"],
            "job": d["job"],
            "role": d.get("role"),
            "node": d.get("host"),
            "state": d.get("state"),
            "detected": _ts(d.get("detected_at")),
            "resolved": _ts(d.get("resolved_at")),
            "step": d.get("step"),
            "suspects": [
                {"node": s.get("host"), "role": s.get("role"), "rank": s.get("rank")}
                for s in d.get("suspects") or []
            ],
            "session": d.get("session"),
            "reason": reason(d),
            "lost_rank_s": _lost(d),
        }
        for k, v in row.items():
            cols[k].append(v)
    return cols


_BUILDERS: dict[str, Callable[[Source, float, float], Columns]] = {
    "captures": captures,
    "rank_steps": rank_steps,
    "operators": operators,
    "rank_minutes": rank_minutes,
    "job_minutes": job_minutes,
    "incidents": incidents,
}
assert set(_BUILDERS) == set(COLUMNS)
