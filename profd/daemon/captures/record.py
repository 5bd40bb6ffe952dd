"""One capture report, from its arrival to its result: the only shape a capture has.

A process's ``captured`` message is read once, checked against the session it names, into a
:class:`CaptureReport`; that record goes into the inbox (:meth:`CaptureReport.to_row`), to a
pipeline worker, and back with its :class:`Outcome`, which the results commit. A daemon that
restarts reads the same record back from the inbox (:meth:`CaptureReport.from_row`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Protocol

from profd import claims
from profd.pipeline.process import ProcessedTrace
from profd.store import layout
from profd_client import protocol as P


class Reporter(Protocol):
    """The process a report is about, as its session's target knows it."""

    @property
    def host(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def role(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def stem(self) -> str: ...


@dataclass(frozen=True)
class CaptureReport:
    """A process's report that it wrote one cycle's capture (or failed to)."""

    session_id: str
    #: The training job, from the session: never what the client claims (it names paths).
    training_job: str
    host: str
    pid: int
    role: str
    rank: int
    world_size: int
    cycle: int
    #: The revision of the session's steps the process was armed with (``plan`` on the wire).
    revision: int
    #: The process's, from the kernel; -1 in an inbox row of an older daemon.
    uid: int
    gid: int
    steps: tuple[int, ...]
    #: (kind, path) as the client reported them; checked to be its own before this is built.
    files: tuple[tuple[str, str], ...]
    started_at: float
    ended_at: float
    stall_ms: float
    #: What failed, as the client says: with a trace, the capture is ``partial``.
    error: str | None = None
    notes: tuple[str, ...] = ()
    region: str | None = None
    torch: str | None = None
    device: str | None = None
    #: The name its outputs take in the cycle dir: its target's (:mod:`profd.claims`), never
    #: the client's. Empty (an inbox row of an older daemon): ``{role}-r{rank}``.
    stem: str = ""

    def __post_init__(self) -> None:
        if not self.stem:
            object.__setattr__(self, "stem", self.raw_stem)

    @classmethod
    def from_message(
        cls, m: P.Captured, training_job: str, who: Reporter, uid: int, gid: int
    ) -> CaptureReport:
        """A validated ``captured`` message of process ``who`` in a session of ``training_job``."""
        return cls(
            session_id=m.session,
            training_job=training_job,
            host=who.host,
            pid=who.pid,
            role=who.role,
            rank=who.rank,
            world_size=who.world_size,
            cycle=m.cycle,
            revision=m.plan,
            uid=uid,
            gid=gid,
            steps=tuple(m.steps),
            files=tuple((f.kind, f.path) for f in m.files),
            started_at=m.started_at,
            ended_at=m.ended_at,
            stall_ms=m.stall_ms,
            error=m.error,
            region=m.region,
            torch=m.torch,
            device=m.device,
            notes=tuple(m.notes),
            stem=who.stem,
        )

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> CaptureReport:
        """The record of an inbox row (:meth:`to_row`, or an older daemon's full message)."""
        m, cl = row["report"], row["client"]
        who = _Who(**{k: cl[k] for k in _WHO}, stem=cl.get("stem") or "")
        # The row is ours (a validated report, stored), so built as it is, not checked again;
        # an older daemon's row may lack what a report says by default.
        report = P.Captured(
            v=P.VERSION,
            id=0,
            session=m["session"],
            job=m["job"],
            cycle=m["cycle"],
            steps=m.get("steps") or [],
            files=[P.FileEntry(f["kind"], f["path"]) for f in m.get("files") or ()],
            started_at=m.get("started_at", 0.0),
            ended_at=m.get("ended_at", 0.0),
            stall_ms=m.get("stall_ms", 0.0),
            error=m.get("error"),
            region=m.get("region"),
            torch=m.get("torch"),
            device=m.get("device"),
            notes=m.get("notes") or [],
            plan=m.get("plan", 0),
        )
        return cls.from_message(report, m["job"], who, cl.get("uid", -1), cl.get("gid", -1))

    def to_row(self) -> dict[str, Any]:
        """The inbox row: the report under its wire names, and who sent it."""
        return {
            "report": {
                "session": self.session_id,
                "job": self.training_job,
                "cycle": self.cycle,
                "plan": self.revision,
                "steps": list(self.steps),
                "files": [{"kind": k, "path": p} for k, p in self.files],
                "started_at": self.started_at,
                "ended_at": self.ended_at,
                "stall_ms": self.stall_ms,
                "error": self.error,
                "region": self.region,
                "torch": self.torch,
                "device": self.device,
                "notes": list(self.notes),
            },
            "client": {
                "host": self.host,
                "pid": self.pid,
                "role": self.role,
                "rank": self.rank,
                "world_size": self.world_size,
                "uid": self.uid,
                "gid": self.gid,
                "stem": self.stem,
            },
        }

    @property
    def key(self) -> str:
        """Its inbox key: one report per process and cycle is processed."""
        return f"{self.session_id}/{self.host}/{self.pid}/{self.cycle}"

    @property
    def target(self) -> tuple[str, int]:
        """The key of its target in the session."""
        return (self.host, self.pid)

    @property
    def raw_stem(self) -> str:
        """The name its raw files share in its own dir: ``{role}-r{rank}`` as it was armed
        (``ArmedSession.stem``). Only its outputs are told apart from another claimant's:
        raw files never meet another process's."""
        return claims.stem(self.role, self.rank)

    @property
    def raw_dir(self) -> layout.Parts:
        """Where the process wrote its raw files, below the spool."""
        return layout.capture_parts(
            self.training_job, self.session_id, self.revision, self.host, self.pid, self.cycle
        )

    @property
    def raw_trace(self) -> str | None:
        """The name of its raw trace in :attr:`raw_dir` (the first the report names)."""
        return next((_name(p) for kind, p in self.files if kind == "trace"), None)

    @property
    def extras(self) -> list[tuple[str, str]]:
        """(kind, raw name) of its other raw files, moved beside the processed trace (renamed
        from :attr:`raw_stem` to :attr:`stem`, see :meth:`final_name`)."""
        trace = self.raw_trace
        out = [(kind, _name(p)) for kind, p in self.files]
        if trace is not None:
            out.remove(("trace", trace))
        return out

    def final_name(self, raw_name: str) -> str:
        """The name a raw file of it takes beside its processed trace."""
        raw = self.raw_stem
        return self.stem + raw_name[len(raw) :] if raw_name.startswith(raw) else raw_name

    @property
    def state(self) -> str:
        """A processed capture's state: ``partial`` when the client said something failed."""
        return "ok" if not self.error else "partial"


@dataclass(frozen=True)
class Outcome:
    """What became of one capture: handed back once, to be committed by the results."""

    capture: CaptureReport
    trace: ProcessedTrace | None = None
    error: str | None = None
    #: Not done: the inbox row stays open and the next daemon start processes it again.
    retry: bool = False
    #: The trace is several processes' (an nsys report of one launch): indexed for each.
    shared: bool = False


_WHO = ("host", "pid", "role", "rank", "world_size")


@dataclass(frozen=True)
class _Who:
    host: str
    pid: int
    role: str
    rank: int
    world_size: int
    stem: str


def _name(path: str) -> str:
    # The agent handler matched each path to the process's own files: only the name is used.
    return PurePosixPath(path).name
