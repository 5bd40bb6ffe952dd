"""profctl incidents / incident: what the daemons noticed by themselves (docs/design.md "Watch")."""

from __future__ import annotations

import textwrap
import time
from typing import Any

import click

from profd import control_schema as C
from profd.ctl.commands.history import parse_when
from profd.ctl.errors import CtlError
from profd.ctl.main import Env, command
from profd.ctl.render import Column, ago, emit_json, line_block, opt, say, table
from profd.report.incident_compare import comparison_text
from profd.watch import hang_diagnosis as hang
from profd.watch.kinds import registry as kinds
from profd.watch.kinds.hang import KIND as HANG


def suspects_text(r: dict[str, Any]) -> str:
    return ", ".join(f"{s['role']} r{s['rank']}" for s in r.get("suspects") or []) or "job"


def _figure(r: dict[str, Any]) -> str:
    """The detector's main figure: how much slower."""
    ratio = (r.get("evidence") or {}).get("ratio")
    return f"{(float(ratio) - 1.0) * 100:+.0f}%" if isinstance(ratio, int | float) else "-"


def _host(r: dict[str, Any]) -> str:
    """A node, or the nodes of a hang merged across them."""
    hosts = r.get("hosts")
    return f"{len(hosts)} nodes" if hosts and len(hosts) > 1 else str(r["host"])


COLUMNS: list[Column] = [
    ("HOST", _host),
    ("ID", lambda r: r["id"]),
    ("KIND", lambda r: r["kind"]),
    ("JOB", lambda r: r["job"]),
    ("STATE", lambda r: r["state"]),
    ("SUSPECTS", suspects_text),
    ("SLOWER", _figure),
    ("STEP", lambda r: opt(r.get("step"))),
    ("DETECTED", lambda r: ago(r["detected_at"])),
    ("SESSION", lambda r: opt(r.get("session"))),
]


@click.command()
@click.option("--job", help="Only this job (its exact name).")
@click.option("--kind", type=click.Choice(kinds.names()))
@click.option(
    "--since", help="Detected since: a duration ago (90s, 30m, 2h, 7d) or a time (local)."
)
@click.option("--limit", default=1000, show_default=True, help="At most this many per node.")
@click.pass_obj
@command
def incidents(env: Env, job: str | None, kind: str | None, since: str | None, limit: int) -> None:
    """What the daemons noticed by themselves, newest first: a job that slowed down
    (regression), a rank slower than its role (slow_rank), a straggler; each with the ranks
    it names, how much slower, and its automatic capture; a job that stopped stepping (hang)
    with the ranks whose stacks are elsewhere. With --cluster one job's hang seen by
    several nodes is one row, its ranks grouped across nodes. --json: a list of
    incidents."""
    t0 = parse_when(since, "--since") if since else None
    rows = env.rows(C.C_INCIDENTS, job=job, kind=kind, since=t0, limit=limit)
    if env.nodes.remote:
        # One job's hang seen by several nodes is one hang: its ranks grouped together.
        rows = hang.merged(rows)
    rows.sort(key=lambda r: (-r["detected_at"], r["id"]))
    if env.json:
        emit_json(rows)
    else:
        say(table(rows, COLUMNS) if rows else "no incidents")


@click.command()
@click.argument("incident_id", metavar="ID")
@click.pass_obj
@command
def incident(env: Env, incident_id: str) -> None:
    """One incident: what was noticed, where, when, at which step, the detector's figures,
    and its capture with that session's state; for a hang, the ranks grouped by where
    their training thread is (with --cluster, every node's ranks of that hang together).

    ID: the id or any unique part of it."""
    doc = fetch_incident(env, incident_id)
    if doc["kind"] == HANG.name and env.nodes.remote:
        peers = env.rows(
            C.C_INCIDENTS,
            job=doc["job"],
            kind=HANG.name,
            since=doc["detected_at"] - 2 * hang.MERGE_S,
            limit=10000,
        )
        doc = hang.merged_with(doc, peers)
    if env.json:
        emit_json(doc)
        return
    say(text(doc))


def fetch_incident(env: Env, incident_id: str) -> dict[str, Any]:
    """The incident ``incident_id`` names, from whichever node has it (``host`` added)."""
    answers = env.gather(C.C_INCIDENT, id=incident_id).answered()
    ids = sorted({a.data["id"] for a in answers})
    if len(ids) > 1:
        raise CtlError(f"incident {incident_id!r} is ambiguous across nodes: {', '.join(ids)}")
    doc: dict[str, Any] = answers[0].node.named(answers[0].data)
    return doc


def text(d: dict[str, Any]) -> str:
    """``profctl incident``'s text."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["detected_at"]))
    lines = [
        f"incident {d['id']}  {d['kind']}  {d['state']}",
        f"job       {d['job']}" + (f"  role {d['role']}" if d.get("role") else ""),
        f"detected  {when} ({ago(d['detected_at'])}) on {d['host']}"
        + (f" at step {d['step']}" if d.get("step") is not None else ""),
        "suspects  "
        + (
            ", ".join(f"{s['role']} rank {s['rank']} on {s['host']}" for s in d["suspects"])
            or "the job (every rank)"
        ),
    ]
    if d["kind"] == HANG.name:
        lines += _hang_lines(d)
    else:
        ev = d["evidence"]
        if ev.get("why"):  # the rule's own sentence (a straggler's), on a line of its own
            lines.append(f"why       {ev['why']}")
        lines.append(
            "evidence  "
            + ", ".join(f"{k} {_num(v)}" for k, v in sorted(ev.items()) if k not in _OWN_LINES)
        )
    lines.append(
        f"lost      {lost_text(d.get('lost_rank_s'))}"
        + ("" if d.get("resolved_at") is not None else " so far")
    )
    if d.get("resolved_at") is not None:
        lines.append(f"resolved  {ago(d['resolved_at'])}")
    if d.get("session"):
        lines.append(f"session   {d['session']} ({d.get('session_state') or 'unknown'})")
    else:
        lines.append("session   none")
    lines += [f"note      {n}" for n in d.get("notes") or []]
    lines += _blackbox_lines(d["evidence"].get("blackbox"))
    if d.get("comparison"):
        lines += ["", *comparison_text(d["comparison"]).split("\n")]
    return line_block(lines)


#: Evidence shown on lines of its own, not among the figures.
_OWN_LINES = frozenset({"why", "blackbox", "spiked"})


def _blackbox_lines(bb: object) -> list[str]:
    """What the black box frozen when it opened shows, and where its trace is."""
    if not isinstance(bb, dict):
        return []
    lines = [
        f"blackbox  {bb.get('file')} ({bb.get('ranks_held', 0)} ranks,"
        f" frozen in {_num(bb.get('frozen_s'))}s)"
    ]
    lines += [f"          {t}" for t in textwrap.wrap(str(bb.get("paragraph", "")), 88)]
    for m in bb.get("missing") or []:
        lines.append(
            f"          no black box from {m.get('role')} rank {m.get('rank')}: {m.get('why')}"
        )
    return lines


def _hang_lines(d: dict[str, Any]) -> list[str]:
    ev = d["evidence"]
    hosts = d.get("hosts") or [d["host"]]
    lines = [
        f"stalled   no step for {_num(ev.get('stalled_s'))}s"
        f" (stall_after {_num(ev.get('stall_after_s'))}s)"
        + (f" on {len(hosts)} nodes: {', '.join(hosts)}" if len(hosts) > 1 else ""),
        f"verdict   {ev.get('verdict', '')}",
        "stacks",
    ]
    lines += [f"  {line}" for line in ev.get("summary") or ()]
    if ev.get("ranks_unread"):
        n = ev["ranks_unread"]
        lines.append(
            f"  {n} stored rank row{'s' * (n != 1)} did not read as rank rows: left out above"
        )
    return lines


def lost_text(v: object) -> str:
    """Rank-seconds, in the unit that reads best: ``1.8 rank-hours``."""
    s = float(v) if isinstance(v, int | float) else 0.0
    if s < 120:
        return f"{s:.0f} rank-seconds"
    if s < 3600:
        return f"{s / 60:.1f} rank-minutes"
    return f"{s / 3600:.1f} rank-hours"


def _num(v: object) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
