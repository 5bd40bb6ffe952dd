"""``spike``: one step far beyond its rank's median (``profd.watch.spike_rule``, ``[watch]
spike``). The moment is over when it is noticed: no capture; the black box is its evidence."""

from __future__ import annotations

from profd.watch.incident_record import Incident, Suspect
from profd.watch.kinds.kind import (
    Finding,
    JobReading,
    JobTick,
    Kind,
    TickRank,
    num,
    only_role,
    rule_grace,
)
from profd.watch.slowdown_rules import WatchRules
from profd.watch.spike_rule import RankTick, is_candidate, spikes


class SpikeTick:
    """The spike rule over one job's tick: pure, it keeps nothing between ticks. A rank's
    median (a second read of its ledger) is read only where its longest step of the tick is
    far enough above the window's upper quantile the tick read anyway to be a spike at all:
    for most ranks, most ticks, never."""

    def __init__(self, rules: WatchRules) -> None:
        self.threshold = rules.spike

    def observe(self, job: JobReading) -> list[Finding]:
        candidates: dict[tuple[str, int], RankTick] = {}
        by_key: dict[tuple[str, int], TickRank] = {}
        for r in [r for r in job.ranks if is_candidate(r.tick_top_ms, r.window_ms)]:
            med, med_n = job.median(r)
            if med is not None:
                candidates[(r.host, r.pid)] = RankTick(r.tick_top_ms, med, med_n)
                by_key[(r.host, r.pid)] = r
        found = spikes(candidates, self.threshold) if candidates else None
        if found is None:
            return []
        spiked = sorted((by_key[k] for k in found.ranks), key=lambda r: (r.role, r.rank))
        evidence = {
            "step_ms": round(max(top for top, _ in found.ranks.values()), 3),
            "median_ms": round(min(med for _, med in found.ranks.values()), 3),
            "ratio": round(found.ratio, 4),
            "excess_ms": round(found.excess_ms, 3),
            "threshold": found.threshold,
            "spiked": {
                f"{r.role}:{r.rank}": [round(v, 3) for v in found.ranks[(r.host, r.pid)]]
                for r in spiked
            },
        }
        return [
            Finding(
                only_role(spiked),
                [Suspect(r.host, r.role, r.rank) for r in spiked],
                max(r.step for r in spiked),
                evidence,
            )
        ]


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
    suspects_from_blackbox=True,
    tick_rule=SpikeTick,
)
