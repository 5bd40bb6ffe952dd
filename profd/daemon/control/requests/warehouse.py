"""``warehouse``: where this daemon exports its rows, and the rows it has not written yet
(one overlay per dirty partition), for profctl's warehouse queries on this node. Every job's
rows are in it, as ``traces``, ``history`` and ``incidents`` list every job."""

from __future__ import annotations

from typing import Any

from profd import control_schema as C
from profd.daemon.control.requests.context import Context, Handler
from profd.daemon.runtime.peers import Requester
from profd.scheduling.refusal import Refused
from profd_client.protocol import ErrorCode


def warehouse(ctx: Context, m: dict[str, Any], by: Requester) -> dict[str, Any]:
    if ctx.warehouse is None:
        raise Refused(ErrorCode.UNSUPPORTED, "this daemon exports no warehouse")
    ctx.flush()
    return ctx.warehouse()


HANDLERS: dict[str, Handler] = {C.C_WAREHOUSE: warehouse}
