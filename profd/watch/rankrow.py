"""One rank's stacks while the daemon reads them (py-spy from outside, else the rank's agent
thread), on their way to a ``stacks`` reply or a hang incident: whether they were read, and
the rank's row (``stackrows.StackRank``, what the wire and the evidence carry)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from msgspec.structs import replace

from profd.watch.stackrows import Source, StackRank, Thread


class ReadStatus(enum.Enum):
    #: Its stacks were read (``source`` says by whom).
    READ = "read"
    #: Not read: py-spy could not (denied, too slow, absent); its agent thread may.
    UNREAD = "unread"
    #: The process exited while it was read: nothing can read it any more.
    EXITED = "exited"


@dataclass(frozen=True, slots=True)
class RankRow:
    status: ReadStatus
    stacks: StackRank

    def read_by_agent(self, threads: Sequence[Thread]) -> RankRow:
        """Its agent thread answered where py-spy could not read it."""
        s = self.stacks
        return RankRow(
            ReadStatus.READ,
            replace(
                s,
                source=Source.AGENT,
                threads=tuple(threads),
                error=f"read by its agent thread ({s.error})",
            ),
        )

    def unanswered(self, why: str) -> RankRow:
        """Its agent thread did not answer either."""
        return RankRow(self.status, replace(self.stacks, error=f"{self.stacks.error}; {why}"))

    def with_flight(self, flight: dict[str, Any] | None, error: str | None) -> RankRow:
        return RankRow(self.status, replace(self.stacks, flight=flight, flight_error=error))

    def on_node(self, node: str) -> StackRank:
        """Its row named by ``node`` (the daemon's), its own host name kept as
        ``client_host``."""
        s = self.stacks
        return s if s.host == node else replace(s, host=node, client_host=s.host)
