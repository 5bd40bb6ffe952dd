"""``regression``: a job's step time slowed down against its own baseline
(``RegressionRule``, ``[watch] regression``)."""

from __future__ import annotations

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import Kind, baseline_grace, pct


def _text(inc: Incident, who: str) -> str:
    ev = inc.evidence
    return (
        f"job {inc.job} slowed down: step {ev.get('window_ms', 0):.1f} ms against"
        f" {ev.get('baseline_ms', 0):.1f} ms before ({pct(ev.get('ratio'))})"
    )


KIND = Kind(
    name="regression",
    label="regression",
    job_wide=True,
    captures=True,
    grace=baseline_grace,
    text=_text,
)
