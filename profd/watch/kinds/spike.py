"""``spike``: one step far beyond its rank's median (``profd.watch.spike_rule``, ``[watch]
spike``). The moment is over when it is noticed: no capture; the black box is its evidence."""

from __future__ import annotations

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import JobTick, Kind, num, rule_grace


def _text(inc: Incident, who: str) -> str:
    ev = inc.evidence
    return (
        f"job {inc.job}: a step of {float(ev.get('step_ms', 0)) / 1000:.1f} s against a median"
        f" of {float(ev.get('median_ms', 0)):.1f} ms" + (f" on {who}" if who else "")
    )


def _loss(inc: Incident, tick: JobTick) -> float:
    """The spike's excess over the median x the ranks it held up: a rank alone lost the
    time itself; ranks that spiked together, or whose black box shows the others waiting for
    one of them, are a lockstep job, whose every rank here waited it out (some of them may
    report their long step a tick later). The same figure every tick (a spike is one step,
    not a rate): the largest seen."""
    ev = inc.evidence
    spiked = len(ev.get("spiked") or {})
    held = 1 if spiked <= 1 else max(spiked, len(tick.ranks))
    # The black box, once frozen, tells a lockstep job's waiters apart even when only one
    # rank's long step reached the rule before it opened the incident.
    bb = ev.get("blackbox")
    if isinstance(bb, dict) and bb.get("held_up_by"):
        held = max(held, int(num(bb.get("ranks_held"))), len(tick.ranks))
    return max(inc.lost_rank_s, num(ev.get("excess_ms")) / 1000.0 * held)


KIND = Kind(
    name="spike",
    label="spike",
    job_wide=True,
    captures=False,
    grace=rule_grace,
    text=_text,
    loss=_loss,
)
