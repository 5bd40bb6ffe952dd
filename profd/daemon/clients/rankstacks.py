"""Every thread's stack of attached ranks, from whichever source can read them: py-spy from
outside first (a wedged process still answers), then the rank's own agent thread for the
ranks py-spy may not trace (another user, Yama's ptrace scope). ``profctl stacks`` and the
hang rule both read through here, so both say the same about the same ranks.

Where a rank's flight recorder is on (its hello said ``flight``), its agent thread is asked
for its summary as well, whatever py-spy read: only the process itself can dump it.

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
        self,
        clients: list[Client],
        done: Callable[[Rows], None],
        native: bool = False,
        answer_s: float | None = None,
    ) -> None:
        """Every client's rank row (``stackgroups``), in the order of ``clients``; py-spy
        adds native frames when ``native``; agent threads have ``answer_s`` seconds to
        answer (default: ``AgentStacks``').

        Flight recorders are asked for first, beside py-spy's reads, not after them: a read
        that pauses a process past three heartbeats makes its agent reconnect, and a
        question sent meanwhile to its old routing id is lost."""
        flights: dict[int, dict[str, Any]] = {}
        read: list[Rows] = []
        left = [1]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                rows = read[0]
                for i, got in flights.items():
                    rows[i].update(got)
                done(rows)

        def flight_of(i: int) -> Callable[..., None]:
            def got(answer: dict[str, Any] | None, why: str | None) -> None:
                if answer is None:
                    flights[i] = {"flight_error": f"no flight recorder: {why}"}
                else:
                    flights[i] = {k: answer[k] for k in ("flight", "flight_error") if k in answer}
                one_done()

            return got

        agent = self.agent
        if agent is not None:
            for i, c in enumerate(clients):
                if c.flight:
                    left[0] += 1
                    agent.ask(c, flight_of(i), stacks=False, flight=True, timeout=answer_s)

        def stacks_read(rows: Rows) -> None:
            read.append(rows)
            one_done()

        self.reader.read(
            [target(c) for c in clients],
            lambda rows: self._fallback(clients, rows, stacks_read, answer_s),
            native,
        )

    def _fallback(
        self,
        clients: list[Client],
        rows: Rows,
        done: Callable[[Rows], None],
        answer_s: float | None,
    ) -> None:
        """Ranks py-spy could not read are asked for their own stacks (their agent thread),
        unless they are gone."""
        agent = self.agent
        ask = []
        for row, was in zip(rows, clients, strict=True):
            # The same process, re-registered or not (a long read pauses it past three
            # heartbeats, and its agent then reconnects under a new routing id).
            c = self.registry.lookup(was.key)
            if c is None:
                continue
            if row["source"] is None and not str(row.get("error", "")).startswith(
                "the process exited"
            ):
                ask.append((row, c))
        if agent is None or not ask:
            done(rows)
            return
        left = [len(ask)]

        def answered(row: dict[str, Any], c: Client) -> Callable[..., None]:
            def got(answer: dict[str, Any] | None, why: str | None) -> None:
                if answer is None:
                    row["error"] = f"{row['error']}; {why}"
                else:
                    threads = answer["threads"]
                    stackgroups.mark_training(threads, c.training_tid)
                    row["source"], row["threads"] = "agent", threads
                    row["error"] = f"read by its agent thread ({row['error']})"
                left[0] -= 1
                if left[0] == 0:
                    done(rows)

            return got

        for row, c in ask:
            agent.ask(c, answered(row, c), timeout=answer_s)
