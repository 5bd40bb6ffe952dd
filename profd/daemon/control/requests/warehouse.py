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
    export, rows = ctx.warehouse, ctx.warehouse_rows
    if export is None or rows is None:
        raise Refused(
            ErrorCode.UNSUPPORTED, "the warehouse export is off here ([warehouse] enabled = false)"
        )
    # Read on the loop's connection after its changes are written: the overlays hold
    # everything indexed so far.
    ctx.flush()
    return {**export.describe(), "overlays": export.overlays(rows)}


HANDLERS: dict[str, Handler] = {C.C_WAREHOUSE: warehouse}
