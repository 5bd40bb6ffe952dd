"""profctl retry: put failed uploads back in the queue now instead of at the next start."""

from __future__ import annotations

import click

from profd import control_schema as C
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json, say


@click.command()
@click.argument("session", required=False)
@click.pass_obj
@command
def retry(env: Env, session: str | None) -> None:
    """Requeue failed (and interrupted) uploads, of one SESSION or all (with --cluster: on
    every node)."""
    if session:
        from profd.ctl.commands.sessions import show_session

        session = show_session(env, session)["id"]  # accepts short ids
    rows = [a.node.named(dict(a.data)) for a in env.gather(C.C_RETRY, session=session).answered()]
    if env.json:
        emit_json(env.per_node(rows))
    else:
        n = sum(r["requeued"] for r in rows)
        say(f"requeued {n} upload(s)" if n else "nothing to retry")
