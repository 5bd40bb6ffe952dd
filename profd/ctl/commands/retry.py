"""profctl retry: put failed uploads back in the queue now instead of at the next start."""

from __future__ import annotations

import click

from profd.ctl.main import Env, command
from profd.ctl.render import emit_json
from profd_client import protocol as P


@click.command()
@click.argument("session", required=False)
@click.pass_obj
@command
def retry(env: Env, session: str | None) -> None:
    """Requeue failed (and interrupted) uploads, of one SESSION or all."""
    if session:
        session = env.conn.request(P.C_SHOW, session=session)["id"]  # accepts short ids
    res = env.conn.request(P.C_RETRY, session=session)
    if env.json:
        emit_json(res)
    else:
        n = res["requeued"]
        click.echo(f"requeued {n} upload(s)" if n else "nothing to retry")
