"""The detectors on the loop (docs/design.md "Watch"): once a tick, from the step ledger,
never blocking (reads of memory only; an incident's record is the only write).

For each job attached to this node, every rank's ledger is read once (a
:class:`~profd.watch.kinds.kind.JobReading`) and handed to the rule of each incident kind
that has one (``Kind.tick_rule``: regression, slow_rank, spike), made once per job: which
rules there are, and what they look at, is the kinds' business, not this module's. What
they find goes to :meth:`Incidents.open`. A job with an open incident (of any kind) also
hands its ranks' steps of the tick to :meth:`Incidents.count_loss`: what the incident cost,
tick after tick.

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

from collections.abc import Iterator, Sequence

from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.watch.incident_store import Incidents
from profd.watch.kinds.kind import JobReading, Kind, RankSteps, TickRank, TickRule
from profd.watch.kinds.registry import ALL as ALL_KINDS
from profd.watch.slowdown_rules import WINDOW_Q, WatchRules

#: Ranks read in one slice of a pass (~0.6 ms at 5 us a rank): operators are answered between.
SLICE = 128

#: A rank's key in the registry and the ledgers, and its ledger's epoch (None: no ledger).
_Members = dict[tuple[str, int], "int | None"]


class _Job:
    """One job's rules (one per kind that has a tick rule) and who they were fed from."""

    __slots__ = ("members", "rules")

    def __init__(self, kinds: Sequence[Kind], rules: WatchRules) -> None:
        self.rules: list[tuple[str, TickRule]] = [
            (k.name, k.tick_rule(rules)) for k in kinds if k.tick_rule is not None
        ]
        self.members: _Members = {}


class Detectors:
    def __init__(
        self,
        ledgers: Ledgers,
        registry: Registry,
        incidents: Incidents,
        rules: WatchRules,
        enabled: bool = True,
        kinds: Sequence[Kind] = ALL_KINDS,
    ) -> None:
        self.ledgers = ledgers
        self.registry = registry
        self.incidents = incidents
        self.rules = rules
        self.enabled = enabled
        #: The kinds whose tick rules run (the registry's: every kind that has one).
        self.kinds = tuple(kinds)
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
                w = self.jobs[job] = _Job(self.kinds, self.rules)
            yield from self._job(job, w, clients, since, now)

    def _job(
        self, job: str, w: _Job, clients: list[Client], since: float, now: float
    ) -> Iterator[None]:
        ledgers = self.ledgers
        ranks: list[TickRank] = []
        cutoff = now - self.rules.window
        read = ledgers.watch
        for first in range(0, len(clients), SLICE):
            if first:
                yield
            ranks += [read(c, since, cutoff, WINDOW_Q) for c in clients[first : first + SLICE]]
        members: _Members = {(r.host, r.pid): r.epoch for r in ranks}
        if self.incidents.open_in(job):
            # The job's open incidents count their loss from this tick's steps alone (each
            # ledger interval ends in one tick), never from the window, which every tick
            # reads again: summed over ticks it would count each step once per tick it
            # stays in it.
            self.incidents.count_loss(
                job, [RankSteps(r.role, r.rank, r.tick_ms, r.tick_steps) for r in ranks]
            )
        changed = members != w.members
        w.members = members
        reading = JobReading(
            job,
            now,
            ranks,
            changed,
            lambda r: ledgers.median_ms((r.host, r.pid), cutoff),
        )
        opened = self.incidents.open
        large = len(ranks) > SLICE
        for kind, rule in w.rules:
            if large:
                yield  # a large job's rules are slices of their own
            for f in rule.observe(reading):
                opened(kind, job, f.role, f.suspects, f.step, f.evidence)
