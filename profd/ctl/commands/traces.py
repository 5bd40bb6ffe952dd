"""profctl traces: query the index (one row per rank per cycle)."""

from __future__ import annotations

import re
import time
from typing import Any

import click

from profd import control_schema as C
from profd.ctl.errors import CtlError
from profd.ctl.main import Env, command
from profd.ctl.nodes import NodeLike
from profd.ctl.render import Column, ago, emit_json, opt, say, size, steps_text, table

COLUMNS: list[Column] = [
    ("SESSION", lambda r: r["session"]),
    ("ROLE", lambda r: r["role"]),
    ("RANK", lambda r: r["rank"]),
    ("CYCLE", lambda r: r["cycle"]),
    ("STEPS", lambda r: steps_text(r["steps"])),
    ("SIZE", lambda r: size(r["bytes"])),
    ("STALL", lambda r: opt(r["stall_ms"], "{:.0f}ms")),
    ("UPLOAD", lambda r: r["upload_state"]),
    ("CREATED", lambda r: ago(r["created_at"])),
    ("PATH", lambda r: r["s3_uri"] or r["path"]),
]
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str) -> float:
    """``90s``, ``30m``, ``2h``, ``7d`` ago, or a unix timestamp."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if m:
        return time.time() - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return float(text)
    except ValueError:
        raise CtlError(f"--since {text!r}: use a duration like 30m, 2h, 7d") from None


@click.command()
@click.option("--job")
@click.option("--session")
@click.option("--rank", type=int)
@click.option("--role", help="Role glob.")
@click.option("--host")
@click.option("--since", help="Only newer than this: 30m, 2h, 7d.")
@click.option("--limit", default=100, show_default=True)
@click.option("--s3", "s3_url", help="List straight from S3 manifests (no daemon needed).")
@click.pass_obj
@command
def traces(env: Env, /, s3_url: str | None, since: str | None, **kw: Any) -> None:
    """Captured traces, newest first."""
    if s3_url:
        from profd.ctl.commands.s3list import list_from_s3

        rows = list_from_s3(s3_url, since=parse_since(since) if since else None, **kw)
    else:
        filters = {k: v for k, v in kw.items() if v is not None}
        if since:
            filters["since"] = parse_since(since)
        rows = node_traces(env, filters)
    columns = [("HOST", lambda r: r["host"]), *COLUMNS] if env.nodes.remote else COLUMNS
    if env.json:
        emit_json(rows)
    else:
        say(table(rows, columns) if rows else "no traces")


def node_traces(env: Env, filters: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node's trace rows, newest first, the newest ``limit`` of them.

    ``--host`` names a node or a client's own hostname: a node whose rows keep the client's
    hostname filters by it itself; a cluster node's rows are named by the node, so profctl
    filters those (the daemon only knows its clients' hostnames)."""
    host = filters.get("host")
    without_host = {k: v for k, v in filters.items() if k != "host"}

    def each(node: NodeLike) -> dict[str, Any]:
        return {"filters": filters if node.local else without_host}

    rows = env.gather(C.C_TRACES, each=each).rows()
    rows = [r for r in rows if host is None or host in (r["host"], r.get("client_host"))]
    return sorted(rows, key=lambda r: -(r.get("created_at") or 0))[: filters["limit"]]
