"""A session's report, built from the per-rank statistics in its results (never the traces).

The input is a session as ``profctl show --json`` gives it (from a daemon, from every node
with ``--cluster``) or as its ``session.json`` manifests hold it in S3: targets, each with
per-cycle results carrying ``stats`` (see :mod:`profd.pipeline.rankstats`). So the same
report comes out of any of the three.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any, NamedTuple

from profd.report.straggler import MAD_SIGMA, RankSteps, Verdict, find_stragglers

#: Statistics versions this reader understands.
KNOWN_VERSIONS = frozenset({1})
#: Operators compared across ranks in a report.
REPORT_OPS = 15


@dataclass
class RankData:
    """One process's statistics, its cycles' merged (a step appears in one cycle)."""

    host: str
    role: str
    rank: int
    mode: str = "cpu"
    #: step -> (ms, compute_ms, collective_ms, idle_ms, gap_ms)
    steps: dict[int, tuple[float, float, float, float, float]] = field(default_factory=dict)
    #: step -> ms with a collective in flight, compute not subtracted (what the straggler rule
    #: compares); statistics from before it was kept have none
    waits: dict[int, float] = field(default_factory=dict)
    #: step -> (cycle, start in µs on the trace's clock): where the timeline aligns ranks
    starts: dict[int, tuple[int, float]] = field(default_factory=dict)
    ops: dict[str, float] = field(default_factory=dict)  # CPU self time, ms, all steps
    gpu_ops: dict[str, float] = field(default_factory=dict)
    collectives: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)  # device -> peak allocated bytes
    profiled_steps: int = 0  # steps the operator times cover (for per-step averages)
    traces: list[tuple[int, str]] = field(default_factory=list)  # (cycle, path) per capture
    #: (cycle, path) of each capture's memory page (``--profile-memory``), paths as results
    #: give them (relative to the spool, and to the S3 prefix)
    memory_pages: list[tuple[int, str]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.role} r{self.rank} @{self.host}"

    def per_step(self, total_ms: float) -> float:
        return total_ms / self.profiled_steps if self.profiled_steps else 0.0


class RankSummary(NamedTuple):
    """A rank's means per step over the report's steps, in ms."""

    step_ms: float
    compute_ms: float
    collective_ms: float
    idle_ms: float


@dataclass(frozen=True)
class Straggler:
    index: int  # into Report.ranks
    why: str
    wait_ms: float  # its peers' collective time per step minus its own (the table's figures)
    lead_ms: float  # what the rule measured: its lead over its peers per step (straggler.py)


@dataclass(frozen=True)
class OpRow:
    """One operator across ranks, ms per step."""

    name: str
    median_ms: float
    min_ms: float
    max_ms: float
    max_index: int
    outliers: tuple[int, ...]  # ranks far above the median (indices into Report.ranks)


@dataclass
class Report:
    session: str
    job: str
    ranks: list[RankData]
    steps: list[int]  # the steps every rank has statistics for
    summaries: list[RankSummary]
    verdict: Verdict
    stragglers: list[Straggler]
    ops: list[OpRow]
    skipped: int = 0  # targets without statistics (failed, or an older profd)
    #: A memory page's path (as in RankData.memory_pages) -> where this machine opens it; only
    #: the HTML page uses it, and only pages found here are linked.
    page_links: dict[str, str] = field(default_factory=dict)
    #: The incident this session captured (its map, ``comparison`` included), when it is an
    #: incident's capture: the HTML page leads with it.
    incident: dict[str, Any] | None = None

    @property
    def mode(self) -> str:
        return "gpu" if any(r.mode == "gpu" for r in self.ranks) else "cpu"

    @property
    def has_memory(self) -> bool:
        return any(r.memory for r in self.ranks)

    @property
    def median_step_ms(self) -> float:
        return median(s.step_ms for s in self.summaries) if self.summaries else 0.0


def _add(acc: dict[str, float], rows: Iterable[Sequence[Any]], col: int) -> None:
    for row in rows:
        acc[str(row[0])] = acc.get(str(row[0]), 0.0) + float(row[col])


def rank_data(target: Mapping[str, Any]) -> RankData | None:
    """A target's statistics, or None when none of its results has any this reader knows."""
    r = RankData(str(target["host"]), str(target["role"]), int(target["rank"]))
    found = False
    for res in target.get("results") or []:
        st = res.get("stats")
        if not isinstance(st, dict) or st.get("v") not in KNOWN_VERSIONS:
            continue
        found = True
        cycle = int(res.get("cycle") or 0)
        if res.get("path"):
            r.traces.append((cycle, str(res["path"])))
        for f in res.get("files") or []:
            if isinstance(f, dict) and f.get("kind") == "memory_report" and f.get("path"):
                r.memory_pages.append((cycle, str(f["path"])))
        if st.get("mode") == "gpu":
            r.mode = "gpu"
        s = st["steps"]
        for i, step in enumerate(s["step"]):
            if step in r.steps:
                continue
            r.steps[step] = (
                s["ms"][i],
                s["compute_ms"][i],
                s["collective_ms"][i],
                s["idle_ms"][i],
                s["gap_ms"][i],
            )
            r.starts[step] = (cycle, s["start_us"][i])
            if "wait_ms" in s:
                r.waits[step] = s["wait_ms"][i]
        r.profiled_steps += int(st.get("steps_total") or len(s["step"]))
        _add(r.ops, st.get("ops") or [], 2)
        _add(r.gpu_ops, st.get("gpu_ops") or [], 2)
        _add(r.collectives, st.get("collectives") or [], 2)
        for dev, m in (st.get("memory") or {}).items():
            r.memory[dev] = max(r.memory.get(dev, 0), int(m["peak_allocated"]))
    return r if found else None


def _summary(r: RankData, steps: Sequence[int]) -> RankSummary:
    rows = [r.steps[s] for s in steps] or list(r.steps.values())
    if not rows:
        return RankSummary(0.0, 0.0, 0.0, 0.0)
    n = len(rows)
    return RankSummary(*(round(sum(x[c] for x in rows) / n, 3) for c in range(4)))


def _ops(ranks: Sequence[RankData]) -> list[OpRow]:
    """The operators with the most time across ranks; outliers: far above the median rank."""
    totals: dict[str, float] = {}
    for r in ranks:
        for name, ms in r.ops.items():
            totals[name] = totals.get(name, 0.0) + r.per_step(ms)
    out = []
    for name in sorted(totals, key=lambda n: (-totals[n], n))[:REPORT_OPS]:
        # A rank that does not list it had it below its own top-N: 0 is the honest floor.
        vals = [r.per_step(r.ops.get(name, 0.0)) for r in ranks]
        med = median(vals)
        mad = median(abs(v - med) for v in vals)
        cut = med + max(3 * MAD_SIGMA * mad, 0.25 * med, 0.05)
        hi = max(range(len(vals)), key=lambda i: (vals[i], -i))
        outliers = tuple(sorted((i for i, v in enumerate(vals) if v > cut), key=lambda i: -vals[i]))
        out.append(
            OpRow(name, round(med, 3), round(min(vals), 3), round(vals[hi], 3), hi, outliers)
        )
    return out


#: What the operator tables count, said under each of them (docs/reports.md says it at length).
OPS_NOTE = (
    "ms per step: an operator's self time (in it and in none of the operators it calls) over"
    " the profiled steps, the median rank's. Wall-clock: calls that overlap (gloo runs a"
    " collective on several threads) or nest count once. Python frames (--with-stack) are call"
    " sites, not operators, and profd's own work is left out."
)


def ops_over_step(report: Report) -> list[OpRow]:
    """Operators whose median time per step is above the median step (time outside the
    profiled steps counts too: a trace opens before its first step and closes after its last)."""
    step = report.median_step_ms
    return [o for o in report.ops if step and o.median_ms > step]


def over_step_note(report: Report) -> str:
    over = ops_over_step(report)
    if not over:
        return ""
    names = ", ".join(o.name for o in over[:3]) + (" and more" if len(over) > 3 else "")
    return (
        f"{names}: more per step than the median step ({report.median_step_ms:.2f} ms), since"
        " an operator's time also counts what ran outside the profiled steps (before the first,"
        " after the last)."
    )


def versus_peers(summaries: Sequence[RankSummary], k: int, col: int) -> tuple[float, float, float]:
    """Rank ``k``'s figure in summary column ``col``, its peers' (the median of the other
    ranks'), and the difference, at the precision the table prints them."""
    own = round(summaries[k][col], 2)
    peers = round(median(s[col] for i, s in enumerate(summaries) if i != k), 2)
    return own, peers, round(own - peers, 2)


def _peers_wait(summaries: Sequence[RankSummary], k: int) -> float:
    own, peers, _ = versus_peers(summaries, k, 2)
    return round(peers - own, 2)


def _why(ranks: Sequence[RankData], summaries: Sequence[RankSummary], k: int) -> str:
    """One sentence from the figures the rank table shows (means per step, its peers' the
    median of the other ranks'), so a reader can check every number in it against the table."""
    me = ranks[k]
    others = [r for i, r in enumerate(ranks) if i != k]
    comp, idle, coll = (versus_peers(summaries, k, col) for col in (1, 3, 2))
    if comp[2] >= idle[2]:
        deltas = {
            n: me.per_step(ms) - median(o.per_step(o.ops.get(n, 0.0)) for o in others)
            for n, ms in me.ops.items()
        }
        top = max(deltas, key=lambda n: (deltas[n], n), default=None)
        most = ""
        if top is not None and deltas[top] > 0.1 * comp[2]:
            most = f"; most in {top}: +{deltas[top]:.2f} ms"
        what = (
            f"it computes {comp[2]:.2f} ms more per step than its peers"
            f" ({comp[0]:.2f} against {comp[1]:.2f} ms{most})"
        )
    else:
        what = (
            f"it is idle {idle[2]:.2f} ms more per step than its peers, outside any operator"
            f" ({idle[0]:.2f} against {idle[1]:.2f} ms: Python, data loading, sleeps)"
        )
    waited: dict[str, float] = {}
    for o in others:
        for n, ms in o.collectives.items():
            waited[n] = waited.get(n, 0.0) + ms
    where = f", in {max(waited, key=lambda n: (waited[n], n))}" if waited else ""
    wait = _peers_wait(summaries, k)
    return (
        f"rank {me.rank} ({me.label}) is the one the others wait for: {what},"
        f" and its peers wait {wait:.2f} ms more per step in collectives than it does"
        f" ({coll[1]:.2f} against {coll[0]:.2f} ms{where})"
    )


def _rank_steps(ranks: Sequence[RankData], steps: Sequence[int]) -> list[RankSteps]:
    """What the straggler rule compares: per step, each rank's wait in collectives (the
    collective part where a rank's statistics predate the wait, for every rank alike) and
    its time outside them."""
    waits = all(s in r.waits for r in ranks for s in steps)
    return [
        RankSteps(
            [r.waits[s] if waits else r.steps[s][2] for s in steps],
            [r.steps[s][0] - r.steps[s][2] for s in steps],
        )
        for r in ranks
    ]


def build_report(session: Mapping[str, Any]) -> Report:
    ranks: list[RankData] = []
    skipped = 0
    for t in session.get("targets") or []:
        rd = rank_data(t)
        if rd is None:
            skipped += 1
        else:
            ranks.append(rd)
    ranks.sort(key=lambda r: (r.rank, r.role, r.host))
    common: set[int] | None = None
    for r in ranks:
        common = set(r.steps) if common is None else common & set(r.steps)
    steps = sorted(common or ())
    summaries = [_summary(r, steps) for r in ranks]
    med_step = median(s.step_ms for s in summaries) if summaries else 0.0
    verdict = find_stragglers(_rank_steps(ranks, steps), med_step)
    stragglers = [
        Straggler(
            i,
            f"{_why(ranks, summaries, i)}, and it arrived last at {last} of {verdict.steps} steps",
            _peers_wait(summaries, i),
            lead,
        )
        for i, lead, last in zip(verdict.stragglers, verdict.lead_ms, verdict.last, strict=True)
    ]
    return Report(
        session=str(session.get("id", "")),
        job=str(session.get("job", "")),
        ranks=ranks,
        steps=steps,
        summaries=summaries,
        verdict=verdict,
        stragglers=stragglers,
        ops=_ops(ranks),
        skipped=skipped,
    )


def verdict_text(report: Report) -> str:
    if report.stragglers:
        return "; ".join(s.why for s in report.stragglers)
    v = report.verdict
    if v.candidate is not None:
        # The rule's sentence with the rank named: which one, and how many steps to capture.
        who = report.ranks[v.candidate]
        return v.reason.replace("the rank that waits least", f"rank {who.rank} ({who.label})", 1)
    return f"no straggler: {v.reason}"


def merge_sessions(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One session from several nodes' manifests (or ``show`` answers) of the same id."""
    first = dict(parts[0])
    first["targets"] = [t for p in parts for t in p.get("targets") or []]
    return first


def spotlight(report: Report, key: int = 2) -> list[tuple[str, int]]:
    """Ranks to show when there are too many for a row each: the stragglers, then the ranks
    at fixed percentiles of a summary column (``key``: 2 is collective wait), labelled."""
    n = len(report.ranks)
    order = sorted(range(n), key=lambda i: (report.summaries[i][key], i))
    picks: list[tuple[str, int]] = [("straggler", s.index) for s in report.stragglers]
    for label, q in (("min", 0.0), ("p5", 0.05), ("p50", 0.5), ("p95", 0.95), ("max", 1.0)):
        picks.append((label, order[round(q * (n - 1))]))
    return picks
