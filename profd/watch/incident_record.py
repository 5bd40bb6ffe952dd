"""An incident: what a detector noticed (docs/design.md "Watch", "Incidents"). Pure data.

The daemon's ``Incidents`` owns the live ones and their transitions (open -> resolved), keeps
them in the index and as ``{job}/incidents/{id}.json``; profctl reads them in this shape.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

OPEN, RESOLVED = "open", "resolved"
STATES = (OPEN, RESOLVED)
#: Evidence that shows what the job's processes run (function names, file paths, native
#: frames, flight-recorder records: a hang's stacks): seen by the job's owner, root and the
#: daemon's admin group only, as ``profctl stacks`` shows them.
STACK_EVIDENCE = ("ranks", "groups", "summary", "verdict", "flight", "blackbox")
#: How the verdict of an incident whose stacks the requester may not see begins.
WITHHELD = "stacks withheld:"


@dataclass(frozen=True)
class Suspect:
    host: str
    role: str
    rank: int

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "role": self.role, "rank": self.rank}


@dataclass
class Incident:
    """``evidence``: what the detector saw (its figures, thresholds and window), a map.
    ``session``: the automatic capture's session id, once armed; ``comparison``: what
    differs between the suspect and its peer once that capture is processed."""

    id: str
    kind: str
    job: str
    role: str | None
    host: str
    suspects: list[Suspect]
    detected_at: float  # unix time
    step: int | None  # the job's step when detected (the suspects' highest)
    evidence: dict[str, Any]
    session: str | None = None
    state: str = OPEN
    resolved_at: float | None = None
    comparison: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    #: The uid that owned the job when it was detected (None: not known).
    owner: int | None = None
    #: Rank-seconds its condition cost the job's ranks on this node (each kind's formula:
    #: ``Kind.loss``), counted while it is open, final once resolved. A record written before
    #: this was counted reads as 0.0: nothing was counted for it.
    lost_rank_s: float = 0.0
    #: Until when ``lost_rank_s`` is counted (unix time; None: not yet counted).
    lost_at: float | None = None

    def resolve(self, at: float) -> None:
        """Its condition cleared (``at``: unix time)."""
        self.state, self.resolved_at = RESOLVED, at

    def reopen(self, note: str) -> None:
        """Its condition came back (inside its job's cooldown): open again, saying when."""
        self.state, self.resolved_at = OPEN, None
        self.notes.append(note)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "job": self.job,
            "role": self.role,
            "host": self.host,
            "suspects": [s.to_dict() for s in self.suspects],
            "detected_at": self.detected_at,
            "step": self.step,
            "evidence": self.evidence,
            "session": self.session,
            "state": self.state,
            "resolved_at": self.resolved_at,
            "comparison": self.comparison,
            "notes": list(self.notes),
            "owner": self.owner,
            "lost_rank_s": self.lost_rank_s,
            "lost_at": self.lost_at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Incident:
        return cls(
            id=d["id"],
            kind=d["kind"],
            job=d["job"],
            role=d.get("role"),
            host=d["host"],
            suspects=[Suspect(s["host"], s["role"], int(s["rank"])) for s in d["suspects"]],
            detected_at=float(d["detected_at"]),
            step=d.get("step"),
            evidence=dict(d.get("evidence") or {}),
            session=d.get("session"),
            state=d.get("state", OPEN),
            resolved_at=d.get("resolved_at"),
            comparison=d.get("comparison"),
            notes=list(d.get("notes") or []),
            owner=d.get("owner"),
            lost_rank_s=float(d.get("lost_rank_s") or 0.0),
            lost_at=d.get("lost_at"),
        )


def has_stacks(evidence: dict[str, Any]) -> bool:
    return any(k in evidence for k in STACK_EVIDENCE)


def figures(evidence: dict[str, Any]) -> dict[str, Any]:
    """``evidence`` without what shows the job's code (:data:`STACK_EVIDENCE`)."""
    return {k: v for k, v in evidence.items() if k not in STACK_EVIDENCE}


def seen_by(doc: dict[str, Any], uid: int, privileged: bool) -> dict[str, Any]:
    """An incident (``Incident.to_dict()``) as the requester ``uid`` may see it: whole for
    the job's owner and the privileged, else its stacks withheld (the rest stays: that the
    job hangs, where, since when, which ranks)."""
    evidence = doc.get("evidence") or {}
    if privileged or doc.get("owner") == uid or not has_stacks(evidence):
        return doc
    owner = doc.get("owner")
    whose = "unknown owner's" if owner is None else f"uid {owner}'s"
    kept = figures(evidence)
    kept["verdict"] = (
        f"{WITHHELD} they are of {whose} processes (only that user, root and the"
        " daemon's admin group see them)"
    )
    kept["withheld"] = True
    return {**doc, "evidence": kept}


def is_withheld(evidence: dict[str, Any]) -> bool:
    """Whether ``evidence`` is a hang's with its stacks withheld (:func:`seen_by`). A daemon
    before the ``withheld`` flag sent the same evidence without it: a verdict but no ranks."""
    return evidence.get("withheld") is True or ("verdict" in evidence and "ranks" not in evidence)


def new_id(kind: str, now: float | None = None) -> str:
    """``20261124-213000-slow_rank-3f9a2c``: sortable by time, readable, unique."""
    t = time.gmtime(time.time() if now is None else now)
    return f"{time.strftime('%Y%m%d-%H%M%S', t)}-{kind}-{secrets.token_hex(3)}"
