"""The live registry of attached training processes. Owned by the event loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Client:
    ident: bytes  # ZeroMQ routing id of the client's DEALER socket
    host: str
    pid: int
    job: str
    role: str
    rank: int
    local_rank: int
    world_size: int
    step_mode: str
    allowed: bool
    torch: str | None
    device: str | None
    nsys_session: str | None = None  # launched by ``profctl run --nsys``
    attached_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    step: int = 0
    step_at: float = field(default_factory=time.monotonic)
    sps: float = 0.0
    state: str = "idle"
    #: Inside attach(), before step 1, until its welcome is sent (hello ``waiting``).
    attaching: bool = False
    cpu: float | None = None
    rss: int | None = None
    gpu_util: float | None = None
    gpu_mem: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.pid)

    def armable_from(self, done: int) -> int:
        """The first step a plan sent now can start at, with ``done`` steps completed.

        A plan takes effect at a step boundary, so the step running now (``done + 1``) is too
        late, except while the process still waits in attach(), before its first step.
        """
        return done + (1 if self.attaching else 2)

    def estimated_step(self, now: float | None = None) -> float:
        """Steps done by now, extrapolated from the last heartbeat."""
        t = time.monotonic() if now is None else now
        return self.step + self.sps * max(0.0, t - self.step_at)

    def row(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "pid": self.pid,
            "job": self.job,
            "role": self.role,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "step": self.step,
            "steps_per_s": round(self.sps, 2),
            "state": self.state,
            "step_mode": self.step_mode,
            "allowed": self.allowed,
            "cpu_percent": self.cpu,
            "rss_bytes": self.rss,
            "gpu_util": self.gpu_util,
            "gpu_mem_bytes": self.gpu_mem,
            "torch": self.torch,
            "device": self.device,
            "nsys_session": self.nsys_session,
            "attached_at": self.attached_at,
        }


class Registry:
    def __init__(self) -> None:
        self.by_ident: dict[bytes, Client] = {}
        self.by_key: dict[tuple[str, int], Client] = {}

    def __len__(self) -> int:
        return len(self.by_key)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self.by_key.values()))

    def add(self, c: Client) -> Client | None:
        """Register ``c``; returns the record it replaces (same process, new socket)."""
        old = self.by_key.get(c.key)
        if old is not None:
            self.by_ident.pop(old.ident, None)
        self.by_key[c.key] = c
        self.by_ident[c.ident] = c
        return old

    def remove(self, c: Client) -> None:
        self.by_ident.pop(c.ident, None)
        if self.by_key.get(c.key) is c:
            del self.by_key[c.key]

    def get(self, ident: bytes) -> Client | None:
        return self.by_ident.get(ident)

    def stale(self, now: float, timeout: float) -> list[Client]:
        return [c for c in self.by_key.values() if now - c.last_seen > timeout]
