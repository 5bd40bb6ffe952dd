"""Following a session to its end, with per-rank progress on stderr."""

from __future__ import annotations

import time
from typing import Any

import click

from profd.ctl.errors import CtlError
from profd.ctl.main import Env
from profd.ctl.render import steps_text
from profd_client import protocol as P


def follow(
    env: Env, session: str, timeout: float, steps: list[int] | None = None
) -> dict[str, Any]:
    """Poll until the session is terminal; progress lines go to stderr, never stdout.

    ``steps`` are the steps announced at start: a ``--next`` session that reached a rank too
    late is moved to later steps by the daemon, and that move is reported here.
    """
    deadline = time.monotonic() + timeout if timeout else None
    last = ""
    while True:
        s: dict[str, Any] = env.conn.request(P.C_SHOW, session=session)
        if steps is not None and s["steps"] != steps:
            click.echo(
                f"[{time.strftime('%H:%M:%S')}] steps moved to {steps_text(s['steps'])}:"
                " a rank got them too late",
                err=True,
            )
            steps = s["steps"]
        line = f"{s['state']}: " + " ".join(
            f"{t['role']}:{t['rank']}={t['state']}" for t in s["targets"]
        )
        if line != last:
            click.echo(f"[{time.strftime('%H:%M:%S')}] {line}", err=True)
            last = line
        if s["state"] in P.SESSION_TERMINAL:
            for t in s["targets"]:
                if t["error"]:
                    click.echo(
                        f"  {t['role']}:{t['rank']} (pid {t['pid']}): {t['error']}", err=True
                    )
            return s
        if deadline is not None and time.monotonic() > deadline:
            raise CtlError(f"timed out waiting for session {session} (state {s['state']})")
        time.sleep(0.2)
