"""``slow_rank``: a rank steps slower than the other ranks of its role (``SlowRankRule``,
``[watch] slow_rank``)."""

from __future__ import annotations

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import Kind, pct, rule_grace


def _text(inc: Incident, who: str) -> str:
    ev = inc.evidence
    return (
        f"job {inc.job}: {who} steps in {ev.get('step_ms', 0):.1f} ms against"
        f" {ev.get('peers_ms', 0):.1f} ms of its role ({pct(ev.get('ratio'))})"
    )


KIND = Kind(
    name="slow_rank",
    label="slow_rank",
    job_wide=False,
    captures=True,
    grace=rule_grace,
    text=_text,
)
