"""``regression``: a job's step time slowed down against its own baseline
(``RegressionRule``, ``[watch] regression``), fed each tick the median over the job's ranks
of their step time in the tick."""

from __future__ import annotations

from statistics import median

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import (
    Finding,
    JobReading,
    JobTick,
    Kind,
    baseline_grace,
    num,
    only_role,
    pct,
    stepped,
)
from profd.watch.slowdown_rules import RegressionRule, WatchRules


class RegressionTick:
    """One job's regression rule. Its baseline starts again whenever the job's ranks change
    (:attr:`JobReading.changed`); a tick without steps (a pause for a checkpoint or an
    evaluation) adds nothing."""

    def __init__(self, rules: WatchRules) -> None:
        self.rules = rules
        self.rule = RegressionRule(rules)

    def observe(self, job: JobReading) -> list[Finding]:
        if job.changed:
            self.rule.reset()
        ranks = job.ranks
        tick_ms = [r.tick_ms for r in ranks if r.tick_ms is not None]
        # A rank with no step time in the tick made no step in it (``TickRank``).
        steps = max([r.tick_steps for r in ranks], default=0)
        found = self.rule.observe(job.now, median(tick_ms) if tick_ms else 0.0, steps)
        if found is None:
            return []
        rules = self.rules
        evidence = {
            "window_ms": round(found.window_ms, 3),
            "baseline_ms": round(found.baseline_ms, 3),
            "ratio": round(found.ratio, 4),
            "threshold": round(found.threshold, 4),
            "window_s": rules.window,
            "baseline_s": rules.baseline,
            "hold_s": rules.hold,
            "ranks": len(job.ranks),
        }
        top = max((r.step for r in job.ranks), default=0)
        return [Finding(only_role(job.ranks), [], top, evidence)]


def _text(inc: Incident, who: str) -> str:
    ev = inc.evidence
    return (
        f"job {inc.job} slowed down: step {ev.get('window_ms', 0):.1f} ms against"
        f" {ev.get('baseline_ms', 0):.1f} ms before ({pct(ev.get('ratio'))})"
    )


def _loss(inc: Incident, tick: JobTick) -> float:
    """(the tick's median step - the baseline median the incident recorded) x the steps of
    the tick x the job's ranks here. A tick faster than the baseline adds nothing: the
    regression's loss is not paid back by noise below it."""
    base_ms = num(inc.evidence.get("baseline_ms"))
    ran = stepped(tick.ranks)
    if base_ms <= 0 or not ran:
        return inc.lost_rank_s
    excess_ms = median(r.step_ms or 0.0 for r in ran) - base_ms
    steps = max(r.steps for r in ran)
    return inc.lost_rank_s + max(0.0, excess_ms) / 1000.0 * steps * len(tick.ranks)


KIND = Kind(
    name="regression",
    label="regression",
    job_wide=True,
    captures=True,
    grace=baseline_grace,
    text=_text,
    loss=_loss,
    job_changed=True,
    tick_rule=RegressionTick,
)
