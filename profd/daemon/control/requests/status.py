"""``status``: the daemon itself, its spool, its queue and the counters of its parts."""

from __future__ import annotations

import os
import time
from typing import Any

from profd import __version__
from profd import control_schema as C
from profd.daemon.control.requests.context import Context, Handler
from profd.daemon.runtime.peers import Requester
from profd_client import protocol as P


def status(ctx: Context, m: dict[str, Any], by: Requester) -> dict[str, Any]:
    f = ctx.facts
    total, unsafe = ctx.files.spool_usage()
    live = ctx.sessions.live()
    out: dict[str, Any] = {
        "version": __version__,
        "protocol": [P.MIN_VERSION, P.VERSION],
        "pid": os.getpid(),
        "host": f.host,
        "boot_id": f.boot_id,
        "uptime_s": round(time.time() - f.started, 1),
        "runtime_dir": str(f.runtime_dir),
        "state_dir": str(f.state_dir),
        "spool_dir": str(f.spool),
        "clients": len(ctx.registry),
        "incompatible_clients": len(ctx.registry.incompatible),
        "sessions": {
            "live": len(live),
            "by_state": {st: sum(s.state == st for s in live) for st in {s.state for s in live}},
        },
        "spool": {
            "bytes": total,
            "bytes_not_uploaded": unsafe,
            "max_bytes": f.max_spool_bytes,
        },
        "queue": ctx.queue.queue_stats(),
    }
    live_status = ctx.live_status()
    live_status["rejected_messages"] = live_status.get("rejected_messages", 0) + ctx.rejected()
    out.update(live_status)
    return out


HANDLERS: dict[str, Handler] = {C.C_STATUS: status}
