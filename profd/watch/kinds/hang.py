"""``hang``: a job none of whose ranks on a node finished a step for ``stall_after``
(``Hangs``, ``[watch] stall_after``); its evidence is its ranks' stacks."""

from __future__ import annotations

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import JobTick, Kind, baseline_grace, num


def _text(inc: Incident, who: str) -> str:
    # Not its verdict: that names the job's functions, which the log's readers may not see
    # (``profctl incident`` shows them to whom it may).
    ev = inc.evidence
    return (
        f"job {inc.job} stalled for {ev.get('stalled_s', 0):.0f}s, {ev.get('ranks_here', 0)}"
        f" rank(s) here; suspects: {who or 'none'}"
    )


def _loss(inc: Incident, tick: JobTick) -> float:
    """How long the job has not stepped x its ranks here: from its last step (``stalled_s``
    before it was detected) to the tick, or to its resolution. Counted from where it was
    counted to (``lost_at``), so a restarted daemon counts its time down too (the job did
    not step then either); opened again, from then."""
    ev = inc.evidence
    start = inc.detected_at - num(ev.get("stalled_s")) if inc.lost_at is None else inc.lost_at
    end = tick.at if inc.resolved_at is None else inc.resolved_at
    return inc.lost_rank_s + max(0.0, end - start) * num(ev.get("ranks_here"))


KIND = Kind(
    name="hang",
    label="hang",
    job_wide=True,
    captures=False,
    grace=baseline_grace,
    text=_text,
    loss=_loss,
)
