"""A switch for crash tests: ``PROFD_FAULT_KILL=<point>`` SIGKILLs the daemon at that point.

Recovery code is only trusted once a daemon has really died at each point of a capture's way
through it (``tests/test_crash_points.py``). Unset, each point costs one string comparison.
The points, in the order a capture passes them:

``report-acked``      the client's report is in the inbox and acked, not yet processed
``outputs-written``   a worker wrote the outputs (killed from the worker: the daemon dies)
``trace-indexed``     the trace, its inbox row and its target are committed; raw still there
``raw-deleted``       the raw trace is deleted; the session's new state is not flushed yet
``session-ended``     the session's final state is committed; ``session.json`` not written
``manifest-written``  ``session.json`` is written, not yet indexed

Off a capture's way: ``warehouse-written``, a warehouse object written and its partition not
yet unmarked (killed from the export thread); ``blackbox-collected``, an incident's black box
collected and not yet written (killed from the thread that writes it).
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "report-acked",
    "outputs-written",
    "trace-indexed",
    "raw-deleted",
    "session-ended",
    "manifest-written",
)

_AT = os.environ.get("PROFD_FAULT_KILL", "")


def point(name: str, daemon_pid: int | None = None) -> None:
    """SIGKILL the daemon (``daemon_pid``, default this process) if the switch names ``name``."""
    if name == _AT:
        os.kill(daemon_pid if daemon_pid is not None else os.getpid(), signal.SIGKILL)
