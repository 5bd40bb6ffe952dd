"""profctl stop / cancel: end a session early (stop keeps what was captured)."""

from __future__ import annotations

import click

from profd.ctl.errors import CtlError
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json
from profd_client import protocol as P


def _end(env: Env, request: str, session: str, verb: str) -> None:
    if env.cluster:
        _end_cluster(env, request, session, verb)
        return
    res = env.conn.request(request, session=session)
    emit_json(res) if env.json else click.echo(f"session {res['session']}: {verb}")


def _end_cluster(env: Env, request: str, session: str, verb: str) -> None:
    """Every node that has the session ends it; those that do not know it are not errors,
    unless no node does."""
    g = env.gather(request, session=session)
    rows = [{**a.data, "host": a.node.address} for a in g.ok]
    if not rows:
        errors = [a.error for a in g.answers if a.error is not None]
        other = [e for e in errors if e.code != "unknown_session"]
        raise (other or errors)[0] if errors else CtlError(f"no session {session!r}")
    if env.json:
        emit_json(rows)
    else:
        ids = ", ".join(sorted({r["session"] for r in rows}))
        click.echo(f"session {ids}: {verb} on {len(rows)} node(s)")


@click.command()
@click.argument("session")
@click.pass_obj
@command
def stop(env: Env, session: str) -> None:
    """Stop SESSION now; a capture in progress is kept and processed."""
    _end(env, P.C_STOP, session, "stopping")


@click.command()
@click.argument("session")
@click.pass_obj
@command
def cancel(env: Env, session: str) -> None:
    """Cancel SESSION; a capture in progress is discarded."""
    _end(env, P.C_CANCEL, session, "cancelling")
