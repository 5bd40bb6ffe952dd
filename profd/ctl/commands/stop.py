"""profctl stop / cancel: end a session early (stop keeps what was captured)."""

from __future__ import annotations

import click

from profd import control_schema as C
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json, say


def _end(env: Env, request: str, session: str, verb: str) -> None:
    """Every node that has the session ends it; those that do not know it are not errors,
    unless no node does."""
    g = env.gather(request, session=session)
    rows = [a.node.named(dict(a.data)) for a in g.answered()]
    if env.json:
        emit_json(env.per_node(rows))
        return
    ids = ", ".join(sorted({r["session"] for r in rows}))
    where = f" on {len(rows)} node(s)" if env.nodes.remote else ""
    say(f"session {ids}: {verb}{where}")


@click.command()
@click.argument("session")
@click.pass_obj
@command
def stop(env: Env, session: str) -> None:
    """Stop SESSION now; a capture in progress is kept and processed.

    Ranks whose capture had not begun end cancelled ("stopped before its capture began").
    SESSION: the id or any unique part of it."""
    _end(env, C.C_STOP, session, "stopping")


@click.command()
@click.argument("session")
@click.pass_obj
@command
def cancel(env: Env, session: str) -> None:
    """Cancel SESSION (the id or any unique part of it); a capture in progress is
    discarded."""
    _end(env, C.C_CANCEL, session, "cancelling")
