"""profctl sessions / show: what was asked, and how each rank fared."""

from __future__ import annotations

import click

from profd_client import protocol as P

from ..main import Env, command
from ..render import Column, ago, emit_json, opt, steps_text, table

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
    """List sessions, newest first."""
    rows = env.conn.request(P.C_SESSIONS, state=state, job=job, limit=limit)
    if env.json:
        emit_json(rows)
    else:
        click.echo(table(rows, COLUMNS) if rows else "no sessions")


@click.command()
@click.argument("session")
@click.pass_obj
@command
def show(env: Env, session: str) -> None:
    """One session: request, resolved steps, state per rank."""
    s = env.conn.request(P.C_SHOW, session=session)
    if env.json:
        emit_json(s)
        return
    click.echo(f"session {s['id']}  job {s['job']}  state {s['state']}  backend {s['backend']}")
    moved = s.get("plan") or 0
    note = f"  (moved {moved}x: a rank got earlier steps too late)" if moved else ""
    click.echo(f"steps   {steps_text(s['steps'])}  cycles {s['cycles']}{note}")
    if s["region"]:
        click.echo(f"region  {s['region']}")
    if s["error"]:
        click.echo(f"error   {s['error']}")
    click.echo(table(s["targets"], TARGET_COLUMNS))
