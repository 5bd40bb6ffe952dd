"""One rank's stacks as the daemon reads them (py-spy from outside, else the rank's agent
thread) on their way to a ``stacks`` reply or a hang incident. Typed while the daemon holds
them; :meth:`RankRow.to_dict` gives the shape the wire and the incident evidence carry
(``protocol.STACK_RANK``, the rank map ``stackgroups`` groups), nowhere earlier."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

#: One frame as py-spy or the agent gives it: ``{"function", "file", "line", "native"?}``.
Frame = dict[str, Any]


class ReadStatus(enum.Enum):
    #: Its stacks were read (``source`` says by whom).
    READ = "read"
    #: Not read: py-spy could not (denied, too slow, absent); its agent thread may.
    UNREAD = "unread"
    #: The process exited while it was read: nothing can read it any more.
    EXITED = "exited"


class Source(enum.Enum):
    PYSPY = "py-spy"
    AGENT = "agent"


@dataclass(frozen=True, slots=True)
class StackThread:
    name: str
    tid: int
    frames: tuple[Frame, ...]  # innermost first
    #: The thread that counts the rank's steps (``stackgroups.mark_training``).
    training: bool
    owns_gil: bool | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StackThread:
        gil = d.get("owns_gil")
        return cls(
            name=str(d.get("name", "")),
            tid=int(d.get("tid", 0)),
            frames=tuple(d.get("frames") or ()),
            training=bool(d.get("training")),
            owns_gil=gil if isinstance(gil, bool) else None,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "tid": self.tid, "frames": list(self.frames)}
        if self.owns_gil is not None:
            out["owns_gil"] = self.owns_gil
        out["training"] = self.training
        return out


def threads_of(marked: Sequence[dict[str, Any]]) -> tuple[StackThread, ...]:
    """Threads as py-spy's parser or an agent's answer gives them, training thread marked."""
    return tuple(StackThread.from_dict(t) for t in marked)


@dataclass(frozen=True, slots=True)
class RankRow:
    host: str
    role: str
    rank: int
    pid: int
    status: ReadStatus
    source: Source | None = None
    threads: tuple[StackThread, ...] = ()
    #: Why it was not read (or how: "read by its agent thread (...)").
    error: str | None = None
    read_ms: float | None = None
    #: Its flight recorder's summary, or why there is none although it is on.
    flight: dict[str, Any] | None = None
    flight_error: str | None = None
    #: The name the rank's own host gave it, where the daemon names it by its node.
    client_host: str | None = None

    def read_by_agent(self, threads: tuple[StackThread, ...]) -> RankRow:
        """Its agent thread answered where py-spy could not read it."""
        return replace(
            self,
            status=ReadStatus.READ,
            source=Source.AGENT,
            threads=threads,
            error=f"read by its agent thread ({self.error})",
        )

    def unanswered(self, why: str) -> RankRow:
        """Its agent thread did not answer either."""
        return replace(self, error=f"{self.error}; {why}")

    def with_flight(self, flight: dict[str, Any] | None, error: str | None) -> RankRow:
        return replace(self, flight=flight, flight_error=error)

    def on_node(self, node: str) -> RankRow:
        """Named by ``node`` (the daemon's), its own host name kept as ``client_host``."""
        return self if self.host == node else replace(self, host=node, client_host=self.host)

    def to_dict(self) -> dict[str, Any]:
        """The rank map of the wire and of the incident evidence."""
        out: dict[str, Any] = {
            "host": self.host,
            "role": self.role,
            "rank": self.rank,
            "pid": self.pid,
            "source": None if self.source is None else self.source.value,
            "threads": [t.to_dict() for t in self.threads],
        }
        if self.read_ms is not None:
            out["read_ms"] = self.read_ms
        if self.error is not None:
            out["error"] = self.error
        if self.flight is not None:
            out["flight"] = self.flight
        if self.flight_error is not None:
            out["flight_error"] = self.flight_error
        if self.client_host is not None:
            out["client_host"] = self.client_host
        return out
