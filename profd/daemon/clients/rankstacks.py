"""Every thread's stack of attached ranks, from whichever source can read them: py-spy from
outside first (a wedged process still answers), then the rank's own agent thread for the
ranks py-spy may not trace (another user, Yama's ptrace scope). ``profctl stacks`` and the
hang rule both read through here, so both say the same about the same ranks.

Owned by the event loop: ``done`` runs on the loop, once every rank answered or timed out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from profd.daemon.clients.agentstacks import AgentStacks
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.clients.stacks import StackReader, StackTarget
from profd.watch import stackgroups

Rows = list[dict[str, Any]]


def target(c: Client) -> StackTarget:
    return StackTarget(c.host, c.role, c.rank, c.pid, c.node_pid or c.pid, c.training_tid)


class RankStacks:
    def __init__(self, reader: StackReader, agent: AgentStacks | None, registry: Registry) -> None:
        self.reader = reader
        self.agent = agent
        self.registry = registry

    def read(
        self, clients: list[Client], done: Callable[[Rows], None], native: bool = False
    ) -> None:
        """Every client's rank row (``stackgroups``), in the order of ``clients``; py-spy
        adds native frames when ``native``."""
        self.reader.read(
            [target(c) for c in clients],
            lambda rows: self._fallback(clients, rows, done),
            native,
        )

    def _fallback(self, clients: list[Client], rows: Rows, done: Callable[[Rows], None]) -> None:
        """Ranks py-spy could not read are asked for their own stacks (their agent thread),
        unless they are gone."""
        agent = self.agent
        ask = [
            (row, c)
            for row, c in zip(rows, clients, strict=True)
            if row["source"] is None
            and self.registry.get(c.ident) is c
            and not str(row.get("error", "")).startswith("the process exited")
        ]
        if agent is None or not ask:
            done(rows)
            return
        left = [len(ask)]

        def answered(row: dict[str, Any], c: Client) -> Callable[..., None]:
            def got(threads: Rows | None, why: str | None) -> None:
                if threads is not None:
                    stackgroups.mark_training(threads, c.training_tid)
                    row["source"], row["threads"] = "agent", threads
                    row["error"] = f"read by its agent thread ({row['error']})"
                else:
                    row["error"] = f"{row['error']}; {why}"
                left[0] -= 1
                if left[0] == 0:
                    done(rows)

            return got

        for row, c in ask:
            agent.ask(c, answered(row, c))
