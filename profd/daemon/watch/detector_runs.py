"""The detectors on the loop (docs/design.md "Watch"): once a tick, from the step ledger,
never blocking (reads of memory only; an incident's record is the only write).

For each job attached to this node a :class:`RegressionRule`, fed with the median over the
job's ranks of each rank's step time in this tick; for each role of a job with two ranks or
more a :class:`SlowRankRule`, fed with each rank's :data:`WINDOW_Q` quantile of its step
times over ``[watch] window``. What they report goes to :meth:`Incidents.open`. A job with
an open incident (of any kind) also hands its ranks' steps of the tick to
:meth:`Incidents.count_loss`: what the incident cost, tick after tick.

What they ignore: a job's regression baseline starts again when a rank sets its step count
(``step(n)``: its ledger's epoch changes), restarts, attaches or leaves; ticks without steps
(a pause for a checkpoint or an evaluation) add nothing; a rank with fewer than
``MIN_STEPS`` steps in the window (attached late, paused) is left out of its role; ranks of
a lockstep job (DDP) never differ, so the slow-rank rule does not see them by their step
times: where every rank of the role sends its collective wait (``Ledger.wait``, from torch's
flight recorder), a :class:`WaitRule` names the rank the others wait for, and elsewhere it is
the straggler rule's business (samples); processes of another uid than the job's owner
(``Registry.owned``): any local user can name any job, and a peer claiming fast steps would
make the owner's real rank the slow one, and arm its capture on the owner's process.
"""

from __future__ import annotations

from collections.abc import Iterator
from statistics import median
from typing import Any

from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.watch.incident_store import Incidents
from profd.watch.incident_record import Suspect
from profd.watch.kinds.kind import RankSteps
from profd.watch.slowdown_rules import (
    WINDOW_Q,
    RegressionRule,
    SlowRank,
    SlowRankRule,
    WaitedFor,
    WaitRule,
    WatchRules,
)
from profd.watch.spike_rule import RankTick, is_candidate, spikes

#: Ranks read in one slice of a pass (~0.6 ms at 5 us a rank): operators are answered between.
SLICE = 128

#: A rank's key in the registry and the ledgers, and its ledger's epoch (None: no ledger).
_Members = dict[tuple[str, int], "int | None"]


class _Job:
    """One job's rules and who they were fed from."""

    __slots__ = ("members", "regression", "roles", "waits")

    def __init__(self, rules: WatchRules) -> None:
        self.regression = RegressionRule(rules)
        self.roles: dict[str, SlowRankRule] = {}
        self.waits: dict[str, WaitRule] = {}
        self.members: _Members = {}


class Detectors:
    def __init__(
        self,
        ledgers: Ledgers,
        registry: Registry,
        incidents: Incidents,
        rules: WatchRules,
        enabled: bool = True,
    ) -> None:
        self.ledgers = ledgers
        self.registry = registry
        self.incidents = incidents
        self.rules = rules
        self.enabled = enabled
        self.jobs: dict[str, _Job] = {}
        self._last: float | None = None  # the last tick (monotonic)

    def reconfigure(self, rules: WatchRules, enabled: bool) -> None:
        """New ``[watch]`` settings: rules start again (their holds and baselines were
        measured against the old ones)."""
        if rules != self.rules or enabled != self.enabled:
            self.jobs.clear()
        self.rules, self.enabled = rules, enabled

    def tick(self, now: float) -> None:
        """Feed every job's rules with what the ledger got since the last tick (monotonic
        ``now``), all at once."""
        for _ in self.slices(now):
            pass

    def slices(self, now: float) -> Iterator[None]:
        """:meth:`tick` in slices of :data:`SLICE` ranks (the loop answers operators between
        two: at 1,024 ranks a whole pass is ~6 ms). Between two slices nothing here is half
        changed: a job's rules are fed only after its last slice has read every rank."""
        since = self._last if self._last is not None else now - 1.0
        self._last = now
        if not self.enabled:
            self.jobs.clear()
            return
        by_job = self.registry.owned_by_job()
        for gone in [j for j in self.jobs if j not in by_job]:
            del self.jobs[gone]
        for job, clients in by_job.items():
            w = self.jobs.get(job)
            if w is None:
                w = self.jobs[job] = _Job(self.rules)
            yield from self._job(job, w, clients, since, now)

    def _job(
        self, job: str, w: _Job, clients: list[Client], since: float, now: float
    ) -> Iterator[None]:
        ledgers = self.ledgers
        members: _Members = {}
        tick_ms: list[float] = []
        steps = 0
        top = 0
        cutoff = now - self.rules.window
        roles: dict[str, dict[int, tuple[float, int, float | None, int]]] = {}
        candidates: dict[tuple[str, int], RankTick] = {}
        # The job's open incidents count their loss from this tick's steps alone (each
        # ledger interval ends in one tick), never from the window, which every tick reads
        # again: summed over ticks it would count each step once per tick it stays in it.
        ticks: list[RankSteps] | None = [] if self.incidents.open_in(job) else None
        read = ledgers.watch
        for i, c in enumerate(clients):
            if i and not i % SLICE:
                yield
            key = c.key
            ms, n, epoch, q, wn, tick_top, wait_ms, wait_n = read(key, since, cutoff, WINDOW_Q)
            members[key] = epoch
            if is_candidate(tick_top, q):
                med, med_n = ledgers.median_ms(key, cutoff)
                if med is not None:
                    candidates[key] = RankTick(tick_top, med, med_n)
            if ticks is not None:
                ticks.append(RankSteps(c.role, c.rank, ms, n))
            if ms is not None:
                tick_ms.append(ms)
                if n > steps:
                    steps = n
            if c.step > top:
                top = c.step
            if q is not None:
                r = roles.get(c.role)
                if r is None:
                    roles[c.role] = {c.rank: (q, wn, wait_ms, wait_n)}
                else:
                    r[c.rank] = (q, wn, wait_ms, wait_n)
        if ticks is not None:
            self.incidents.count_loss(job, ticks)
        if members != w.members:
            # A rank came, left, set its step count or restarted: the job's step time before
            # is not its baseline any more.
            w.regression.reset()
            w.members = members
        found = w.regression.observe(now, median(tick_ms) if tick_ms else 0.0, steps)
        if found is not None:
            names = {c.role for c in clients}
            rules = self.rules
            self.incidents.open(
                "regression",
                job,
                next(iter(names)) if len(names) == 1 else None,
                [],
                top,
                {
                    "window_ms": round(found.window_ms, 3),
                    "baseline_ms": round(found.baseline_ms, 3),
                    "ratio": round(found.ratio, 4),
                    "threshold": round(found.threshold, 4),
                    "window_s": rules.window,
                    "baseline_s": rules.baseline,
                    "hold_s": rules.hold,
                    "ranks": len(clients),
                },
            )
        if candidates:
            self._spike(job, clients, candidates)
        yield
        self._roles(job, w, clients, roles, now)

    def _roles(
        self,
        job: str,
        w: _Job,
        clients: list[Client],
        roles: dict[str, dict[int, tuple[float, int, float | None, int]]],
        now: float,
    ) -> None:
        """Each role's slow-rank rules: by step time, and in lockstep by collective wait."""
        for gone in [g for g in w.roles if g not in roles]:
            del w.roles[gone]
        for gone in [g for g in w.waits if g not in roles]:
            del w.waits[gone]
        for role, ranks in roles.items():
            if len(ranks) < 2:
                w.roles.pop(role, None)
                w.waits.pop(role, None)
                continue
            rule = w.roles.get(role)
            if rule is None:
                rule = w.roles[role] = SlowRankRule(self.rules)
            slow = rule.observe(now, {rank: (q, n) for rank, (q, n, _, _) in ranks.items()})
            if slow:
                self._slow(job, role, clients, slow)
            waits = w.waits.get(role)
            if waits is None:
                if not any(v[2] is not None for v in ranks.values()):
                    continue  # no rank of the role sends its wait: nothing to keep
                waits = w.waits[role] = WaitRule(self.rules)
            waited = waits.observe(now, ranks)
            if waited:
                self._waited_for(job, role, clients, waited)

    def _spike(
        self, job: str, clients: list[Client], candidates: dict[tuple[str, int], RankTick]
    ) -> None:
        found = spikes(candidates, self.rules.spike)
        if found is None:
            return
        by_key = {c.key: c for c in clients}
        spiked = sorted((by_key[k] for k in found.ranks), key=lambda c: (c.role, c.rank))
        roles = {c.role for c in spiked}
        self.incidents.open(
            "spike",
            job,
            next(iter(roles)) if len(roles) == 1 else None,
            [Suspect(c.host, c.role, c.rank) for c in spiked],
            max(c.step for c in spiked),
            {
                "step_ms": round(max(top for top, _ in found.ranks.values()), 3),
                "median_ms": round(min(med for _, med in found.ranks.values()), 3),
                "ratio": round(found.ratio, 4),
                "excess_ms": round(found.excess_ms, 3),
                "threshold": found.threshold,
                "spiked": {
                    f"{c.role}:{c.rank}": [round(v, 3) for v in found.ranks[c.key]] for c in spiked
                },
            },
        )

    def _waited_for(
        self, job: str, role: str, clients: list[Client], found: list[WaitedFor]
    ) -> None:
        named = {
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
        self._slow_ranks(job, role, clients, named)

    def _slow(self, job: str, role: str, clients: list[Client], slow: list[SlowRank]) -> None:
        named = {
            s.rank: {
                "step_ms": round(s.step_ms, 3),
                "peers_ms": round(s.peers_ms, 3),
                "ratio": round(s.ratio, 4),
                "threshold": round(s.threshold, 4),
            }
            for s in slow
        }
        self._slow_ranks(job, role, clients, named)

    def _slow_ranks(
        self, job: str, role: str, clients: list[Client], named: dict[int, dict[str, Any]]
    ) -> None:
        """A ``slow_rank`` incident for each rank in ``named`` (its rule's figures), whichever
        rule found it: step times, or the collective wait of a lockstep role."""
        by_rank = {c.rank: c for c in clients if c.role == role}
        r = self.rules
        for rank, figures in named.items():
            c = by_rank.get(rank)
            if c is None:
                continue
            evidence = {**figures, "window_s": r.window, "hold_s": r.hold, "ranks": len(by_rank)}
            self.incidents.open(
                "slow_rank", job, role, [Suspect(c.host, role, rank)], c.step, evidence
            )
