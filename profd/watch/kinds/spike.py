"""``spike``: one step far beyond its rank's median (``profd.watch.spike_rule``, ``[watch]
spike``). The moment is over when it is noticed: no capture; the black box is its evidence."""

from __future__ import annotations

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import Kind, rule_grace


def _text(inc: Incident, who: str) -> str:
    ev = inc.evidence
    return (
        f"job {inc.job}: a step of {float(ev.get('step_ms', 0)) / 1000:.1f} s against a median"
        f" of {float(ev.get('median_ms', 0)):.1f} ms" + (f" on {who}" if who else "")
    )


KIND = Kind(
    name="spike",
    label="spike",
    job_wide=True,
    captures=False,
    grace=rule_grace,
    text=_text,
)
