"""``regression``: a job's step time slowed down against its own baseline
(``RegressionRule``, ``[watch] regression``)."""

from __future__ import annotations

from statistics import median

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import JobTick, Kind, baseline_grace, num, pct, stepped


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
)
