"""The state vocabulary of sessions and targets, and the one rule that combines them.

A target (one process in a session) goes ``pending → armed → capturing → processing`` and
ends ``done``, ``failed`` or ``cancelled``. A session's state is not stored by anyone who
could disagree: it is :func:`combine` of its targets' states on one node (the daemon's
``Session``), of its nodes' states across a cluster (``profctl sessions``/``show``), and of
the nodes that ran it as ``profctl --cluster start --wait`` follows them. The index's SQL,
``pull`` and the benchmarks ask "has it ended?" of :data:`TERMINAL`, built into SQL by
:func:`sql_terminal`.

The rule, and why:

- While any part is live, the session is as far along as its least advanced live part:
  "capturing" means every part has at least been armed.
- When every part has ended: ``done`` if all are done; ``partial`` if some are done (or
  ``partial``) and some not: there are traces to look at, and the user must know that some
  ranks are missing from them; ``cancelled`` only if every part was cancelled; else
  ``failed``.

``cancelled`` is decided once, that way. A cancel that came after some ranks had their traces
is ``partial`` (one node cancelled and one done is ``partial``: the done node's traces exist
and are worth pulling). A part that failed on its own (a process that had exited, a node that
never started or stopped answering) keeps the session ``failed`` even if the rest was
cancelled: ``cancelled`` would hide a failure the user did not ask for, and the session's
error names the operator's cancel anyway.

Because ``partial`` counts as "some done" and live states take the least advanced, the rule
gives the same answer whether a cluster session is combined from all its targets at once or
node by node (``combine(map(combine, nodes)) == combine(all targets)``): a node's state and
the cluster's state can never tell different stories. The unit tests check that property.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

#: Live states, least advanced first.
LIVE: Final = ("pending", "armed", "capturing", "processing")
#: A session (or a node's copy of one) in one of these has ended and will not change.
TERMINAL: Final = frozenset({"done", "partial", "failed", "cancelled"})
#: Every state a session can be in (the control protocol's vocabulary: a training job never
#: sees a session's state, so these are not the client's).
STATES: Final = frozenset(LIVE) | TERMINAL
#: How a target (one process of a session) ends: never ``partial``.
TARGET_TERMINAL: Final = TERMINAL - {"partial"}
#: (What a client reports when its part is over is the agent protocol's vocabulary:
#: ``profd_client.protocol.REPORT_TERMINAL``.)
__all__ = ["LIVE", "STATES", "TARGET_TERMINAL", "TERMINAL", "combine", "is_terminal",
           "sql_terminal"]  # fmt: skip

_RANK: Final = {s: i for i, s in enumerate(LIVE)}


def is_terminal(state: str) -> bool:
    return state in TERMINAL


def combine(states: Iterable[str]) -> str:
    """One session state from the states of its parts (targets, or nodes): see the module
    docstring for the rule. Raises ValueError for no parts or a state not in :data:`STATES`."""
    parts = set(states)
    if not parts:
        raise ValueError("no states to combine")
    unknown = parts - STATES
    if unknown:
        raise ValueError(f"not session states: {sorted(unknown)}")
    live = parts & _RANK.keys()
    if live:
        return min(live, key=_RANK.__getitem__)
    if parts == {"done"}:
        return "done"
    if parts & {"done", "partial"}:
        return "partial"
    if parts == {"cancelled"}:
        return "cancelled"
    return "failed"


def sql_terminal(column: str = "state") -> str:
    """``column IN (...)``: the SQL form of :data:`TERMINAL` (the names are constants)."""
    return f"{column} IN ({', '.join(repr(s) for s in sorted(TERMINAL))})"
