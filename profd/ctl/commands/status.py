"""profctl status: daemon health."""

from __future__ import annotations

import click

from profd_client import protocol as P

from ..main import Env, command
from ..render import emit_json, opt, size


@click.command()
@click.pass_obj
@command
def status(env: Env) -> None:
    """Daemon health: version, uptime, clients, sessions, upload queue, spool, S3."""
    st = env.conn.request(P.C_STATUS)
    if env.json:
        emit_json(st)
        return
    q, sp, s3 = st["queue"], st["spool"], st["s3"]
    lines = [
        f"profd {st['version']}  pid {st['pid']}  host {st['host']}  up {st['uptime_s']:.0f}s",
        f"runtime  {st['runtime_dir']}",
        f"spool    {st['spool_dir']}  {size(sp['bytes'])} ({size(sp['bytes_not_uploaded'])} not"
        f" uploaded, quota {size(sp['max_bytes']) if sp['max_bytes'] else 'none'})",
        f"clients  {st['clients']}",
        f"sessions {st['sessions']['live']} live"
        + "".join(f", {n} {k}" for k, n in sorted(st["sessions"]["by_state"].items())),
        f"pipeline {st['pipeline']['in_flight']} in flight",
        f"uploads  {q['queued']} queued, {q['failed']} failed, {size(q['bytes_pending'])} pending,"
        f" {q['uploaded']} uploaded",
    ]
    if s3.get("configured"):
        reach = {True: "reachable", False: "UNREACHABLE", None: "not checked yet"}[
            s3.get("reachable")
        ]
        lines.append(f"s3       {s3['url']}  {reach}{opt(s3.get('error'), '  ({})')}")
    else:
        lines.append("s3       not configured (traces stay in the spool)")
    click.echo("\n".join(lines))
