"""Standing ``[[auto]]`` rules: a start spec applied to every matching process as it attaches."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from profd import control_schema as C
from profd.config import AutoRule, ConfigError
from profd.daemon.clients.registry import Client
from profd.daemon.sessions.arming import Arms
from profd.daemon.sessions.starts import Starter, StartRequest, target_state
from profd.daemon.sessions.state import Sessions, Target
from profd.scheduling import planner
from profd.scheduling import schedule as sch
from profd.scheduling.refusal import Refused

log = logging.getLogger("profd.auto")


def check(rules: Sequence[AutoRule]) -> list[StartRequest]:
    """Bad rules stop the daemon at start, not silently at attach time."""
    out = []
    for i, rule in enumerate(rules, 1):
        try:
            req = StartRequest.parse(dict(rule.spec))
        except Refused as exc:
            raise ConfigError(f"[[auto]] rule {i}: {exc}") from None
        why = None
        coordinator = sorted(C.COORDINATOR_KEYS & set(rule.spec))
        if coordinator:
            why = f"{', '.join(coordinator)}: only a cluster coordinator sends these"
        elif not req.schedule.explicit:
            why = "needs steps or at_step: --next would differ per rank"
        elif req.backend != "torch":
            # Ranks join a rule's session one by one as they attach; an nsys collection is
            # started once per session, before arming.
            why = "supports the torch backend only"
        else:
            try:
                sch.resolve(req.schedule)
            except sch.ScheduleError as exc:
                why = str(exc)
        if why:
            raise ConfigError(f"[[auto]] rule {i}: {why}")
        out.append(req)
    return out


class AutoRules:
    def __init__(
        self, rules: Sequence[StartRequest], starter: Starter, sessions: Sessions, arms: Arms
    ) -> None:
        self.rules = rules
        self.starter = starter
        self.sessions = sessions
        self.arms = arms
        #: (rule, job) -> the session that rule runs for that job.
        self.by_job: dict[tuple[int, str], str] = {}

    def attached(self, c: Client) -> None:
        """Arm a newly attached process for every rule it matches."""
        for i, rule in enumerate(self.rules):
            if not (rule.selector.matches(c) and c.allowed):
                continue
            sid = self.by_job.get((i, c.job))
            s = self.sessions.exact(sid) if sid else None
            mine = s.targets.get(c.key) if s is not None else None
            if s is not None and (s.terminal or (mine is not None and mine.voided_by(c.identity))):
                # The rule's session for this job cannot take the process: it is over, or it
                # holds this process's target cancelled for an identity it no longer has (its
                # rank changed, its job did not). That target cannot be armed again in the
                # same session: the client still holds the old arm (its revision, and file
                # names after the old rank) and answers the disarm with a "cancelled" report
                # that would end a fresh target in that session too. A fresh session for the
                # job has a fresh target with the identity the process has now; the job's
                # other ranks join it as they re-register.
                s = None
            if s is None:
                spec = dict(rule.spec, job=c.job, pids=[c.pid])
                spec.setdefault("label", f"auto:{i}")
                try:
                    s = self.starter.start(StartRequest.parse(spec), auto_rule=i)
                except Refused as exc:
                    log.warning("[[auto]] rule %d on pid %s: %s", i, c.pid, exc)
                    continue
                self.by_job[(i, c.job)] = s.id
                continue
            # Later ranks of the same job join the rule's session: same steps on every rank.
            if c.key in s.targets:
                continue
            try:
                sch.check_work(s.cycles, len(s.targets) + 1)
            except sch.ScheduleError as exc:
                log.warning("[[auto]] rule %d on pid %s: %s", i, c.pid, exc)
                continue
            t = Target.of(c)
            self.sessions.join(s, t)
            why = planner.can_join(s.cycles, target_state(c))
            if why is not None:
                self.sessions.fail(s, t, why)
                continue
            self.arms.arm(s, c)
