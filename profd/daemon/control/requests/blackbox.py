"""``blackbox``: the black boxes of a job's ranks on this node, collected from their agent
threads within ``COLLECT_S``; answered later."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from profd import control_schema as C
from profd.daemon.clients.blackbox_collect import Collected
from profd.daemon.control.requests.context import Context, Handler, Later
from profd.daemon.runtime.peers import Requester
from profd.scheduling.refusal import Refused
from profd_client.protocol import ErrorCode


def blackbox(ctx: Context, m: dict[str, Any], by: Requester) -> Later:
    collector = ctx.blackboxes
    if collector is None:
        raise Refused(ErrorCode.UNSUPPORTED, "this daemon collects no black boxes")
    job = m["job"]
    ranks = m.get("ranks")
    clients = [
        c
        for c in ctx.registry.by_identity()
        if c.job == job and (ranks is None or c.rank in ranks) and by.may_act_on(c.uid)
    ]
    node = ctx.facts.host

    def start(reply: Callable[[Any], None]) -> None:
        t0 = time.monotonic()

        def finish(got: Collected) -> None:
            reply(
                {
                    "job": job,
                    "node": node,
                    "boxes": got.boxes,
                    "missing": got.missing_maps(),
                    "collect_s": time.monotonic() - t0,
                }
            )

        collector.collect(clients, finish, first=ranks or ())

    return Later(start)


HANDLERS: dict[str, Handler] = {C.C_BLACKBOX: blackbox}
