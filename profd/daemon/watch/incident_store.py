"""Incidents: every detection, kept (docs/design.md "Watch", "Incidents"). Owned by the event loop.

A detector calls :meth:`Incidents.open` each tick its rule reports something; the first call
opens an incident, later ones only say it still holds. At most one incident is open per
kind, job and rank (per kind and job for job-wide kinds, ``Kind.job_wide``); an incident is
resolved once its rule has not reported it for ``hold`` seconds. Each change goes to the
sinks it was given (:mod:`profd.daemon.watch.sinks`: the spool file
``{job}/incidents/{id}.json``, the index, the upload queue, the count on ``/metrics``), and
is logged at warning level.

An incident belongs to its job's owner (``Registry.owner``). Its log line names no frame.

While open, an incident counts what it costs (``lost_rank_s``, its kind's ``Kind.loss``) at
each detector tick of its job (:meth:`Incidents.count_loss`); resolved, it counts no more.

A cooldown per job (``[watch] cooldown``) bounds what a flapping job costs: a detection of a
kind, job and rank whose last incident was detected less than ``cooldown`` ago opens that
incident again instead of a new one, and a job gets at most one automatic capture per
cooldown. A restarted daemon holds the open incidents and the recent ones again (from the
index): its detectors, starting afresh, find the open ones still open and fire nothing new.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from profd.config import WatchConfig
from profd.daemon.sessions.state import Session
from profd.daemon.watch.sinks import Sink
from profd.report.incident_compare import comparison_from_index
from profd.scheduling.refusal import Refused
from profd.store.index import IncidentRepo, SessionRepo
from profd.watch.incident_record import OPEN, Incident, Suspect, figures, new_id
from profd.watch.kinds import registry as kinds
from profd.watch.kinds.kind import JobTick, RankSteps
from profd_client.protocol import ErrorCode

log = logging.getLogger("profd.watch")

#: The label of an incident's automatic capture: this, then the incident's id.
LABEL = "incident:"

#: An open incident whose ``lost_rank_s`` grew is written again at most this often (seconds),
#: not every tick: every sink writes a file, an index row and an upload per save. Reads of
#: the daemon (``profctl incident``, ``incidents``) show the figure in memory, current; a
#: restarted daemon goes on from the last one written.
LOSS_SAVE_S = 30.0

#: (kind, job, role, rank): what one open incident stands for (role and rank None: the job).
Key = tuple[str, str, str | None, int | None]
#: Arms an incident's capture; its session id. Raises :class:`Refused` when it cannot.
Capture = Callable[[Incident], str]
#: The uid that owns a job now (None: none of its processes is attached).
OwnerOf = Callable[[str], "int | None"]


def on_capture_processed(sessions: SessionRepo, incident: Incident, session: Session) -> None:
    """An incident's capture ended and its traces are processed (``session`` is terminal):
    what differs, suspect against peer per operator and per step, and for a regression the
    capture against the job's last sample before it (the ``diff`` engine, reading the index
    only). :meth:`Incidents.capture_ended` calls this from the loop's flush for every
    finished session labelled ``incident:ID`` and saves the incident again."""
    incident.comparison = comparison_from_index(sessions, incident, session.id)


class Incidents:
    """``index``: where incidents are read back from (``sinks`` write them there);
    ``capture``: arms an incident's capture (None: incidents capture nothing)."""

    def __init__(
        self,
        store: IncidentRepo,
        session_rows: SessionRepo,
        host: str,
        cfg: WatchConfig,
        sinks: Sequence[Sink],
        capture: Capture | None = None,
        clock: Callable[[], float] = time.time,
        owner_of: OwnerOf | None = None,
    ) -> None:
        self.store = store
        self.session_rows = session_rows
        self.owner_of = owner_of
        self.host = host
        self.cfg = cfg
        self.sinks = tuple(sinks)
        self.capture = capture
        self._clock = clock
        #: Open incidents, and resolved ones still inside their job's cooldown, by id.
        self.held: dict[str, Incident] = {}
        #: Each key's newest incident (open, or resolved inside the cooldown).
        self._by_key: dict[Key, str] = {}
        #: When each open incident was last reported by its rule (unix time), and how long
        #: it stays open without being reported again.
        self._seen: dict[str, float] = {}
        self._keep: dict[str, float] = {}
        #: When each job's last automatic capture was armed (unix time).
        self._captured: dict[str, float] = {}
        #: Incidents whose record could not be written (a full disk): tried again each tick.
        self._unsaved: set[str] = set()
        #: When each incident was last written (unix time): its loss waits for LOSS_SAVE_S.
        self._written: dict[str, float] = {}

    # --- the detectors' side --------------------------------------------------------------
    def open(
        self,
        kind: str,
        job: str,
        role: str | None,
        suspects: Sequence[Suspect],
        step: int | None,
        evidence: dict[str, Any],
        keep_for: float | None = None,
    ) -> Incident | None:
        """A rule reports ``kind`` in ``job`` for ``suspects``: a new incident, or None when
        each suspect (the job, for a job-wide kind) is already in an open incident (which
        now holds a while longer) or in one detected inside the job's cooldown (which opens
        again). ``keep_for``: seconds the incident stays open without being reported again
        (default ``[watch] hold``; a rule that reports only now and then, on samples, says
        how long it waits between two)."""
        if kinds.get(kind) is None:
            raise ValueError(f"unknown incident kind {kind!r}")
        now = self._clock()
        fresh: list[Suspect] = []
        held = False  # the job itself, for a job-wide kind
        for key, suspect in self._keys(kind, job, suspects):
            old = self.held.get(self._by_key.get(key, ""))
            if old is not None and old.state == OPEN:
                self._seen[old.id] = now
                held = True
            elif old is not None and now - old.detected_at < self.cfg.cooldown:
                self._reopen(old, now, evidence, keep_for)
                held = True
            elif suspect is not None:
                fresh.append(suspect)
        if kinds.known(kind).job_wide or not suspects:
            if held:
                return None
            fresh = list(suspects)
        elif not fresh:
            return None
        inc = Incident(
            id=new_id(kind, now),
            kind=kind,
            job=job,
            role=role,
            host=self.host,
            suspects=fresh,
            detected_at=now,
            step=step,
            evidence=evidence,
            owner=None if self.owner_of is None else self.owner_of(job),
        )
        self.held[inc.id] = inc
        for key, _ in self._keys(kind, job, fresh):
            self._by_key[key] = inc.id
        self._seen[inc.id] = now
        self._keep[inc.id] = self.cfg.hold if keep_for is None else keep_for
        self._arm_capture(inc, now)
        self._save(inc, new=True)
        log.warning("incident %s: %s", inc.id, describe(inc))
        return inc

    def still(self, kind: str, job: str) -> bool:
        """Whether the job-wide ``kind`` of ``job`` has an open incident; if so it holds a
        while longer (a rule that reported it once and keeps seeing it says so, cheaply)."""
        inc = self.held.get(self._by_key.get((kind, job, None, None), ""))
        if inc is None or inc.state != OPEN:
            return False
        self._seen[inc.id] = self._clock()
        return True

    def clear(self, kind: str, job: str) -> bool:
        """The job-wide ``kind`` of ``job`` is over (a stalled job stepped again): its open
        incident, opened by this daemon or restored from the index, is resolved now, not
        after its hold. Whether there was one."""
        inc = self.held.get(self._by_key.get((kind, job, None, None), ""))
        if inc is None or inc.state != OPEN:
            return False
        self._resolve(inc, self._clock())
        return True

    def clear_ranks(self, kind: str, job: str, role: str, named: set[int]) -> list[Incident]:
        """A rule that judges now and then (a sample) judged ``role`` of ``job`` again and
        named only ``named``: its open incidents of ``kind`` there none of whose suspects is
        named any more are resolved now, not after their hold."""
        now = self._clock()
        cleared = []
        for inc in list(self.held.values()):
            if (
                inc.state == OPEN
                and inc.kind == kind
                and inc.job == job
                and inc.role == role
                and not any(s.rank in named for s in inc.suspects)
            ):
                self._resolve(inc, now)
                cleared.append(inc)
        return cleared

    def open_in(self, job: str) -> bool:
        """Whether ``job`` has an open incident (its detector tick then reads its ranks'
        steps for :meth:`count_loss`)."""
        return any(i.state == OPEN and i.job == job for i in self.held.values())

    def count_loss(self, job: str, ranks: Sequence[RankSteps]) -> None:
        """One detector tick of ``job``: each of its open incidents counts what the tick
        cost (``Kind.loss``). Written again when it first counts something, then when it
        grew and was last written LOSS_SAVE_S ago; on resolution at once."""
        now = self._clock()
        tick = JobTick(now, ranks)
        for inc in list(self.held.values()):
            if inc.state != OPEN or inc.job != job:
                continue
            before = inc.lost_rank_s
            _count(inc, tick)
            if inc.lost_rank_s == before:
                continue
            # The first figure at once (a spike's whole loss is its first tick's, and the
            # warehouse should not show a new incident at 0 for a save interval); then
            # every LOSS_SAVE_S.
            if before == 0.0 or now - self._written.get(inc.id, 0.0) >= LOSS_SAVE_S:
                self._save(inc)

    def save_open(self) -> None:
        """At shutdown: the open incidents written as they are now (their loss grew since
        they were last written): a restarted daemon goes on from there."""
        for inc in list(self.held.values()):
            if inc.state == OPEN:
                self._save(inc)

    def _arm_capture(self, inc: Incident, now: float) -> None:
        if self.capture is None or not self.cfg.capture or not kinds.known(inc.kind).captures:
            return
        last = self._captured.get(inc.job)
        if last is not None and now - last < self.cfg.cooldown:
            inc.notes.append(
                f"no capture: job {inc.job} had one {now - last:.0f}s ago"
                f" (cooldown {self.cfg.cooldown:.0f}s)"
            )
            return
        try:
            inc.session = self.capture(inc)
        except Refused as exc:
            inc.notes.append(f"no capture: {exc}")
            log.warning("incident %s: no capture: %s", inc.id, exc)
            return
        except Exception as exc:  # a bug there must not lose the incident itself
            inc.notes.append(f"no capture: {type(exc).__name__}: {exc}")
            log.exception("incident %s: arming its capture", inc.id)
            return
        self._captured[inc.job] = now

    def _reopen(
        self, inc: Incident, now: float, evidence: dict[str, Any], keep_for: float | None
    ) -> None:
        """A resolved incident's condition came back inside its job's cooldown."""
        # A rule's figures; never a hang's stacks, which only the job's owner may read (notes
        # are shown to everyone).
        said = figures(evidence)
        inc.reopen(f"open again at {_clock(now)} (inside the cooldown): {said}")
        # Its loss goes on from now: the time it was resolved cost nothing.
        inc.lost_at = now
        self._seen[inc.id] = now
        self._keep[inc.id] = self.cfg.hold if keep_for is None else keep_for
        self._save(inc)
        log.warning("incident %s open again: %s", inc.id, describe(inc))

    @staticmethod
    def _keys(kind: str, job: str, suspects: Sequence[Suspect]) -> list[tuple[Key, Suspect | None]]:
        if kinds.known(kind).job_wide or not suspects:
            return [((kind, job, None, None), None)]
        return [((kind, job, s.role, s.rank), s) for s in suspects]

    # --- the loop's side ------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """Once a tick (unix ``now``: the tick's wall clock; its own clock when None):
        resolve the incidents no rule reported for their hold; forget the resolved ones
        whose cooldown passed; write what could not be written before."""
        if now is None:
            now = self._clock()
        for inc in list(self.held.values()):
            if inc.state == OPEN:
                if now - self._seen.get(inc.id, now) > self._keep.get(inc.id, self.cfg.hold):
                    self._resolve(inc, now)
            elif now - inc.detected_at >= self.cfg.cooldown:
                self._forget(inc)
        for iid in list(self._unsaved):
            found = self.held.get(iid)
            if found is None:
                self._unsaved.discard(iid)
            else:
                self._save(found)
        for job in [j for j, t in self._captured.items() if now - t >= self.cfg.cooldown]:
            del self._captured[job]

    def _resolve(self, inc: Incident, now: float) -> None:
        # Its last figure: a kind counted per tick adds nothing more, a hang's ends now.
        _count(inc, JobTick(now))
        inc.resolve(now)
        self._seen.pop(inc.id, None)
        self._keep.pop(inc.id, None)
        self._save(inc)
        log.info("incident %s resolved after %.0fs", inc.id, now - inc.detected_at)

    def _forget(self, inc: Incident) -> None:
        del self.held[inc.id]
        self._written.pop(inc.id, None)
        for key in [k for k, v in self._by_key.items() if v == inc.id]:
            del self._by_key[key]

    def reconfigure(self, cfg: WatchConfig) -> None:
        self.cfg = cfg

    def restore(self) -> int:
        """At start: the open incidents and those inside their job's cooldown, from the
        index. An open one stays open long enough for its rule, starting afresh, to report
        it again (twice a window and a hold; a regression's half baseline more)."""
        now = self._clock()
        rows = self.store.recent_incidents(now - self.cfg.cooldown)
        for row in rows:
            inc = Incident.from_dict(row)
            self.held[inc.id] = inc
            for key, _ in self._keys(inc.kind, inc.job, inc.suspects):
                self._by_key[key] = inc.id
            if inc.session is not None:
                self._captured[inc.job] = max(self._captured.get(inc.job, 0.0), inc.detected_at)
            if inc.state == OPEN:
                self._seen[inc.id] = now
                self._keep[inc.id] = kinds.known(inc.kind).grace(self.cfg)
        return sum(1 for i in self.held.values() if i.state == OPEN)

    def capture_ended(self, s: Session) -> None:
        """A session ended: if it is an incident's capture, the comparison's hook."""
        if not (s.label or "").startswith(LABEL):
            return
        iid = s.label[len(LABEL) :] if s.label else ""
        inc = self.held.get(iid)
        if inc is None:
            row = self.store.incident(iid)
            if row is None:
                return
            inc = Incident.from_dict(row)
        before = inc.comparison
        on_capture_processed(self.session_rows, inc, s)
        if inc.comparison != before:
            self._save(inc)

    def referenced_sessions(self, ids: Sequence[str]) -> set[str]:
        """Which of these sessions an incident refers to (its evidence, its capture, the
        sample its comparison used): the sample sweep keeps their files."""
        wanted = set(ids)
        if not wanted:
            return set()
        found: set[str] = set()
        for d in self.store.incidents(limit=1_000_000):
            comparison = d.get("comparison") or {}
            for sid in (
                (d.get("evidence") or {}).get("session"),
                d.get("session"),
                comparison.get("sample") if isinstance(comparison, dict) else None,
            ):
                if isinstance(sid, str) and sid in wanted:
                    found.add(sid)
        return found

    # --- reads (control requests) ---------------------------------------------------------
    def rows(
        self,
        job: str | None = None,
        kind: str | None = None,
        since: float | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        """Incidents, newest first, from the index (what memory holds is written there as it
        changes; one that could not be written yet is taken from memory)."""
        rows = self.store.incidents(job=job, kind=kind, since=since, limit=limit)
        # An open incident's loss grows every tick and is written only now and then.
        rows = [
            {**r, "lost_rank_s": held.lost_rank_s, "lost_at": held.lost_at}
            if (held := self.held.get(r["id"])) is not None
            else r
            for r in rows
        ]
        if self._unsaved:
            mine = {iid: self.held[iid].to_dict() for iid in self._unsaved if iid in self.held}
            rows = [mine.pop(r["id"], r) for r in rows]
            rows += [
                d
                for d in mine.values()
                if (job is None or d["job"] == job)
                and (kind is None or d["kind"] == kind)
                and (since is None or d["detected_at"] >= since)
            ]
            rows.sort(key=lambda d: (-d["detected_at"], d["id"]))
        return rows[:limit]

    def find(self, text: str) -> dict[str, Any]:
        """The incident with this id, else the one whose id contains it."""
        inc = self.held.get(text)
        if inc is not None:
            return inc.to_dict()
        row = self.store.incident(text)
        if row is not None:
            return row
        ids = self.store.incident_ids(text, 6)
        if not ids:
            raise Refused(ErrorCode.NOT_FOUND, f"no incident {text!r}")
        if len(ids) > 1:
            shown = ", ".join(ids[:5])
            raise Refused(ErrorCode.AMBIGUOUS, f"incident {text!r} is ambiguous: {shown}")
        found = self.store.incident(ids[0])
        if found is None:
            raise Refused(ErrorCode.NOT_FOUND, f"no incident {text!r}")
        return found

    def attach_blackbox(self, iid: str, doc: dict[str, Any]) -> Incident | None:
        """The black box frozen when incident ``iid`` opened (``doc``: what it shows), added
        to its evidence and saved; None when the incident is no longer held (forgotten).
        A spike whose ranks waited for one of them names that one (the others waited)."""
        inc = self.held.get(iid)
        if inc is None:
            return None
        inc.evidence["blackbox"] = doc
        held = doc.get("held_up_by")
        if held and kinds.known(inc.kind).suspects_from_blackbox:
            # The rank the others waited for, whether or not its own long step reached the
            # rule in the same tick as theirs.
            inc.suspects = [Suspect(str(h["host"]), str(h["role"]), int(h["rank"])) for h in held]
        self._save(inc)
        return inc

    # --- the record --------------------------------------------------------------------------
    def _save(self, inc: Incident, new: bool = False) -> None:
        """The incident to every sink, in order; one that fails is tried again each tick."""
        try:
            for sink in self.sinks:
                sink.save(inc, new)
            self._written[inc.id] = self._clock()
        except Exception as exc:
            if inc.id not in self._unsaved:
                log.error("incident %s: cannot write its record (tried each tick): %s", inc.id, exc)
            self._unsaved.add(inc.id)
            return
        self._unsaved.discard(inc.id)


def _count(inc: Incident, tick: JobTick) -> None:
    """``inc``'s loss counted to ``tick``."""
    inc.lost_rank_s = kinds.known(inc.kind).loss(inc, tick)
    inc.lost_at = tick.at


def describe(inc: Incident) -> str:
    """One line: what was noticed, where, and the capture."""
    who = ", ".join(f"{s.role} rank {s.rank} on {s.host}" for s in inc.suspects)
    what = kinds.known(inc.kind).text(inc, who)
    if inc.step is not None:
        what += f" at step {inc.step}"
    if inc.session is not None:
        what += f"; capture {inc.session}"
    return what


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
