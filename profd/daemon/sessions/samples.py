"""Samples (docs/design.md "Watch"): the daemon captures a few steps of every attached job by
itself, every ``sample_every`` steps, at steps every node derives from the step alone.

Four parts, all on the event loop:

* :class:`SampleArming`: once a tick, for each job attached here without a sample still
  running, arms the next sample (:func:`profd.watch.sampling.due`) on its ranks here,
  under the id every node gives it, through :class:`Starter` (quota, reachability, busy
  ranks: a refusal skips that sample, logged at debug). Only the job owner's ranks
  (``Registry.owned``) whose steps are plausible (:class:`~profd.watch.sampling.StepTrust`)
  decide the steps and are sampled; a sample not begun that would hold a rank armed far
  ahead (``holds_back``: its steps were set by a rank that left, or by an older daemon) is
  withdrawn;
* :class:`SampleBound`: a sample not over within its time (:func:`profd.watch.sampling.
  time_limit`, from its warm-up step) ends with what it got: the ranks that captured are
  processed and indexed, the rest fail as not reached and are disarmed, and the job's next
  sample is armed (a rank that stopped stepping must not stop its job's sampling for good);
* :class:`SampleStragglers`: when a sample session ends, the report's straggler rule over
  each role of it, from the per-rank statistics in the index; a straggler opens an incident;
* :class:`SampleAging`: sample trace files older than ``keep_samples`` are deleted unless an
  incident refers to their session (the manifest and the index rows, with the statistics,
  stay), a bounded batch at a time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from profd.daemon.clients.registry import Client, Registry
from profd.daemon.sessions.starts import Starter, StartRequest, target_state
from profd.daemon.sessions.state import Session, Sessions
from profd.report.model import Report, build_report
from profd.scheduling.refusal import Refused
from profd.store.index import FileRepo, SessionRepo
from profd.watch import sampling
from profd.watch.incident_record import Incident, Suspect
from profd.watch.kinds.straggler import KIND as STRAGGLER
from profd.watch.sampling import LABEL, SampleRules

log = logging.getLogger("profd.samples")

#: ``(kind, job, role, suspects, step, evidence) -> the incident opened, or None`` (one is
#: already open for it): ``Incidents.open``.
OpenIncident = Callable[
    [str, str, str | None, list[Suspect], int | None, dict[str, Any]], Incident | None
]
#: Which of these session ids an incident refers to (their files are kept).
Referenced = Callable[[Sequence[str]], set[str]]
#: (kind, job, role, ranks still named): resolves the role's open incidents of that kind
#: none of whose suspects is still named.
ClearIncident = Callable[[str, str, str, set[int]], list[Incident]]


class SampleArming:
    def __init__(
        self, rules: SampleRules, registry: Registry, sessions: Sessions, starter: Starter
    ) -> None:
        self.rules = rules
        self.registry = registry
        self.sessions = sessions
        self.starter = starter
        #: Per job, the first step of the sample it skips: refused (the quota) or its id
        #: taken (a restarted job at steps it sampled before). Not tried again each tick
        #: until its steps pass: a quota check reads the whole files table.
        self._skip: dict[str, int] = {}
        self.trust = sampling.StepTrust()

    def reconfigure(self, rules: SampleRules) -> None:
        """New ``[watch]`` rules: the next tick arms by them."""
        self.rules = rules

    def tick(self, now: float) -> list[Session]:
        """Arm the samples due now; the sessions started."""
        if not self.rules.on:
            return []
        self._withdraw(now)
        running = {s.job for s in self.sessions.live() if s.label == LABEL}
        jobs: dict[str, list[Client]] = {}
        seen = []
        observe = self.trust.observe
        for job, owned in self.registry.owned_by_job().items():
            for c in owned:
                seen.append(c.key)
                # Every tick, sampled or not: a rank's rate is learnt from its reports.
                if observe(c.key, c.step, c.step_at) and c.allowed and job not in running:
                    jobs.setdefault(job, []).append(c)
        self.trust.forget(seen)
        self._skip = {j: v for j, v in self._skip.items() if j in jobs}
        started = []
        for job, clients in jobs.items():
            s = self._arm(job, clients, now)
            if s is not None:
                started.append(s)
        return started

    def _arm(self, job: str, clients: list[Client], now: float) -> Session | None:
        busy = self.sessions.busy_until
        cycle = sampling.due(self.rules, [target_state(c, busy(c.key)) for c in clients], now)
        if cycle is None:
            return None
        if self._skip.get(job) == cycle[1]:
            return None
        sid = sampling.sample_id(job, cycle[1])
        if self.sessions.taken(sid):
            self._skip[job] = cycle[1]
            return None
        spec: dict[str, Any] = {
            "job": job,
            "session": sid,
            "cycles": [list(cycle)],
            "label": LABEL,
            # These ranks exactly: not another user's process in the job, nor one whose
            # step jumped.
            "pids": sorted({c.pid for c in clients}),
        }
        hosts = {c.host for c in clients}
        if len(hosts) == 1:
            spec["host"] = hosts.pop()  # pids are unique per host only
        try:
            return self.starter.start(StartRequest.parse(spec))
        except Refused as exc:
            # The quota, or a rank that passed the steps meanwhile: this sample is skipped.
            self._skip[job] = cycle[1]
            log.debug("sample %s of job %s not armed: %s", sid, job, exc)
            return None

    def _withdraw(self, now: float) -> None:
        """Cancel the samples not begun that would hold one of their ranks armed far ahead."""
        busy = self.sessions.busy_until
        for s in self.sessions.live():
            if s.label != LABEL or not s.cycles or any(t.begun for t in s.targets.values()):
                continue
            first = s.cycles[0][0]
            for key, t in s.targets.items():
                c = self.registry.lookup(key)
                if c is None or not t.open:
                    continue
                state = target_state(c, busy(key))
                if sampling.holds_back(first, state, now):
                    why = (
                        f"withdrawn: step {first} is too far ahead of {state.name}"
                        f" (at step {int(state.estimated_step(now))})"
                    )
                    log.warning("sample %s of job %s %s", s.id, s.job, why)
                    self.starter.stop(s.id, keep=False, why=why)
                    break


#: Disarms a target's process (``Arms.disarm``): ``(session, client, keep)``.
Disarm = Callable[[Session, Client, bool], None]


class SampleBound:
    """Ends the samples that ran out of time (see the module docstring). Each live sample's
    deadline is set the first tick it is seen (its arm, or a restarted daemon's restore)."""

    def __init__(
        self, rules: SampleRules, registry: Registry, sessions: Sessions, disarm: Disarm
    ) -> None:
        self.rules = rules
        self.registry = registry
        self.sessions = sessions
        self.disarm = disarm
        #: Live sample id -> (monotonic deadline, seconds it was given).
        self._due: dict[str, tuple[float, float]] = {}

    def reconfigure(self, rules: SampleRules) -> None:
        """New ``[watch]`` rules: a sample seen from now on gets their time."""
        self.rules = rules

    def tick(self, now: float) -> list[Session]:
        """The samples ended now for running out of time."""
        live = {s.id: s for s in self.sessions.live() if s.label == LABEL}
        self._due = {sid: d for sid, d in self._due.items() if sid in live}
        ended = []
        for sid, s in live.items():
            due = self._due.get(sid)
            if due is None:
                self._due[sid] = self._deadline(s, now)
            elif now >= due[0] and any(t.open for t in s.targets.values()):
                # (With none open, its captures are in the pipeline: it ends by itself.)
                self._cut(s, due[1])
                ended.append(s)
        return ended

    def _deadline(self, s: Session, now: float) -> tuple[float, float]:
        clients = [c for c in map(self.registry.lookup, s.targets) if c is not None]
        step_s = sampling.typical_step_s([c.sps for c in clients])
        given = sampling.time_limit(self.rules, step_s)
        # Counted from its warm-up step: it is armed a few seconds of steps ahead of it.
        lead = 0.0
        if step_s is not None and s.cycles:
            at = max(target_state(c).estimated_step(now) for c in clients)
            lead = max(0.0, s.cycles[0][0] - at) * step_s
        return now + lead + given, lead + given

    def _cut(self, s: Session, given: float) -> None:
        steps = f"{s.cycles[0][1]}-{s.cycles[-1][2] - 1}" if s.cycles else "?"
        cut = []
        for t in [t for t in s.targets.values() if t.open]:
            c = self.registry.lookup(t.key)
            at = f" (at step {c.step})" if c is not None else ""
            why = f"sample not over in {given:.0f}s: steps {steps} not reached{at}"
            self.sessions.cut(s, t, why)
            cut.append(f"{t.role} rank {t.rank}{at}")
            if c is not None:
                self.disarm(s, c, False)
        del self._due[s.id]
        log.warning(
            "sample %s of job %s not over in %.0fs: ended with what it got; not reached: %s",
            s.id,
            s.job,
            given,
            ", ".join(cut),
        )


def role_reports(session: Mapping[str, Any]) -> list[Report]:
    """The report of each role of a session: ranks of different roles do different work, so
    only ranks of one role are compared with each other."""
    roles: dict[str, list[Any]] = {}
    for t in session.get("targets") or []:
        roles.setdefault(str(t["role"]), []).append(t)
    return [build_report({**session, "targets": ts}) for _, ts in sorted(roles.items())]


def straggler_findings(
    session: Mapping[str, Any],
) -> list[tuple[str, list[Suspect], int | None, dict[str, Any]]]:
    """``(role, suspects, step, evidence)`` for each role of a processed session, suspects
    the stragglers its per-rank statistics name (the report's rule), none for a clean role
    (evidence then empty)."""
    out: list[tuple[str, list[Suspect], int | None, dict[str, Any]]] = []
    for rep in role_reports(session):
        if not rep.ranks:
            continue
        role = rep.ranks[0].role
        if not rep.stragglers:
            out.append((role, [], None, {}))
            continue
        suspects = [
            Suspect(rep.ranks[s.index].host, rep.ranks[s.index].role, rep.ranks[s.index].rank)
            for s in rep.stragglers
        ]
        steps = rep.steps
        evidence = {
            "why": "; ".join(s.why for s in rep.stragglers),
            "session": rep.session,
            "steps": [steps[0], steps[-1]] if steps else [],
            "ranks": len(rep.ranks),
            "lead_ms": [s.lead_ms for s in rep.stragglers],
            "wait_ms": [s.wait_ms for s in rep.stragglers],
            "threshold_ms": round(rep.verdict.threshold_ms, 3),
            "median_step_ms": round(rep.median_step_ms, 3),
        }
        out.append((role, suspects, steps[-1] if steps else None, evidence))
    return out


class SampleStragglers:
    """The ``straggler`` detector: the report's rule over every processed sample."""

    def __init__(
        self, session_rows: SessionRepo, open_incident: OpenIncident, clear_incident: ClearIncident
    ) -> None:
        self.session_rows = session_rows
        self.open_incident = open_incident
        self.clear_incident = clear_incident

    def processed(self, session_id: str) -> list[Incident]:
        """A sample session ended: the incidents its statistics open; the open straggler
        incidents of each of its roles whose ranks it no longer names are resolved (a clean
        sample is the condition clearing)."""
        s = self.session_rows.session(session_id)
        if s is None or s["id"] != session_id:
            return []
        opened = []
        for role, suspects, step, evidence in straggler_findings(s):
            self.clear_incident(STRAGGLER.name, s["job"], role, {x.rank for x in suspects})
            if not suspects:
                continue
            i = self.open_incident(STRAGGLER.name, s["job"], role, suspects, step, evidence)
            if i is not None:
                opened.append(i)
        return opened


class SampleAging:
    """Deletes sample trace files older than ``keep_samples`` that no incident refers to."""

    #: Seconds between sweeps, and sessions looked at per sweep: a bounded piece of the
    #: loop's time whatever the backlog (a daemon started after a week off).
    EVERY = 60.0
    BATCH = 20

    def __init__(self, files: FileRepo, keep_s: float, referenced: Referenced) -> None:
        self.files = files
        self.keep_s = keep_s
        self.referenced = referenced
        self._after: tuple[float, str] = (0.0, "")
        self._due = 0.0

    def reconfigure(self, keep_s: float) -> None:
        """A new ``keep_samples``: the next sweep deletes by it."""
        self.keep_s = keep_s

    def tick(self, wall: float) -> int:
        """One sweep when due; the files deleted."""
        if wall < self._due:
            return 0
        self._due = wall + self.EVERY
        rows = self.files.labelled_with_files(LABEL, wall - self.keep_s, self._after, self.BATCH)
        # A short batch reached the end: the next sweep starts over, so the samples skipped
        # (files still uploading) are looked at again.
        self._after = rows[-1] if len(rows) == self.BATCH else (0.0, "")
        kept = self.referenced([sid for _, sid in rows]) if rows else set()
        removed = 0
        for _, sid in rows:
            if sid not in kept:
                removed += self._age(sid)
        if removed:
            log.info("deleted %d sample file(s) older than keep_samples", removed)
        return removed

    def _age(self, session_id: str) -> int:
        files = self.files.capture_files(session_id)
        # A file on its way to S3 is deleted once it is there, at a later sweep.
        if any(f["upload_state"] in ("pending", "uploading") for f in files):
            return 0
        gone = []
        for f in files:
            path = Path(f["path"])
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not delete sample file %s: %s", path, exc)
                continue
            gone.append(f["id"])
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # the cycle dir, once its last file is gone
        with self.files.transaction():
            for fid in gone:
                self.files.mark_deleted(fid)
        return len(gone)


class Samples:
    """What the loop calls: :meth:`tick` once a tick, :meth:`finished` for each session
    that ended."""

    def __init__(
        self,
        rules: SampleRules,
        registry: Registry,
        sessions: Sessions,
        starter: Starter,
        session_rows: SessionRepo,
        files: FileRepo,
        open_incident: OpenIncident,
        referenced: Referenced,
        clear_incident: ClearIncident,
    ) -> None:
        self.arming = SampleArming(rules, registry, sessions, starter)
        self.bound = SampleBound(rules, registry, sessions, starter.arms.disarm)
        self.stragglers = SampleStragglers(session_rows, open_incident, clear_incident)
        self.aging = SampleAging(files, rules.keep_samples, referenced)

    def set_rules(self, rules: SampleRules) -> None:
        """``[watch]`` read again (SIGHUP): the next tick arms by the new rules."""
        self.arming.reconfigure(rules)
        self.bound.reconfigure(rules)
        self.aging.reconfigure(rules.keep_samples)

    def tick(self, now: float, wall: float) -> None:
        self.bound.tick(now)
        self.arming.tick(now)
        self.aging.tick(wall)

    def finished(self, s: Session) -> None:
        if s.label == LABEL:
            self.stragglers.processed(s.id)


def rules_of(watch: Any) -> SampleRules:
    """The sample keys of ``[watch]`` (``config.WatchConfig``)."""
    return SampleRules(
        watch.sample_every, watch.sample_steps, watch.keep_samples, watch.sample_timeout
    )
