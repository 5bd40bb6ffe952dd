"""profctl status: daemon health."""

from __future__ import annotations

from typing import Any

import click

from profd_client import protocol as P

from ..main import Env, command
from ..render import ago, emit_json, size


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
        lines += s3_lines(s3)
    else:
        lines.append("s3       not configured (traces stay in the spool)")
    click.echo("\n".join(lines))


#: ``s3.health`` as the text status shows it.
HEALTH = {
    "ok": "reachable",
    "uploads_failing": "UPLOADS FAILING",
    "unreachable": "UNREACHABLE",
    "unknown": "not checked yet",
}


def s3_lines(s3: dict[str, Any]) -> list[str]:
    """The store's health and, while uploads fail, the last upload error and its age."""
    err, last = s3.get("error"), s3.get("last_upload_error")
    line = f"s3       {s3['url']}  {HEALTH.get(s3.get('health', ''), 'not checked yet')}"
    if err and err != last:
        line += f"  ({err})"
    out = [line]
    err_at, ok_at = s3.get("last_upload_error_at"), s3.get("last_upload_at")
    if last and err_at and (ok_at is None or err_at > ok_at):
        out.append(f"         last upload error {ago(err_at)}: {last}")
    return out
