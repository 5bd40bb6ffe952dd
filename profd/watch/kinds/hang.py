"""``hang``: a job none of whose ranks on a node finished a step for ``stall_after``
(``Hangs``, ``[watch] stall_after``); its evidence is its ranks' stacks."""

from __future__ import annotations

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import Kind, baseline_grace


def _text(inc: Incident, who: str) -> str:
    # Not its verdict: that names the job's functions, which the log's readers may not see
    # (``profctl incident`` shows them to whom it may).
    ev = inc.evidence
    return (
        f"job {inc.job} stalled for {ev.get('stalled_s', 0):.0f}s, {ev.get('ranks_here', 0)}"
        f" rank(s) here; suspects: {who or 'none'}"
    )


KIND = Kind(
    name="hang",
    label="hang",
    job_wide=True,
    captures=False,
    grace=baseline_grace,
    text=_text,
)
