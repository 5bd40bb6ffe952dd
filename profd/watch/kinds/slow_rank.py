"""``slow_rank``: a rank steps slower than the other ranks of its role (``SlowRankRule``,
``[watch] slow_rank``), or, in a lockstep role, the others wait for it in collectives
(``WaitRule``: evidence ``by`` "wait")."""

from __future__ import annotations

from statistics import median

from profd.watch.incident_record import Incident
from profd.watch.kinds.kind import JobTick, Kind, pct, rule_grace, stepped


def _text(inc: Incident, who: str) -> str:
    ev = inc.evidence
    if ev.get("by") == "wait":
        return (
            f"job {inc.job}: {who} is waited for: its role's other ranks wait"
            f" {ev.get('peers_wait_ms', 0):.1f} ms a step in collectives, it waits"
            f" {ev.get('wait_ms', 0):.1f} ms (steps of {ev.get('step_ms', 0):.1f} ms, in lockstep)"
        )
    return (
        f"job {inc.job}: {who} steps in {ev.get('step_ms', 0):.1f} ms against"
        f" {ev.get('peers_ms', 0):.1f} ms of its role ({pct(ev.get('ratio'))})"
    )


def _loss(inc: Incident, tick: JobTick) -> float:
    """For each suspect: (its step - the median step of its role's other ranks) in the tick
    x its steps in the tick x the other ranks of its role here (those that waited). Found
    by the collective wait (lockstep, every step as long as the slowest): what the others
    waited beyond its own wait when it was found, a step, instead of the step's excess."""
    lost = inc.lost_rank_s
    ev = inc.evidence
    by_wait = ev.get("by") == "wait"
    for s in inc.suspects:
        role = [r for r in tick.ranks if r.role == s.role]
        ran = stepped(role)
        me = next((r for r in ran if r.rank == s.rank), None)
        peers = [r.step_ms or 0.0 for r in ran if r.rank != s.rank]
        if me is None or not peers:
            continue
        if by_wait:
            excess_ms = float(ev.get("peers_wait_ms", 0.0)) - float(ev.get("wait_ms", 0.0))
        else:
            excess_ms = (me.step_ms or 0.0) - median(peers)
        lost += max(0.0, excess_ms) / 1000.0 * me.steps * (len(role) - 1)
    return lost


KIND = Kind(
    name="slow_rank",
    label="slow_rank",
    job_wide=False,
    captures=True,
    grace=rule_grace,
    text=_text,
    loss=_loss,
)
