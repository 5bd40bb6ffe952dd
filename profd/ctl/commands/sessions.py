"""profctl sessions / show: what was asked, and how each rank fared."""

from __future__ import annotations

from typing import Any

import click

from profd import control_schema as C
from profd.ctl.errors import CtlError
from profd.ctl.main import Env, command
from profd.ctl.nodes import Answer
from profd.ctl.render import Column, ago, emit_json, line_block, opt, say, steps_text, table
from profd.states import combine

COLUMNS: list[Column] = [
    ("SESSION", lambda r: r["id"]),
    ("JOB", lambda r: r["job"]),
    ("STATE", lambda r: r["state"]),
    ("BACKEND", lambda r: r["backend"]),
    ("STEPS", lambda r: steps_text([n for _, a, b in r["cycles"] for n in range(a, b)])),
    ("CREATED", lambda r: ago(r["created_at"])),
    ("LABEL", lambda r: opt(r["label"])),
]
TARGET_COLUMNS: list[Column] = [
    ("HOST", lambda t: t["host"]),
    ("PID", lambda t: t["pid"]),
    ("ROLE", lambda t: t["role"]),
    ("RANK", lambda t: t["rank"]),
    ("STATE", lambda t: t["state"]),
    ("TRACES", lambda t: t["traces"]),
    ("ERROR", lambda t: opt(t["error"])),
]


@click.command()
@click.option("--state", help="Only sessions in this state.")
@click.option("--job", help="Only this job.")
@click.option("--limit", default=50, show_default=True)
@click.pass_obj
@command
def sessions(env: Env, state: str | None, job: str | None, limit: int) -> None:
    """List sessions, newest first (--cluster: the newest LIMIT rows of all nodes, one row
    per session per node)."""
    rows = env.rows(C.C_SESSIONS, state=state, job=job, limit=limit)
    # Each daemon's rows come newest first: this puts every node's in that order.
    rows = sorted(rows, key=lambda r: -(r.get("created_at") or 0))[:limit]
    columns = [("HOST", lambda r: r["host"]), *COLUMNS] if env.nodes.remote else COLUMNS
    if env.json:
        emit_json(rows)
    else:
        say(table(rows, columns) if rows else "no sessions")


@click.command()
@click.argument("session")
@click.pass_obj
@command
def show(env: Env, session: str) -> None:
    """One session: request, resolved steps, state per rank.

    SESSION: the id or any unique part of it (the random tail: 57ed8b)."""
    s = show_session(env, session)
    if env.json:
        emit_json(s)
        return
    moved = s.get("plan") or 0
    moves = f"  (moved {moved}x: a rank got earlier steps too late)" if moved else ""
    head = [
        f"session {s['id']}  job {s['job']}  state {s['state']}  backend {s['backend']}",
        f"steps   {steps_text(s['steps'])}  cycles {s['cycles']}{moves}",
    ]
    if s["region"]:
        head.append(f"region  {s['region']}")
    if s["error"]:
        head.append(f"error   {s['error']}")
    head += [f"note    {note}" for note in s.get("notes") or []]
    say(line_block(head))
    say(table(s["targets"], TARGET_COLUMNS))


def show_session(env: Env, session: str) -> dict[str, Any]:
    """The session as every node that knows it has it (see :func:`merge_shown`)."""
    return merge_shown(env.gather(C.C_SHOW, session=session).answered(), session)


def merge_shown(known: list[Answer], session: str) -> dict[str, Any]:
    """Nodes' ``show`` of one session as one document: its targets from all of them (each
    naming its node), its state combined, and ``nodes``: each node's own state."""
    ids = sorted({a.data["id"] for a in known})
    if len(ids) > 1:
        raise CtlError(f"session {session!r} is ambiguous across nodes: {', '.join(ids)}")
    nodes = [
        {
            "host": a.data.get("node") or a.node.address,
            "address": a.node.address,
            "state": a.data["state"],
            "error": a.data.get("error"),
        }
        for a in known
    ]
    merged: dict[str, Any] = dict(known[0].data)
    if len(known) > 1:
        merged.pop("node", None)  # on several nodes: on no one of them
    merged["targets"] = [a.node.named(t) for a in known for t in a.data["targets"]]
    merged["nodes"] = nodes
    merged["state"] = combine(n["state"] for n in nodes)
    why = sorted({str(n["error"]) for n in nodes if n["error"]})
    merged["error"] = "; ".join(why) or None
    several = len(known) > 1
    merged["notes"] = [
        f"{n['host']}: {note}" if several else note
        for a, n in zip(known, nodes, strict=True)
        for note in a.data.get("notes") or []  # (an older daemon's show has none)
    ]
    return merged
