"""``traces``: the index's trace rows that match a filter."""

from __future__ import annotations

from typing import Any

from profd import control_schema as C
from profd.daemon.control.requests.context import Context, Handler
from profd.daemon.runtime.peers import Requester
from profd.scheduling.refusal import Refused
from profd.store.index import TraceFilter
from profd_client.protocol import ErrorCode


def traces(ctx: Context, m: dict[str, Any], by: Requester) -> list[dict[str, Any]]:
    ctx.flush()
    try:
        flt = TraceFilter.from_map(m["filters"])
    except (TypeError, ValueError) as exc:
        raise Refused(ErrorCode.BAD_REQUEST, str(exc)) from None
    rows = ctx.traces.traces(flt)
    ctx.stamp(rows)
    return rows


HANDLERS: dict[str, Handler] = {C.C_TRACES: traces}
