"""Following a session to its end, with per-rank progress on stderr."""

from __future__ import annotations

import time
from typing import Any

import click

from profd_client import protocol as P

from ..errors import CtlError
from ..main import Env

TERMINAL = ("done", "partial", "failed", "cancelled")


def follow(env: Env, session: str, timeout: float, quiet: bool = False) -> dict[str, Any]:
    """Poll until the session is terminal; progress lines go to stderr, never stdout."""
    deadline = time.monotonic() + timeout if timeout else None
    last = ""
    while True:
        s: dict[str, Any] = env.conn.request(P.C_SHOW, session=session)
        line = f"{s['state']}: " + " ".join(
            f"{t['role']}:{t['rank']}={t['state']}" for t in s["targets"]
        )
        if line != last:
            click.echo(f"[{time.strftime('%H:%M:%S')}] {line}", err=True)
            last = line
        if s["state"] in TERMINAL:
            for t in s["targets"]:
                if t["error"]:
                    click.echo(
                        f"  {t['role']}:{t['rank']} (pid {t['pid']}): {t['error']}", err=True
                    )
            return s
        if deadline is not None and time.monotonic() > deadline:
            raise CtlError(f"timed out waiting for session {session} (state {s['state']})")
        time.sleep(0.2)
