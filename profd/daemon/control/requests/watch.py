"""What the daemon watched: step-time ``history`` and ``incidents``, both read from the index
(they outlive their job and this daemon's start)."""

from __future__ import annotations

import time
from typing import Any

from profd import control_schema as C
from profd.daemon.control.requests.context import Context, Handler
from profd.daemon.runtime.peers import Requester
from profd.scheduling.refusal import Refused
from profd.watch.incident_record import seen_by
from profd_client.protocol import ErrorCode

#: What ``history`` covers when the request gives no ``since``: the last hour.
HISTORY_DEFAULT_S = 3600.0


def history(ctx: Context, m: dict[str, Any], by: Requester) -> dict[str, Any]:
    # Minutes still open for live ranks are not in the index yet (the loop writes closed ones).
    now = time.time()
    since = m.get("since")
    until = m.get("until")
    since = now - HISTORY_DEFAULT_S if since is None else since
    until = now if until is None else until
    if since >= until:
        raise Refused(ErrorCode.BAD_REQUEST, "history: since must be before until")
    minutes, since = ctx.minutes.step_history(m["job"], since, until)
    return {
        "job": m["job"],
        "since": since,  # later than asked when the range held too many rows
        "until": until,
        "node": ctx.facts.host,
        "minutes": minutes,
    }


def incidents(ctx: Context, m: dict[str, Any], by: Requester) -> list[dict[str, Any]]:
    rows = ctx.incidents.rows(
        job=m.get("job"), kind=m.get("kind"), since=m.get("since"), limit=m.get("limit") or 1000
    )
    # As ``stacks`` does: another user's stacks are theirs to see.
    rows = [seen_by(r, by.uid, by.privileged) for r in rows]
    ctx.stamp(rows)
    return rows


def incident(ctx: Context, m: dict[str, Any], by: Requester) -> dict[str, Any]:
    ctx.flush()
    doc = seen_by(ctx.incidents.find(m["id"]), by.uid, by.privileged)
    doc["session_state"] = _session_state(ctx, doc.get("session"))
    ctx.stamp([doc])
    return doc


def _session_state(ctx: Context, sid: str | None) -> str | None:
    if sid is None:
        return None
    live = ctx.sessions.exact(sid)
    if live is not None:
        return live.state
    row = ctx.session_rows.session(sid)
    return None if row is None else str(row["state"])


HANDLERS: dict[str, Handler] = {
    C.C_HISTORY: history,
    C.C_INCIDENTS: incidents,
    C.C_INCIDENT: incident,
}
