"""``straggler``: a rank its peers wait for, found when a sample's traces are processed
(``SampleStragglers``)."""

from __future__ import annotations

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import JobTick, Kind, num, plain_text, rule_grace, stepped


def _loss(inc: Incident, tick: JobTick) -> float:
    """What the sample that named it measured, the time its role's other ranks waited per
    step (``wait_ms``: the longest of its stragglers', whom the others wait for at once),
    x the steps the role made in the tick x the ranks that waited (the sample's ranks of
    the role but its stragglers)."""
    ev = inc.evidence
    waits = [num(w) for w in ev.get("wait_ms") or ()]
    wait_ms = max(waits, default=0.0)
    waited = int(num(ev.get("ranks"))) - len(waits)
    ran = stepped([r for r in tick.ranks if r.role == inc.role])
    if wait_ms <= 0 or waited <= 0 or not ran:
        return inc.lost_rank_s
    return inc.lost_rank_s + wait_ms / 1000.0 * max(r.steps for r in ran) * waited


KIND = Kind(
    name="straggler",
    label="straggler",
    job_wide=False,
    captures=True,
    grace=rule_grace,
    text=plain_text,
    loss=_loss,
)
