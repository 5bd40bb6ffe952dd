"""A simulated fleet's warehouse, written with pyarrow and the layout functions only.

Nodes run jobs (each job on a contiguous block of nodes, every node all its ranks in one
job), write one object per writer and partition exactly as the daemon's export does
(``object_key(table, part, writer_stem(node, instance))``), and the fleet's figures are
deterministic from :class:`Fleet`'s fields: the same warehouse for the benchmark and the
tests, which read it back with two engines and compare.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from profd.warehouse.arrow import SCHEMAS
from profd.warehouse.merge import NO_FLEET, merge
from profd.warehouse.sink import LocalSink
from profd.warehouse.tables import HOURLY, SOURCE, TABLES, fleet_key, object_key, writer_stem

KINDS = ("regression", "straggler", "slow_rank", "hang")
OPS = ("aten::mm", "nccl:all_reduce", "aten::copy_", "aten::layer_norm")
DAY = 86400


@dataclass
class Fleet:
    nodes: int = 1024
    ranks_per_node: int = 8
    jobs: int = 128
    #: Days of job minutes, ending ``end``; each node writes 24 objects a day.
    job_minute_days: float = 30
    #: Hours of rank minutes (one object per node and hour).
    rank_minute_hours: int = 24
    captures: int = 10_000
    #: Ranks each capture holds (all on one node).
    capture_ranks: int = 8
    steps_per_capture: int = 4
    incidents: int = 2_000
    days: int = 30
    seed: int = 7
    #: The newest minute; by default the last whole hour before now, so ``--since 30d``
    #: spans the fleet.
    end: float = field(default_factory=lambda: float(int(time.time() // 3600 * 3600 - 3600)))
    #: Nodes that show up in many incidents' suspects (the "repeat offenders").
    bad_nodes: tuple[int, ...] = (3, 17, 100)
    #: Closed days sealed as the daemons seal them: one object per node, day and hourly
    #: table; ``keep_hours_of``'s nodes keep their superseded hourly objects too (a seal
    #: inside its ``sweep_after``), which every reader must leave out.
    sealed: bool = False
    keep_hours_of: tuple[int, ...] = ()
    #: Closed days merged as the daemons merge them: one fleet object per table and date
    #: (profd/warehouse/merge.py), the writers' day objects handed over; and today's job
    #: minutes but the last two hours' in a fleet object of their hours. Job minutes are
    #: written as their fleet objects directly (a month of them per node and hour would be
    #: 737,280 objects to write first).
    merged: bool = False

    @property
    def start(self) -> float:
        return self.end - self.days * DAY

    def node(self, i: int) -> str:
        return f"gpu{i:04d}"

    def stem(self, i: int) -> str:
        return writer_stem(self.node(i), f"i{i:04d}ab")

    def job_of_node(self, i: int) -> int:
        return i * self.jobs // self.nodes

    def job_nodes(self, j: int) -> range:
        lo = -(-j * self.nodes // self.jobs)
        hi = -(-(j + 1) * self.nodes // self.jobs)
        return range(lo, hi)

    def job(self, j: int) -> str:
        return f"train-{j:03d}" if j % 4 else f"eval-{j:03d}"


def _ts(seconds: np.ndarray[Any, Any]) -> pa.Array:
    return pa.array((seconds * 1000).astype("int64"), pa.timestamp("ms", tz="UTC"))


def _day(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t))


def _hour_part(t: float) -> str:
    return time.strftime("%Y-%m-%d/%H", time.gmtime(t))


def _write(root: Path, table: str, part: str, stem: str, cols: dict[str, Any] | pa.Table) -> int:
    t = cols if isinstance(cols, pa.Table) else pa.table(cols, schema=SCHEMAS[table])
    path = root / object_key(table, part, stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(t, tmp, compression="zstd")
    tmp.replace(path)
    return t.num_rows


def _groups(keys: list[tuple[str, int]]) -> Iterator[tuple[tuple[str, int], np.ndarray[Any, Any]]]:
    order: dict[tuple[str, int], list[int]] = {}
    for i, k in enumerate(keys):
        order.setdefault(k, []).append(i)
    for k, idx in order.items():
        yield k, np.array(idx)


def _pick(nodes: range, x: int) -> int:
    return nodes[x % len(nodes)]


def write_incidents(f: Fleet, root: Path, rng: np.random.Generator) -> dict[str, int]:
    n = f.incidents
    jobs = rng.integers(0, f.jobs, n)
    detected = f.start + rng.random(n) * (f.end - f.start - 600)
    kinds = rng.integers(0, len(KINDS), n)
    lost = np.round(rng.gamma(2.0, 4000.0, n), 1)
    rows = 0
    # The node that noticed it writes it: any node of the job.
    picks = rng.integers(0, f.nodes, n)
    writers = [_pick(f.job_nodes(int(j)), int(x)) for j, x in zip(jobs, picks, strict=True)]
    keys = [(_day(float(d)), w) for d, w in zip(detected, writers, strict=True)]
    for (day, writer), idx in _groups(keys):
        suspects = []
        for i in idx:
            nodes = list(f.job_nodes(int(jobs[i])))
            pick = [nodes[int(i) % len(nodes)]]
            bad = [b for b in f.bad_nodes if b in nodes]
            if bad and i % 2 == 0:
                pick = [bad[0], *pick]
            suspects.append(
                [
                    {
                        "node": f.node(k),
                        "role": "trainer",
                        "rank": (k - nodes[0]) * f.ranks_per_node,
                    }
                    for k in dict.fromkeys(pick)
                ]
            )
        cols = {
            "id": [f"inc-{int(i):06d}" for i in idx],
            "kind": [KINDS[int(kinds[i])] for i in idx],
            "job": [f.job(int(jobs[i])) for i in idx],
            "role": ["trainer"] * len(idx),
            "node": [f.node(writer)] * len(idx),
            "state": ["resolved" if i % 5 else "open" for i in idx],
            "detected": _ts(detected[idx]),
            "resolved": _ts(detected[idx] + 300),
            "step": (detected[idx] // 10).astype("int64"),
            "suspects": suspects,
            "session": [None] * len(idx),
            "reason": ["simulated"] * len(idx),
            "lost_rank_s": lost[idx],
        }
        rows += _write(root, "incidents", day, f.stem(writer), cols)
    return {"rows": rows}


def write_job_minutes(f: Fleet, root: Path, rng: np.random.Generator) -> dict[str, int]:
    minutes = int(f.job_minute_days * 1440)
    first = f.end - (minutes - 1) * 60
    hours = sorted({int((first + m * 60) // 3600) for m in range(minutes)})
    rows = objects = 0
    # Merged: every closed day (merged an hour after it ends), and today's hours but the
    # last two (an hour's objects are merged half an hour after it ends, and handed over
    # some minutes later). Sealed: the days before yesterday.
    merged_before = _day(f.end) if f.merged else _day(f.end - DAY)
    by_day: dict[str, list[pa.Table]] = {}
    for h in hours:
        lo = max(first, h * 3600.0)
        mins = np.arange(lo, min(f.end, h * 3600.0 + 3540) + 1, 60.0)
        if not len(mins):
            continue
        part = _hour_part(h * 3600.0)
        today = f.merged and part[:10] == _day(f.end) and (h + 2) * 3600.0 <= f.end
        if ((f.merged or f.sealed) and part[:10] < merged_before) or today:
            hour = part[-2:] if today else None
            by_day.setdefault(part[:10], []).append(_job_minutes_hour(f, mins, rng, hour))
            if (
                h + 1 not in hours
                or _hour_part((h + 1) * 3600.0)[:10] != part[:10]
                or (today and (h + 3) * 3600.0 > f.end)
            ):
                day = pa.concat_tables(by_day.pop(part[:10]))
                rows += day.num_rows
                objects += _write_day(f, root, part[:10], day)
            continue
        for i in range(f.nodes):
            j = f.job_of_node(i)
            k = len(mins)
            p50 = 400 + 50 * rng.random(k)
            cols = {
                "job": [f.job(j)] * k,
                "role": ["trainer"] * k,
                "minute": _ts(mins),
                "node": [f.node(i)] * k,
                "nodes": [len(f.job_nodes(j))] * k,
                "ranks": [f.ranks_per_node] * k,
                "steps": np.full(k, 120, "int64"),
                "p50_ms": p50,
                "p90_ms": p50 * 1.1,
                "max_ms": p50 * 1.3,
                "slowest_rank": np.zeros(k, "int32"),
                "slowest_node": [f.node(i)] * k,
                "vs_baseline": np.ones(k),
            }
            rows += _write(root, "job_minutes", part, f.stem(i), cols)
            objects += 1
    return {"rows": rows, "objects": objects}


def _write_day(f: Fleet, root: Path, date: str, day: pa.Table) -> int:
    """A closed day of every node's job minutes as the daemons leave it: merged, one fleet
    object; sealed, one day object per node. How many objects."""
    if f.merged:
        path = root / fleet_key("job_minutes", date, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(day, path, compression="zstd")
        return 1
    stems = day[SOURCE].to_numpy(zero_copy_only=False)
    day = day.drop_columns([SOURCE])
    # Rows come hour by hour, each hour node by node: gather each node's rows of the day.
    order = np.argsort(stems, kind="stable")
    day, stems = day.take(pa.array(order)), stems[order]
    starts = np.flatnonzero(np.r_[True, stems[1:] != stems[:-1]])
    ends = np.r_[starts[1:], len(stems)]
    for a, b in zip(starts, ends, strict=True):
        _write(root, "job_minutes", date, str(stems[a]), day.slice(a, b - a))
    return len(starts)


def _job_minutes_hour(
    f: Fleet, mins: np.ndarray[Any, Any], rng: np.random.Generator, hour: str | None = None
) -> pa.Table:
    """Every node's job minutes of one hour, with the writers' objects they come from (a
    fleet object's sources): each writer's day object, or its object of ``hour``."""
    k, n = len(mins), f.nodes
    nodes = [f.node(i) for i in range(n)]
    jobs = [f.job_of_node(i) for i in range(n)]
    p50 = 400 + 50 * rng.random(k * n)
    cols = {
        "job": np.repeat([f.job(j) for j in jobs], k).tolist(),
        "role": ["trainer"] * (k * n),
        "minute": _ts(np.tile(mins, n)),
        "node": np.repeat(nodes, k).tolist(),
        "nodes": np.repeat([len(f.job_nodes(j)) for j in jobs], k).astype("int32"),
        "ranks": np.full(k * n, f.ranks_per_node, "int32"),
        "steps": np.full(k * n, 120, "int64"),
        "p50_ms": p50,
        "p90_ms": p50 * 1.1,
        "max_ms": p50 * 1.3,
        "slowest_rank": np.zeros(k * n, "int32"),
        "slowest_node": np.repeat(nodes, k).tolist(),
        "vs_baseline": np.ones(k * n),
    }
    t = pa.table(cols, schema=SCHEMAS["job_minutes"])
    names = [f.stem(i) + (f"~{hour}" if hour else "") for i in range(n)]
    return t.append_column(SOURCE, pa.array(np.repeat(names, k).tolist(), pa.string()))


def write_rank_minutes(f: Fleet, root: Path, rng: np.random.Generator) -> dict[str, int]:
    rows = objects = 0
    for hh in range(f.rank_minute_hours):
        h0 = f.end - (f.rank_minute_hours - hh) * 3600.0
        part = _hour_part(h0)
        mins = np.repeat(np.arange(h0, h0 + 3600, 60.0), f.ranks_per_node)
        k = len(mins)
        for i in range(f.nodes):
            p50 = (400 + 50 * rng.random(k)).astype("float32")
            regions = pa.MapArray.from_arrays(
                np.arange(0, 2 * k + 1, 2, dtype="int32"),
                pa.array(["forward", "backward"] * k),
                pa.array(np.tile(np.array([150.0, 250.0], "float32"), k)),
            )
            cols = {
                "job": [f.job(f.job_of_node(i))] * k,
                "node": [f.node(i)] * k,
                "role": ["trainer"] * k,
                "rank": np.tile(np.arange(f.ranks_per_node, dtype="int32"), k // f.ranks_per_node),
                "minute": _ts(mins),
                "steps": np.full(k, 120, "int32"),
                "p50_ms": p50,
                "p90_ms": p50 * 1.1,
                "p99_ms": p50 * 1.2,
                "max_ms": p50 * 1.3,
                "regions": regions,
            }
            rows += _write(root, "rank_minutes", part, f.stem(i), cols)
            objects += 1
    return {"rows": rows, "objects": objects}


def write_captures(f: Fleet, root: Path, rng: np.random.Generator) -> dict[str, int]:
    n = f.captures
    node_of = rng.integers(0, f.nodes, n)
    created = f.start + rng.random(n) * (f.end - f.start - 600)
    # The captures' tables are hourly, as the daemon writes them (tables.HOURLY).
    keys = [(_hour_part(float(c)), int(k)) for c, k in zip(created, node_of, strict=True)]
    counts = {"captures": 0, "operators": 0, "rank_steps": 0}
    r = f.capture_ranks
    for (day, i), idx in _groups(keys):
        j = f.job_of_node(i)
        first_rank = (i - f.job_nodes(j)[0]) * f.ranks_per_node
        ranks = np.arange(first_rank, first_rank + r, dtype="int32")
        caps = len(idx)
        cap_rows = np.repeat(idx, r)
        base = {
            "job": [f.job(j)] * (caps * r),
            "session": [f"s{int(c):06d}" for c in cap_rows],
            "node": [f.node(i)] * (caps * r),
            "role": ["trainer"] * (caps * r),
            "rank": np.tile(ranks, caps),
            "cycle": np.zeros(caps * r, "int32"),
        }
        step0 = (created[cap_rows] // 1).astype("int64")
        cols = {
            **base,
            "host": [f.node(i)] * (caps * r),
            "world_size": np.full(caps * r, len(f.job_nodes(j)) * f.ranks_per_node, "int32"),
            "step_first": step0,
            "step_last": step0 + f.steps_per_capture - 1,
            "backend": ["torch"] * (caps * r),
            "label": [None] * (caps * r),
            "state": ["uploaded"] * (caps * r),
            "bytes": np.full(caps * r, 5_000_000, "int64"),
            "stall_ms": 50 * rng.random(caps * r),
            "trace_key": [None] * (caps * r),
            "created": _ts(created[cap_rows]),
        }
        counts["captures"] += _write(root, "captures", day, f.stem(i), cols)
        no = len(OPS)
        op_rows = np.repeat(np.arange(caps * r), no)
        # An operator gets slower over the month, so trend has something to show.
        age = (created[cap_rows][op_rows] - f.start) / (f.end - f.start)
        self_ms = (10 + 5 * age + rng.random(len(op_rows))) * f.steps_per_capture
        ops = {k: [v[x] for x in op_rows] for k, v in base.items() if isinstance(v, list)}
        ops.update({k: v[op_rows] for k, v in base.items() if not isinstance(v, list)})
        cols = {
            **ops,
            "name": [OPS[x % no] for x in range(len(op_rows))],
            "kind": ["collective" if x % no == 1 else "gpu" for x in range(len(op_rows))],
            "calls": np.full(len(op_rows), 40, "int64"),
            "self_ms": self_ms,
            "total_ms": self_ms * 1.5,
            "steps": np.full(len(op_rows), f.steps_per_capture, "int32"),
        }
        counts["operators"] += _write(root, "operators", day, f.stem(i), cols)
        s = f.steps_per_capture
        st_rows = np.repeat(np.arange(caps * r), s)
        steps = {k: [v[x] for x in st_rows] for k, v in base.items() if isinstance(v, list)}
        steps.update({k: v[st_rows] for k, v in base.items() if not isinstance(v, list)})
        ms = 400 + 50 * rng.random(len(st_rows))
        cols = {
            **steps,
            "step": step0[st_rows] + np.tile(np.arange(s), caps * r),
            "ms": ms,
            "compute_ms": ms * 0.7,
            "collective_ms": ms * 0.2,
            "idle_ms": ms * 0.1,
            "mode": ["trace"] * len(st_rows),
        }
        counts["rank_steps"] += _write(root, "rank_steps", day, f.stem(i), cols)
    return counts


def generate(f: Fleet, root: Path) -> dict[str, Any]:
    """Write the whole fleet under ``root``; rows and objects per table, and seconds taken."""
    rng = np.random.default_rng(f.seed)
    out: dict[str, Any] = {}
    for name, fn in (
        ("incidents", write_incidents),
        ("captures", write_captures),
        ("job_minutes", write_job_minutes),
        ("rank_minutes", write_rank_minutes),
    ):
        t0 = time.monotonic()
        out[name] = fn(f, root, rng)
        out[name]["write_s"] = round(time.monotonic() - t0, 2)
    if f.sealed or f.merged:
        t0 = time.monotonic()
        out["sealed"] = seal(root, _day(f.end), {f.stem(i) for i in f.keep_hours_of})
        out["sealed"]["write_s"] = round(time.monotonic() - t0, 2)
    if f.merged:
        t0 = time.monotonic()
        keep = {f.stem(i) for i in f.keep_hours_of}
        out["merged"] = merge_days(root, _day(f.end), f.end, keep)
        out["merged"]["write_s"] = round(time.monotonic() - t0, 2)
    out["objects"] = {
        t: sum(1 for _ in (root / t).rglob("*.parquet")) if (root / t).exists() else 0
        for t in SCHEMAS
    }
    out["bytes"] = {
        t: sum(p.stat().st_size for p in (root / t).rglob("*.parquet"))
        if (root / t).exists()
        else 0
        for t in SCHEMAS
    }
    out["hourly"] = sorted(HOURLY)
    return out


def seal(root: Path, before: str, keep: set[str]) -> dict[str, int]:
    """Every writer's hourly objects of every date before ``before`` made one day object
    (``{stem}.parquet``, rows in hour order), the hourly objects deleted unless their stem is
    in ``keep``. Day objects written per table."""
    made: dict[str, int] = {}
    for table in sorted(HOURLY):
        for folder in sorted((root / table).glob("date=*")):
            if folder.name[5:] >= before:
                continue
            by_stem: dict[str, list[Path]] = {}
            for p in sorted(folder.glob("[!~]*~*~*.parquet")):  # not the fleet objects
                by_stem.setdefault(p.name.rsplit("~", 1)[0], []).append(p)
            for stem, hours in by_stem.items():
                day = pa.concat_tables(pq.read_table(p, schema=SCHEMAS[table]) for p in hours)
                _write(root, table, folder.name[5:], stem, day)
                made[table] = made.get(table, 0) + 1
                if stem not in keep:
                    for p in hours:
                        p.unlink()
    return made


def merge_days(root: Path, before: str, now: float, keep: set[str]) -> dict[str, int]:
    """Every table's dates before ``before`` merged by profd's own merge (fleet object 1
    of each date: every writer's day object), then the day objects deleted, as each writer
    does once the grace period has passed, but those of ``keep`` (inside it)."""
    sink = LocalSink(root)
    made: dict[str, int] = {}
    for table in TABLES:
        for date in sink.dates(table):
            if date >= before:
                continue
            listed = sink.folder(table, date)
            days = {n[:-8]: o for n, o in listed.items() if n.count("~") == 1 and n[0] != "~"}
            if not days:
                continue
            assert merge(sink, table, date, 1, ("", NO_FLEET), days, now)
            for stem in set(days) - keep:
                sink.delete(object_key(table, date, stem))
            made[table] = made.get(table, 0) + 1
    return made
