"""Following a session to its end on every node it runs on, with progress on stderr."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from profd import control_schema as C
from profd.ctl.errors import StillLive
from profd.ctl.main import Env
from profd.ctl.nodes import Answer, NodeLike
from profd.ctl.render import say, steps_text
from profd.states import is_terminal

#: Polls in a row a node does not answer before it counts as lost (its daemon died).
LOST_AFTER = 3


@dataclass
class Followed:
    #: Each node's last ``show`` of the session, in the nodes' order (none from a node that
    #: never answered).
    answers: list[Answer]
    #: Nodes that stopped answering.
    lost: list[NodeLike]


def follow(
    env: Env,
    session: str,
    nodes: Sequence[NodeLike],
    timeout: float,
    steps: list[int] | None = None,
) -> Followed:
    """Poll every node's copy of the session until each has ended or is lost; progress
    lines go to stderr, never stdout. A node's refusal ends the wait (it has no such
    session to wait for).

    ``steps`` are the steps announced at start: a ``--next`` session that reached a rank too
    late is moved to later steps by the daemon, and that move is reported here.
    """
    deadline = time.monotonic() + timeout if timeout else None
    silent: dict[NodeLike, int] = {}
    last: dict[NodeLike, Answer] = {}
    line = ""
    while True:
        for a in env.nodes.ask(C.C_SHOW, {"session": session}, nodes):
            if a.error is not None:
                raise a.error
            if a.ok:
                last[a.node] = a
                silent.pop(a.node, None)
            else:
                silent[a.node] = silent.get(a.node, 0) + 1
        lost = [n for n in nodes if silent.get(n, 0) >= LOST_AFTER]
        shown = [last[n].data for n in nodes if n in last]
        for s in shown:
            if steps is not None and s["steps"] != steps:
                say(
                    f"[{time.strftime('%H:%M:%S')}] steps moved to {steps_text(s['steps'])}:"
                    " a rank got them too late",
                    err=True,
                )
                steps = s["steps"]
        now_line = _progress(nodes, last)
        if now_line != line:
            say(f"[{time.strftime('%H:%M:%S')}] {now_line}", err=True)
            line = now_line
        pending = [
            n
            for n in nodes
            if n not in lost and (n not in last or not is_terminal(last[n].data["state"]))
        ]
        if not pending:
            return Followed([last[n] for n in nodes if n in last], lost)
        if deadline is not None and time.monotonic() > deadline:
            if len(nodes) == 1 and shown:
                where = f"(state {shown[0]['state']})"
            else:
                where = "on " + ", ".join(n.address for n in pending)
            ctl = "profctl --cluster NODES" if env.nodes.remote else "profctl"
            raise StillLive(
                f"timed out waiting for session {session} {where}; it is still live:"
                f" `{ctl} show {session}` shows how it is doing, `{ctl} stop {session}`"
                f" ends it keeping what was captured, `{ctl} cancel {session}` discards it"
            )
        # Each poll is a request to every node: many nodes are asked less often.
        time.sleep(0.2 if len(nodes) == 1 else 0.3)


def _progress(nodes: Sequence[NodeLike], last: dict[NodeLike, Answer]) -> str:
    """One node: the session's state and each rank's; several: each node's state."""
    if len(nodes) == 1:
        if not last:
            return ""
        s = last[nodes[0]].data
        return f"{s['state']}: " + " ".join(
            f"{t['role']}:{t['rank']}={t['state']}" for t in s["targets"]
        )
    states = sorted((n.address, a.data["state"]) for n, a in last.items())
    return " ".join(f"{addr}={st}" for addr, st in states)


def echo_end(final: dict[str, Any], by_node: bool) -> None:
    """Why a followed session did not get everything: its error and each failed rank's, on
    stderr (``by_node``: each rank with its node)."""
    if final.get("error"):
        say(f"  {final['error']}", err=True)
    for t in final["targets"]:
        if t.get("error"):
            where = f"{t['host']} " if by_node else ""
            say(f"  {where}{t['role']}:{t['rank']} (pid {t['pid']}): {t['error']}", err=True)
