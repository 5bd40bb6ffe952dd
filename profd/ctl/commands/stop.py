"""profctl stop / cancel: end a session early (stop keeps what was captured)."""

from __future__ import annotations

import click

from profd_client import protocol as P

from ..main import Env, command
from ..render import emit_json


def _end(env: Env, request: str, session: str, verb: str) -> None:
    res = env.conn.request(request, session=session)
    emit_json(res) if env.json else click.echo(f"session {res['session']}: {verb}")


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
