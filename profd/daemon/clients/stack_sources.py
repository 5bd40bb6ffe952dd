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

from profd.daemon.clients.agent_dumps import AgentStacks
from profd.daemon.clients.fanin import FanIn
from profd.daemon.clients.pyspy_reader import StackReader, StackTarget
from profd.daemon.clients.registry import Client, Registry
from profd.watch import stackgroups
from profd.watch.rankrow import RankRow, ReadStatus
from profd.watch.stackrows import threads_of
from profd_client import protocol as P

Rows = list[RankRow]


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
        """Every client's rank row, in the order of ``clients``; py-spy adds native frames
        when ``native``; agent threads have ``answer_s`` seconds to answer (default:
        ``AgentStacks``').

        Flight recorders are asked for first, beside py-spy's reads, not after them: a read
        that pauses a process past three heartbeats makes its agent reconnect, and a
        question sent meanwhile to its old routing id is lost."""
        agent = self.agent
        flying = [i for i, c in enumerate(clients) if c.flight] if agent is not None else []
        flights: dict[int, tuple[dict[str, Any] | None, str | None]] = {}
        read: list[Rows] = []

        def all_in() -> None:
            rows = read[0]
            for i, (flight, error) in flights.items():
                rows[i] = rows[i].with_flight(flight, error)
            done(rows)

        # py-spy's reads (with the agents' for what py-spy could not read), and each flight.
        parts = FanIn(1 + len(flying), all_in)

        def flight_of(i: int) -> Callable[..., None]:
            def got(answer: P.StacksResult | None, why: str | None) -> None:
                if answer is None:
                    flights[i] = (None, f"no flight recorder: {why}")
                else:
                    flight, error = answer.flight, answer.flight_error
                    flights[i] = (
                        None if flight is P.UNSET else flight,
                        None if error is P.UNSET else error,
                    )
                parts.arrived()

            return got

        if agent is not None:
            for i in flying:
                agent.ask(clients[i], flight_of(i), stacks=False, flight=True, timeout=answer_s)

        def stacks_read(rows: Rows) -> None:
            read.append(rows)
            parts.arrived()

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
        for i, (row, was) in enumerate(zip(rows, clients, strict=True)):
            # The same process, re-registered or not (a long read pauses it past three
            # heartbeats, and its agent then reconnects under a new routing id).
            c = self.registry.lookup(was.key)
            if c is not None and row.status is ReadStatus.UNREAD:
                ask.append((i, c))
        if agent is None or not ask:
            done(rows)
            return
        out = list(rows)
        answers = FanIn(len(ask), lambda: done(out))

        def answered(i: int, c: Client) -> Callable[..., None]:
            def got(answer: P.StacksResult | None, why: str | None) -> None:
                if answer is None:
                    out[i] = out[i].unanswered(str(why))
                else:
                    threads = threads_of(answer.threads)
                    out[i] = out[i].read_by_agent(
                        stackgroups.mark_training(threads, c.training_tid)
                    )
                answers.arrived()

            return got

        for i, c in ask:
            agent.ask(c, answered(i, c), timeout=answer_s)
