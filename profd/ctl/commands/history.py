"""profctl history: a job's step times per minute, from the index (the job may be gone)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import click

from profd import control_schema as C
from profd.ctl.errors import BadUsage, CtlError
from profd.ctl.main import Env, command
from profd.ctl.nodes import Answer
from profd.ctl.render import Column, emit_json, opt, say, table
from profd.watch.stats import weighted_quantile
from profd_client.protocol.envelope import ErrorCode

#: A minute whose p50 is at least this many times the first minute shown (of its role) is
#: marked: "when did it get slower?" reads off the column.
SLOWER = 1.2
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_when(text: str, flag: str, now: float | None = None) -> float:
    """``90s``, ``30m``, ``2h``, ``7d`` ago, an ISO time (local unless it names its zone),
    or unix seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if m:
        return (time.time() if now is None else now) - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise BadUsage(
            f"{flag} {text!r}: use a duration like 90s, 30m, 2h, 7d or a time like 2026-01-31T14:00"
        ) from None


def merge(answers: Sequence[Answer]) -> list[dict[str, Any]]:
    """Nodes' ``history`` minutes as one list per (minute, role), oldest first: ranks and
    steps summed, p50/p90 the median of the nodes' values weighted by their ranks (an
    approximation: the nodes' ranks' own p50s are not sent), max the max, ``slowest`` the
    3 highest p50s over all nodes, each naming its node."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for a in answers:
        node = a.data.get("node")
        for r in a.data["minutes"]:
            slowest = [a.node.named({**s, "node": node}) for s in r["slowest"]]
            groups.setdefault((r["minute"], r["role"]), []).append({**r, "slowest": slowest})
    out = []
    for (minute, role), rows in sorted(groups.items()):
        if len(rows) == 1:
            out.append(rows[0])
            continue
        maxes = [r["max_ms"] for r in rows if r["max_ms"] is not None]
        slowest = sorted(
            (s for r in rows for s in r["slowest"]),
            key=lambda s: (-(s.get("p50_ms") or 0.0), s.get("host", ""), s.get("rank", 0)),
        )
        out.append(
            {
                "minute": minute,
                "role": role,
                "ranks": sum(r["ranks"] for r in rows),
                "steps": sum(r["steps"] for r in rows),
                "p50_ms": _weighted(rows, "p50_ms"),
                "p90_ms": _weighted(rows, "p90_ms"),
                "max_ms": max(maxes) if maxes else None,
                "slowest": slowest[:3],
            }
        )
    return out


def _weighted(rows: list[dict[str, Any]], key: str) -> float | None:
    return weighted_quantile(((r[key], r["ranks"]) for r in rows if r[key] is not None), 0.5)


def mark_slower(minutes: list[dict[str, Any]]) -> None:
    """Set ``vs_first`` on each row: its p50 over the first p50 shown for its role (None for
    that first one and where unknown)."""
    first: dict[str, float] = {}
    for r in minutes:
        p50 = r.get("p50_ms")
        base = first.get(r["role"])
        r["vs_first"] = None
        if p50 is None or p50 <= 0:
            continue
        if base is None:
            first[r["role"]] = p50
        else:
            r["vs_first"] = p50 / base


def _when(minutes: list[dict[str, Any]]) -> Column:
    days = {time.strftime("%Y-%m-%d", time.localtime(r["minute"])) for r in minutes}
    fmt = "%H:%M" if len(days) <= 1 else "%m-%d %H:%M"
    return ("TIME", lambda r: time.strftime(fmt, time.localtime(r["minute"])))


def _slowest(r: dict[str, Any]) -> str:
    return ", ".join(
        f"{s.get('host')} r{s.get('rank')} {opt(s.get('p50_ms'), '{:.1f}ms')}" for s in r["slowest"]
    )


def _change(r: dict[str, Any]) -> str:
    v = r.get("vs_first")
    return f"+{(v - 1.0) * 100:.0f}%" if v is not None and v >= SLOWER else ""


COLUMNS: list[Column] = [
    ("ROLE", lambda r: r["role"]),
    ("RANKS", lambda r: r["ranks"]),
    ("STEPS", lambda r: r["steps"]),
    ("P50 MS", lambda r: opt(r["p50_ms"], "{:.1f}")),
    ("P90 MS", lambda r: opt(r["p90_ms"], "{:.1f}")),
    ("MAX MS", lambda r: opt(r["max_ms"], "{:.1f}")),
    ("SLOWER", _change),
    ("SLOWEST RANKS", _slowest),
]


@click.command()
@click.option("--job", required=True, help="The job (its exact name).")
@click.option(
    "--since",
    default="1h",
    show_default=True,
    help="From: a duration ago (90s, 30m, 2h, 7d) or a time (2026-01-31T14:00, local).",
)
@click.option("--until", help="Up to: a duration ago or a time (default: now).")
@click.pass_obj
@command
def history(env: Env, job: str, since: str, until: str | None) -> None:
    """A job's step times per minute and role, from the daemon's index: ranks, steps, the
    median over ranks of each rank's p50 and p90, the longest step and the slowest ranks.
    SLOWER marks a minute whose p50 is 20% or more above the first minute shown (of its
    role). Closed minutes only: the minute running now is not shown yet.

    With --cluster the nodes' minutes are merged: ranks and steps summed, p50 and p90 the
    median of the nodes' values weighted by their ranks (an approximation), max the max."""
    now = time.time()
    t0 = parse_when(since, "--since", now)
    t1 = parse_when(until, "--until", now) if until else now
    if t0 >= t1:
        raise BadUsage("--since must be before --until")
    answers = env.gather(C.C_HISTORY, job=job, since=t0, until=t1).answered()
    minutes = merge(answers)
    if not minutes:
        raise CtlError(
            f"no step times for job {job!r} from {_clock(t0)} to {_clock(t1)}",
            code=ErrorCode.NOT_FOUND,
        )
    # A daemon answers a range with too many rank-minutes for its newest ones only.
    covered = max(float(a.data["since"]) for a in answers)
    if covered > t0:
        say(
            f"profctl: too many minutes for one answer: from {_clock(covered)} on only"
            " (narrow --since)",
            err=True,
        )
    if env.json:
        if env.nodes.remote:
            emit_json({"job": job, "since": covered, "until": t1, "minutes": minutes})
        else:
            emit_json(answers[0].data)
        return
    mark_slower(minutes)
    say(table(minutes, [_when(minutes), *COLUMNS]))


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
