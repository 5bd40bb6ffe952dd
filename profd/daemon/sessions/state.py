"""Sessions and their per-rank targets: the state machine. Owned by the event loop.

Session states: ``pending → armed → capturing → processing → done | partial | failed |
cancelled`` (the vocabulary and the rule that derives a session's state from its targets'
are :mod:`profd.states`). Each target (one process) has its own state and error. A target
ends when its client has said so (``done``/``stopped``/``cancelled``/``failed``) or has gone
away, and every capture it reported has been through the pipeline.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profd import claims
from profd.daemon.clients.registry import Client
from profd.daemon.runtime import faults
from profd.daemon.spool.clientfiles import made_dir
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.fsutil import atomic_write
from profd.scheduling.schedule import Cycle, steps_of
from profd.states import TARGET_TERMINAL, combine, is_terminal
from profd.store import layout
from profd.store.index import SessionRepo
from profd_client.protocol import REPORT_TERMINAL

#: The error of a target stopped (``profctl stop``) before its capture began.
STOPPED_EARLY = "stopped before its capture began"


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
    stop_asked: bool = False  # the operator asked to stop it (``profctl stop``)
    results: list[dict[str, Any]] = field(default_factory=list)
    #: The name its files share in a cycle dir, fixed when the session takes the target:
    #: ``{role}-r{rank}``, with ``-p{pid}`` when another of the session's processes claims the
    #: same role and rank (:mod:`profd.claims`). Empty: not decided yet, the plain name.
    stem: str = ""

    def __post_init__(self) -> None:
        self.stem = self.stem or claims.stem(self.role, self.rank)

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.pid)

    @property
    def identity(self) -> tuple[str, str, int, int]:
        """The process's identity when it was chosen (job, role, rank, world size)."""
        return (self.job, self.role, self.rank, self.world_size)

    # The questions asked of a target, each answered here once.
    @property
    def terminal(self) -> bool:
        """Ended: ``done``, ``failed`` or ``cancelled``; it will not change again."""
        return self.state in TARGET_TERMINAL

    @property
    def open(self) -> bool:
        """Not ended, and its client has not said it is over."""
        return not self.terminal and self.client_final is None

    @property
    def finished(self) -> bool:
        """Will capture nothing more: ended, its client said it is over, or its process left
        (its last captures may still be in the pipeline)."""
        return not self.open or self.gone

    @property
    def awaiting_arm(self) -> bool:
        """Should be sent ``arm`` (again): pending, with no report yet and not held."""
        return self.state == "pending" and self.client_final is None and not self.hold

    @property
    def claim(self) -> claims.Identity:
        """What only this process should claim: job, role and rank."""
        return (self.job, self.role, self.rank)

    @property
    def voidable(self) -> bool:
        """Open and not capturing yet: it may still be ended for a process that is no longer
        the one it was chosen as (a capture under way goes on under its old identity)."""
        return self.open and self.state in ("pending", "armed")

    def voided_by(self, identity: tuple[str, str, int, int]) -> bool:
        """Cancelled, and chosen as another identity than ``identity``: ended because its
        process re-registered as ``identity`` (``Attach._void_stale_targets``)."""
        return self.state == "cancelled" and self.identity != identity

    @property
    def reportable(self) -> bool:
        """Its capture has begun and is not through: a ``captured`` report may come for it."""
        return self.state in ("capturing", "processing")

    @property
    def begun(self) -> bool:
        """Its capture has begun (or is over, with traces): the session's steps can no longer
        move for it."""
        return bool(self.traces or self.outstanding) or self.reportable or self.state == "done"

    @classmethod
    def of(cls, c: Client, hold: bool = False) -> Target:
        return cls(c.host, c.pid, c.job, c.role, c.rank, c.world_size, hold=hold)

    # Transitions: only :class:`Sessions` calls these, and marks the change for the index.
    def _armed(self) -> None:
        if self.state == "pending":
            self.state = "armed"

    def _reported(self, state: str, error: str | None) -> None:
        if error:
            self.error = error[:1000]
        if state == "capturing" and self.state in ("pending", "armed"):
            self.state = "capturing"
        elif state in REPORT_TERMINAL:
            self.client_final = state
            self._settle()

    def _fail(self, why: str, gone: bool = False) -> None:
        self.client_final, self.error = "failed", why
        self.gone = self.gone or gone
        self._settle()

    def _cut(self, why: str) -> None:
        """Its session's time is up: the captures it reported stand (they go through the
        pipeline and count, as a stop's); with none, it did not get to its steps (``why``)."""
        if self.traces or self.outstanding:
            self.client_final = "stopped"
        else:
            self.client_final, self.error = "failed", why
        self._settle()

    def _gone(self, why: str | None) -> None:
        self.gone = True
        self.error = self.error or why
        self._settle()

    def _repend(self) -> None:
        if self.open:
            self.state, self.error = "pending", None

    def _processed(self, result: dict[str, Any], traced: bool, error: str | None) -> None:
        self.outstanding = max(0, self.outstanding - 1)
        if traced:
            self.traces += 1
        else:
            self.error = error
        self.results.append(result)
        self._settle()

    def _settle(self) -> None:
        """Derive the terminal state once nothing is outstanding."""
        if self.terminal:
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
        elif final == "stopped" and self.stop_asked and self.state in ("pending", "armed"):
            # The operator stopped it before its first step: nothing failed, and nothing was
            # kept. ``cancelled`` (not a state of its own) keeps the vocabulary every reader
            # of sessions already knows; the error says it was a stop. (A client stops its
            # sessions on its own too, when its process exits: that stays a failure.)
            self.state = "cancelled"
            self.error = self.error or STOPPED_EARLY
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
            "stem": self.stem,
            "updated_at": time.time(),
        }

    def stored(self, session: str) -> dict[str, Any]:
        """:meth:`row` and what a restarted daemon needs to finish the target."""
        return {**self.row(session), "final": self.client_final, "results": self.results}


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
    revision: int = 0
    #: The uid whose processes it captures (None: several uids, or unknown): a non-root
    #: profctl of that uid may stop or cancel it; files and manifests are that uid's.
    owner: int | None = None
    #: Monotonic time the current revision was planned (a late rank's delay counts from it).
    armed_at: float = field(default_factory=time.monotonic)

    @property
    def terminal(self) -> bool:
        return is_terminal(self.state)

    def arm_fields(self, incoming: Path) -> dict[str, Any]:
        """The ``arm`` message for this revision of the steps (the same for every target)."""
        fields: dict[str, Any] = {}
        if self.revision:
            # A stale capture of the old steps may still arrive: keep its files apart.
            incoming = incoming / layout.revision_dir(self.revision)
            fields = {"plan": self.revision}
        return dict(
            session=self.id,
            job=self.job,
            backend=self.backend,
            cycles=[list(x) for x in self.cycles],
            options=self.options,
            region=self.region,
            incoming=str(incoming),
            **fields,
        )

    def recompute(self) -> None:
        """Derive the session's state from its targets' (:func:`profd.states.combine`)."""
        ts = self.targets.values()
        if not ts:
            return
        self.state = combine(t.state for t in ts)
        if self.state in ("failed", "cancelled"):
            self.error = self.error or next((t.error for t in ts if t.error), None)

    @property
    def notes(self) -> list[str]:
        """What the session says beside its state: processes that claim one role and rank."""
        return claims.notes((t.role, t.rank, t.pid, t.stem) for t in self.targets.values())

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
            "plan": self.revision,
            "owner": self.owner,
            "error": self.error,
            "created_at": self.created_at,
            "updated_at": time.time(),
        }

    def summary(self) -> dict[str, Any]:
        d = self.row()
        d["steps"] = steps_of(self.cycles)
        d["targets"] = [t.stored(self.id) for t in self.targets.values()]
        d["notes"] = self.notes
        return d

    def manifest(self, node: str) -> dict[str, Any]:
        """``session.json``: request, resolved steps and per-rank results, from ``node``."""
        d = self.summary()
        d["node"] = node
        d["finished_at"] = time.time()
        return d


class Sessions:
    """In-memory sessions, mirrored to the index write-behind.

    Handlers call :meth:`save` for every change; the event loop calls :meth:`flush` once per
    iteration, which derives session states and writes every changed row in one transaction.
    A 1024-rank session thus costs one commit per burst of acks, not one per ack.
    """

    def __init__(self, rows: SessionRepo, spool: Path, perms: SpoolPerms, node: str) -> None:
        self.node = node  # this daemon's node name, in every manifest it writes
        self.rows = rows
        self.spool = spool
        self.perms = perms
        self.by_id: dict[str, Session] = {}
        # Session id -> (session, changed target keys; None means all of them).
        self._dirty: dict[str, tuple[Session, set[tuple[str, int]] | None]] = {}
        #: Finished sessions whose ``session.json`` is not written and indexed yet.
        self._owed: dict[str, Session] = {}

    def add(self, s: Session) -> None:
        """A new session, its targets chosen: processes among them that claim one identity
        get file names of their own, before anything is armed."""
        shared = claims.claimants((t.claim, t.pid) for t in s.targets.values())
        for t in s.targets.values():
            if t.claim in shared:
                t.stem = claims.stem(t.role, t.rank, t.pid)
        self.by_id[s.id] = s
        self.save(s)

    def exact(self, session_id: str) -> Session | None:
        """The live session with this id (what a user typed is resolved to one first:
        ``control.requests.sessions.session_id``)."""
        return self.by_id.get(session_id)

    def containing(self, part: str) -> list[str]:
        """Ids of live sessions that contain ``part``."""
        return [k for k in self.by_id if part in k]

    def taken(self, session_id: str) -> bool:
        """A live or finished session has this id (a coordinator's id must be new)."""
        return session_id in self.by_id or self.rows.has_session(session_id)

    def live(self) -> list[Session]:
        return [s for s in self.by_id.values() if not s.terminal]

    # --- transitions: each sequence exists once, here --------------------------------------
    def join(self, s: Session, t: Target) -> None:
        """A target joins a running session (a later rank under an ``[[auto]]`` rule). If
        another of its processes claims the same identity, the newcomer is named apart (the
        other may be capturing under its name already)."""
        if any(x.claim == t.claim and x.key != t.key for x in s.targets.values()):
            t.stem = claims.stem(t.role, t.rank, t.pid)
        s.targets[t.key] = t
        self.save(s, t)

    def armed(self, s: Session, t: Target) -> None:
        t._armed()
        self.save(s, t)

    def reported(self, s: Session, t: Target, state: str, error: str | None) -> None:
        t._reported(state, error)
        self.save(s, t)

    def fail(self, s: Session, t: Target, why: str, gone: bool = False) -> None:
        t._fail(why, gone)
        self.save(s, t)

    def gone(self, key: tuple[str, int], why: str | None) -> None:
        """The process left or died: its open targets in every live session end."""
        for s in self.live():
            t = s.targets.get(key)
            if t is not None and t.client_final is None:
                t._gone(why)
                self.save(s, t)

    def release(self, s: Session, t: Target) -> None:
        """A held target (waiting for ``nsys start``) may now be armed."""
        t.hold = False
        self.save(s, t)

    def queued(self, s: Session, t: Target) -> None:
        """A capture of ``t`` went into the pipeline."""
        t.outstanding += 1
        self.save(s, t)

    def processed(
        self, s: Session, t: Target, result: dict[str, Any], traced: bool, error: str | None
    ) -> None:
        """A capture is through the pipeline. The target row is written at once, in the
        caller's transaction with the trace and its inbox row: a daemon killed after that
        commit restarts with the result in the target, never with half of it."""
        before = (t.state, t.error, t.traces, t.outstanding, list(t.results))
        t._processed(result, traced, error)
        try:
            self.rows.save_target(t.stored(s.id))
        except Exception:
            # Not written (a full disk): the caller retries the whole result later.
            t.state, t.error, t.traces, t.outstanding, t.results = before
            raise
        self.save(s, t)

    def replan(self, s: Session, cycles: list[Cycle], now: float) -> None:
        """New steps for every open target; reports about the old revision become stale."""
        s.cycles = cycles
        s.revision += 1
        s.armed_at = now
        for t in s.targets.values():
            t._repend()
        self.save(s)

    def stopping(self, s: Session, t: Target) -> None:
        """The operator stops ``t``: a ``stopped`` report from its client is that stop."""
        t.stop_asked = True
        self.save(s, t)

    def cancel(self, s: Session, why: str) -> None:
        s.error = why
        self.save(s)

    def cut(self, s: Session, t: Target, why: str) -> None:
        """``s`` ran out of time (a sample that cannot complete) and ends with what it got:
        ``t``, still open, keeps the captures it reported, or fails with ``why``."""
        t._cut(why)
        self.save(s, t)

    def gone_from(self, s: Session, t: Target, why: str | None) -> None:
        t._gone(why)
        self.save(s, t)

    def save(self, s: Session, *targets: Target) -> None:
        """Mark a change for the next :meth:`flush` (no targets: every target changed)."""
        _, keys = self._dirty.get(s.id, (s, set()))
        if not targets or keys is None:
            self._dirty[s.id] = (s, None)
        else:
            keys.update(t.key for t in targets)
            self._dirty[s.id] = (s, keys)

    @property
    def changed(self) -> bool:
        """Changes wait for :meth:`flush`."""
        return bool(self._dirty)

    def flush(self) -> list[Session]:
        """Write every change; the sessions this flush finished (their manifests are owed)."""
        if not self._dirty:
            return []
        dirty, self._dirty = self._dirty, {}
        finished = []
        states = {sid: s.state for sid, (s, _) in dirty.items()}
        try:
            with self.rows.transaction():
                for s, keys in dirty.values():
                    was_terminal = s.terminal
                    s.recompute()
                    targets = s.targets.values() if keys is None else [s.targets[k] for k in keys]
                    for t in targets:
                        self.rows.save_target(t.stored(s.id))
                    self.rows.save_session(s.row())
                    if s.terminal and not was_terminal:
                        finished.append(s)
        except Exception:
            # A full disk or a locked database: keep every change for the next flush.
            for sid, (s, _) in dirty.items():
                s.state = states[sid]
                self._dirty.setdefault(sid, (s, None))
            raise
        for s in finished:
            # The index keeps it from now on; only its manifest is still to be written.
            self.by_id.pop(s.id, None)
            self._owed[s.id] = s
        return finished

    @property
    def manifests_owed(self) -> int:
        return len(self._owed)

    def write_manifests(self, indexed: Callable[[Session, Path], None]) -> Exception | None:
        """Write every owed ``session.json`` and hand it to ``indexed``; the first failure
        (a full disk, most likely, and then the rest would fail too) stops the round and
        is returned: the failed and the untried stay owed for the next round."""
        for sid, s in list(self._owed.items()):
            try:
                path = self._write_manifest(s)
                faults.point("manifest-written")
                indexed(s, path)
            except Exception as exc:
                return exc
            del self._owed[sid]
        return None

    def _write_manifest(self, s: Session) -> Path:
        with made_dir(self.spool, [self.perms.shared(s.job), self.perms.final(s.id)]):
            pass
        path = self.spool.joinpath(*layout.manifest_parts(s.job, s.id))
        atomic_write(
            path, json.dumps(s.manifest(self.node), indent=2, sort_keys=True), self.perms.file_mode
        )
        if s.owner is not None and os.geteuid() == 0:
            # Its processes' user reads it (and pull copies it); others do not.
            os.chown(path, s.owner, self.perms.group if self.perms.group is not None else -1)
        return path

    def busy_until(self, key: tuple[str, int]) -> int:
        """The first step a client is free of every live session's cycles."""
        end = 0
        for s in self.live():
            t = s.targets.get(key)
            if t is not None and not t.terminal and s.cycles:
                end = max(end, s.cycles[-1][2])
        return end

    def restore(self) -> list[Session]:
        """Sessions left open by a previous daemon, with their targets; finished sessions
        whose manifest it never wrote become owed again."""
        out = []
        for row in self.rows.open_sessions():
            s = _session_of(row)
            self.by_id[s.id] = s
            # Its state is derived again at the first flush: the previous daemon may have
            # died between a target's last result and the session row.
            self.save(s)
            out.append(s)
        for row in self.rows.unwritten_manifests():
            self._owed[row["id"]] = _session_of(row)
        return out

    def settle_restored(self) -> None:
        """After the inbox replay: restored targets with nothing left in the pipeline end
        as their client's last word says (it came before the restart and will not again)."""
        for s in self.live():
            for t in s.targets.values():
                if t.outstanding == 0 and not t.terminal:
                    t._settle()
                    self.save(s, t)


def _session_of(row: dict[str, Any]) -> Session:
    req = row["request"]
    s = Session(
        id=row["id"],
        job=row["job"],
        request=req,
        cycles=[tuple(c) for c in row["cycles"]],
        backend=row["backend"],
        options=req.get("options", {}),
        region=row["region"],
        label=row["label"],
        created_at=row["created_at"],
        state=row["state"],
        error=row["error"],
        revision=row["plan"],
        owner=row.get("owner"),
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
            client_final=t.get("final"),
            results=list(t.get("results") or []),
            stem=t.get("stem") or "",  # none in an older daemon's row: the plain name
        )
        s.targets[tgt.key] = tgt
    return s
