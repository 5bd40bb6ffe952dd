"""Sessions and their per-rank targets: the state machine. Owned by the event loop.

Session states: ``pending → armed → capturing → processing → done | partial | failed |
cancelled``. Each target (one process) has its own state and error. A target is finished
when its client has said so (``done``/``stopped``/``cancelled``/``failed``) or has gone away,
and every capture it reported has been through the pipeline.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store.index import TERMINAL_SESSION_STATES, Index
from .registry import Client
from .schedule import Cycle, steps_of

TARGET_TERMINAL = frozenset({"done", "failed", "cancelled"})
_ORDER = ["pending", "armed", "capturing", "processing"]


def new_session_id() -> str:
    # Sortable by creation time, short enough to type.
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass
class Target:
    host: str
    pid: int
    job: str
    role: str
    rank: int
    world_size: int
    state: str = "pending"
    error: str | None = None
    traces: int = 0
    outstanding: int = 0  # captures reported and not yet through the pipeline
    client_final: str | None = None  # the client's terminal report
    gone: bool = False  # the process left or died
    hold: bool = False  # not to be armed yet (an nsys collection is still starting)
    results: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.pid)

    @classmethod
    def of(cls, c: Client) -> Target:
        return cls(c.host, c.pid, c.job, c.role, c.rank, c.world_size)

    def settle(self) -> None:
        """Derive the terminal state once nothing is outstanding."""
        if self.state in TARGET_TERMINAL:
            return
        final = self.client_final
        if final is None and not self.gone:
            return
        if self.outstanding:
            self.state = "processing"
            return
        if final == "cancelled":
            self.state = "cancelled"
        elif final in ("done", "stopped") and self.traces:
            self.state = "done"
        else:
            self.state = "failed"
            if self.error is None:
                self.error = "process exited before capturing" if self.gone else "no trace captured"

    def row(self, session: str) -> dict[str, Any]:
        return {
            "session": session,
            "host": self.host,
            "pid": self.pid,
            "job": self.job,
            "role": self.role,
            "rank": self.rank,
            "world_size": self.world_size,
            "state": self.state,
            "error": self.error,
            "traces": self.traces,
            "updated_at": time.time(),
        }


@dataclass
class Session:
    id: str
    job: str
    request: dict[str, Any]
    cycles: list[Cycle]
    backend: str
    options: dict[str, Any]
    region: str | None
    label: str | None
    created_at: float = field(default_factory=time.time)
    state: str = "pending"
    error: str | None = None
    targets: dict[tuple[str, int], Target] = field(default_factory=dict)
    auto_rule: int | None = None
    #: Revision of ``cycles``: bumped when a late rank makes the daemon re-plan ``--next``;
    #: client reports about an older revision are stale.
    plan: int = 0
    armed_at: float = 0.0  # monotonic time the current revision was first sent
    #: The ``arm`` frame is the same for every target: encoded once, on first use.
    arm_frame: bytes | None = field(default=None, repr=False)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_SESSION_STATES

    def recompute(self) -> None:
        ts = list(self.targets.values())
        if not ts:
            return
        states = {t.state for t in ts}
        if states <= TARGET_TERMINAL:
            done = sum(t.state == "done" for t in ts)
            if self.state == "cancelled" or states == {"cancelled"}:
                self.state = "cancelled"
            elif done == len(ts):
                self.state = "done"
            elif done:
                self.state = "partial"
            else:
                self.state = "failed"
                self.error = self.error or next((t.error for t in ts if t.error), None)
            return
        live = [s for s in states if s in _ORDER]
        # The session is as far along as its slowest live target.
        self.state = min(live, key=_ORDER.index) if live else self.state

    def row(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "job": self.job,
            "state": self.state,
            "backend": self.backend,
            "label": self.label,
            "region": self.region,
            "request": self.request,
            "cycles": [list(c) for c in self.cycles],
            "plan": self.plan,
            "error": self.error,
            "created_at": self.created_at,
            "updated_at": time.time(),
        }

    def summary(self) -> dict[str, Any]:
        d = self.row()
        d["steps"] = steps_of(self.cycles)
        d["targets"] = [t.row(self.id) for t in self.targets.values()]
        return d

    def manifest(self) -> dict[str, Any]:
        """``session.json``: request, resolved steps and per-rank results."""
        d = self.summary()
        by_key = {t.key: t for t in self.targets.values()}
        for row in d["targets"]:
            row["results"] = by_key[(row["host"], row["pid"])].results
        d["finished_at"] = time.time()
        return d


class Sessions:
    """In-memory sessions, mirrored to the index write-behind.

    Handlers call :meth:`save` for every change; the event loop calls :meth:`flush` once per
    iteration, which derives session states and writes every changed row in one transaction.
    A 1024-rank session thus costs one commit per burst of acks, not one per ack.
    """

    def __init__(self, index: Index, spool: Path) -> None:
        self.index = index
        self.spool = spool
        self.by_id: dict[str, Session] = {}
        # Session id -> (session, changed target keys; None means all of them).
        self._dirty: dict[str, tuple[Session, set[tuple[str, int]] | None]] = {}

    def add(self, s: Session) -> None:
        self.by_id[s.id] = s
        self.save(s)

    def get(self, session_id: str) -> Session | None:
        s = self.by_id.get(session_id)
        if s is None:
            hits = [v for k, v in self.by_id.items() if k.startswith(session_id)]
            s = hits[0] if len(hits) == 1 else None
        return s

    def live(self) -> list[Session]:
        return [s for s in self.by_id.values() if not s.terminal]

    def save(self, s: Session, *targets: Target) -> None:
        """Mark a change for the next :meth:`flush` (no targets: every target changed)."""
        _, keys = self._dirty.get(s.id, (s, set()))
        if not targets or keys is None:
            self._dirty[s.id] = (s, None)
        else:
            keys.update(t.key for t in targets)
            self._dirty[s.id] = (s, keys)

    def flush(self) -> list[tuple[Session, Path]]:
        """Write every change; returns the sessions this flush finished, with their manifest."""
        if not self._dirty:
            return []
        dirty, self._dirty = self._dirty, {}
        finished = []
        states = {sid: s.state for sid, (s, _) in dirty.items()}
        try:
            with self.index.transaction():
                for s, keys in dirty.values():
                    was_terminal = s.terminal
                    s.recompute()
                    targets = s.targets.values() if keys is None else [s.targets[k] for k in keys]
                    for t in targets:
                        self.index.save_target(t.row(s.id))
                    self.index.save_session(s.row())
                    if s.terminal and not was_terminal:
                        finished.append(s)
        except Exception:
            # A full disk or a locked database: keep every change for the next flush.
            for sid, (s, _) in dirty.items():
                s.state = states[sid]
                self._dirty.setdefault(sid, (s, None))
            raise
        return [(s, self.finish(s)) for s in finished]

    def finish(self, s: Session) -> Path:
        """Write ``session.json`` and forget the session from memory (the index keeps it)."""
        d = self.spool / s.job / s.id
        d.mkdir(parents=True, exist_ok=True)
        path = d / "session.json"
        tmp = d / ".session.json.tmp"
        tmp.write_text(json.dumps(s.manifest(), indent=2, sort_keys=True))
        os.replace(tmp, path)
        self.by_id.pop(s.id, None)
        return path

    def busy_until(self, key: tuple[str, int]) -> int:
        """The first step a client is free of every live session's cycles."""
        end = 0
        for s in self.live():
            t = s.targets.get(key)
            if t is not None and t.state not in TARGET_TERMINAL and s.cycles:
                end = max(end, s.cycles[-1][2])
        return end

    def restore(self) -> list[Session]:
        """Sessions left open by a previous daemon, with their targets."""
        out = []
        for row in self.index.open_sessions():
            req = row["request"]
            s = Session(
                id=row["id"],
                job=row["job"],
                request=req,
                cycles=[tuple(c) for c in row["cycles"]],  # type: ignore[misc]
                backend=row["backend"],
                options=req.get("options", {}),
                region=row["region"],
                label=row["label"],
                created_at=row["created_at"],
                state=row["state"],
                error=row["error"],
                plan=row["plan"],
            )
            for t in row["targets"]:
                tgt = Target(
                    t["host"],
                    t["pid"],
                    t["job"],
                    t["role"],
                    t["rank"],
                    t["world_size"],
                    state=t["state"],
                    error=t["error"],
                    traces=t["traces"],
                )
                s.targets[tgt.key] = tgt
            self.by_id[s.id] = s
            out.append(s)
        return out
