"""One module per family of control requests, as ``profd/ctl/commands/`` has one per profctl
command. Each module's ``HANDLERS`` maps its request types to their handlers; ``HANDLERS``
here is their union, which the router (``control/handler.py``) dispatches on."""

from __future__ import annotations

from profd.daemon.control.requests import (
    blackbox,
    processes,
    sessions,
    stacks,
    status,
    traces,
    warehouse,
    watch,
)
from profd.daemon.control.requests.context import Handler

FAMILIES = (status, processes, sessions, traces, watch, stacks, blackbox, warehouse)


def _table() -> dict[str, Handler]:
    table: dict[str, Handler] = {}
    for family in FAMILIES:
        for t, handler in family.HANDLERS.items():
            if t in table:  # two families answering one type: which one runs is an accident
                raise RuntimeError(f"control request {t!r} has two handlers")
            table[t] = handler
    return table


#: The handler of each request type: every type in ``P.CONTROL_INBOUND``, so a decoded
#: request always has one (tests/unit/test_protocol.py).
HANDLERS: dict[str, Handler] = _table()
