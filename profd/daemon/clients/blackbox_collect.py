"""Collecting the black boxes of a job's ranks on this node: every rank asked at once (the
ranks named first, then their peers), the answers gathered until a deadline. A rank whose
client keeps none (a client older than the black box, or ``PROFD_BLACKBOX=0``), that does
not answer in time, or that exits meanwhile is named with the reason, never waited for.

Owned by the event loop: ``done`` runs on the loop, once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from profd.blackbox.box import from_result
from profd.daemon.clients.agent_dumps import AgentBlackboxes
from profd.daemon.clients.fanin import FanIn
from profd.daemon.clients.registry import Client
from profd_client import protocol as P

#: Seconds the ranks have, together, to send their black boxes.
COLLECT_S = 5.0


class Missing(msgspec.Struct, frozen=True, kw_only=True):
    """A rank asked for its black box that gave none, and why."""

    job: str
    node: str
    host: str
    role: str
    rank: int
    pid: int
    world_size: int
    why: str


class Collected(msgspec.Struct, frozen=True):
    """What one collection got: the boxes in rank order (each a map as
    :func:`profd.blackbox.box.from_result` makes it, the form a Perfetto trace and an
    incident keep) and the ranks without one."""

    boxes: list[dict[str, Any]]
    missing: list[Missing]

    def missing_maps(self) -> list[dict[str, Any]]:
        """The ranks without a box as the ``blackbox`` reply and an incident's evidence
        name them."""
        return [msgspec.structs.asdict(m) for m in self.missing]


def who(c: Client, node: str) -> dict[str, Any]:
    return {
        "job": c.job,
        "node": node,
        "host": c.host,
        "role": c.role,
        "rank": c.rank,
        "pid": c.pid,
        "world_size": c.world_size,
    }


class BlackboxCollector:
    def __init__(self, agent: AgentBlackboxes, node: str) -> None:
        self.agent = agent
        self.node = node

    def collect(
        self,
        clients: list[Client],
        done: Callable[[Collected], None],
        first: Iterable[int] = (),
        deadline: float = COLLECT_S,
    ) -> None:
        """Ask every one of ``clients`` for its black box, the ranks in ``first`` before the
        others; ``done`` gets the boxes (in rank order) and the ranks without one."""
        front = set(first)
        order = sorted(clients, key=lambda c: (c.rank not in front, c.role, c.rank, c.pid))
        boxes: list[dict[str, Any]] = []
        missing: list[Missing] = []

        def finish() -> None:
            boxes.sort(key=lambda b: (b["role"], b["rank"], b["host"], b["pid"]))
            missing.sort(key=lambda m: (m.role, m.rank, m.host, m.pid))
            done(Collected(boxes, missing))

        asked = [c for c in order if c.blackbox]
        for c in order:
            if not c.blackbox:
                missing.append(
                    Missing(
                        **who(c, self.node),
                        why="its client keeps no black box (an older profd_client, or"
                        " PROFD_BLACKBOX=0)",
                    )
                )
        if not asked:
            finish()
            return
        parts = FanIn(len(asked), finish)

        def answered(c: Client) -> Callable[[P.BlackboxResult | None, str | None], None]:
            named = who(c, self.node)

            def got(m: P.BlackboxResult | None, why: str | None) -> None:
                if m is None:
                    missing.append(Missing(**named, why=str(why)))
                else:
                    try:
                        boxes.append(from_result(m, named))
                    except Exception as exc:  # one rank's bad box must not lose the others
                        missing.append(Missing(**named, why=f"unreadable black box: {exc!r}"))
                parts.arrived()

            return got

        for c in asked:
            self.agent.ask(c, answered(c), deadline)
