"""``slow_rank``: a rank steps slower than the other ranks of its role (``SlowRankRule``,
``[watch] slow_rank``), or, in a lockstep role, the others wait for it in collectives
(``WaitRule``: evidence ``by`` "wait")."""

from __future__ import annotations

from statistics import median
from typing import Any

from profd.watch.incident_record import Incident, Suspect
from profd.watch.kinds.kind import (
    Finding,
    JobReading,
    JobTick,
    Kind,
    TickRank,
    pct,
    rule_grace,
    stepped,
)
from profd.watch.slowdown_rules import SlowRank, SlowRankRule, WaitedFor, WaitRule, WatchRules


class SlowRankTick:
    """One job's slow-rank rules, one pair per role of two ranks or more: by step time
    (:class:`SlowRankRule`), and, where every rank of the role sends its collective wait,
    by who the others wait for in lockstep (:class:`WaitRule`). A rank with no window yet
    (no ledger, or no interval in the window) is not in its role."""

    def __init__(self, rules: WatchRules) -> None:
        self.rules = rules
        self.roles: dict[str, SlowRankRule] = {}
        self.waits: dict[str, WaitRule] = {}

    def observe(self, job: JobReading) -> list[Finding]:
        roles: dict[str, dict[int, TickRank]] = {}
        for r in job.ranks:
            if r.window_ms is not None:
                ranks = roles.get(r.role)
                if ranks is None:
                    roles[r.role] = {r.rank: r}
                else:
                    ranks[r.rank] = r
        for gone in [g for g in self.roles if g not in roles]:
            del self.roles[gone]
        for gone in [g for g in self.waits if g not in roles]:
            del self.waits[gone]
        out: list[Finding] = []
        for role, ranks in roles.items():
            if len(ranks) < 2:
                self.roles.pop(role, None)
                self.waits.pop(role, None)
                continue
            rule = self.roles.get(role)
            if rule is None:
                rule = self.roles[role] = SlowRankRule(self.rules)
            slow = rule.observe(job.now, ranks)
            if slow:
                out += self._found(job, role, _by_steps(slow))
            waits = self.waits.get(role)
            if waits is None:
                if all(w.wait_ms is None for w in ranks.values()):
                    continue  # no rank of the role sends its wait: nothing to keep
                waits = self.waits[role] = WaitRule(self.rules)
            waited = waits.observe(job.now, ranks)
            if waited:
                out += self._found(job, role, _by_wait(waited))
        return out

    def _found(self, job: JobReading, role: str, named: dict[int, dict[str, Any]]) -> list[Finding]:
        """One finding for each rank in ``named`` (its rule's figures), whichever rule found
        it: step times, or the collective wait of a lockstep role."""
        by_rank: dict[int, TickRank] = {r.rank: r for r in job.ranks if r.role == role}
        rules = self.rules
        out = []
        for rank, figures in named.items():
            r = by_rank.get(rank)
            if r is None:
                continue
            evidence = {
                **figures,
                "window_s": rules.window,
                "hold_s": rules.hold,
                "ranks": len(by_rank),
            }
            out.append(Finding(role, [Suspect(r.host, role, rank)], r.step, evidence))
        return out


def _by_steps(slow: list[SlowRank]) -> dict[int, dict[str, Any]]:
    return {
        s.rank: {
            "step_ms": round(s.step_ms, 3),
            "peers_ms": round(s.peers_ms, 3),
            "ratio": round(s.ratio, 4),
            "threshold": round(s.threshold, 4),
        }
        for s in slow
    }


def _by_wait(found: list[WaitedFor]) -> dict[int, dict[str, Any]]:
    return {
        s.rank: {
            "by": "wait",
            "wait_ms": round(s.wait_ms, 3),
            "peers_wait_ms": round(s.peers_wait_ms, 3),
            "step_ms": round(s.step_ms, 3),
            "peers_ms": round(s.step_ms, 3),
            "ratio": 1.0,
            "waited": round(s.share, 4),
            "threshold": round(s.threshold, 4),
        }
        for s in found
    }


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
    tick_rule=SlowRankTick,
)
