"""The stall rule on the loop (docs/design.md "Hangs"): a job is stalled on this node when none of
its ranks here finished a step for ``stall_after`` while their processes live; the daemon
then reads every rank's stacks once (off the loop, :class:`RankStacks`) and records a
``hang`` incident whose suspects are the ranks outside the majority group. A job that steps
again resolves it at once, also when the incident was opened before a daemon restart (the
restarted daemon holds it again from the index).

What it ignores: a job none of whose ranks this daemon saw finish a step (loading, compiling,
or already stuck when the daemon started: nothing says how long its steps take); a rank that
attached since its job's last step (it has not had the time to step). A rank whose agent
thread is silent (a C call holding the GIL) is still attached while its process lives
(``Liveness``) and counts as not stepping; py-spy reads it from outside. Only the job owner's
processes (``Registry.owned``) are judged and read: another user's process in the job
neither decides its stall nor puts its stacks in the owner's incident.
"""

from __future__ import annotations

import logging
from typing import Any

from profd.daemon.clients.registry import Client, Registry
from profd.daemon.clients.stack_sources import RankStacks, Rows
from profd.daemon.watch.incident_store import Incidents
from profd.watch import hang_diagnosis as hang
from profd.watch.incident_record import Suspect
from profd.watch.kinds.hang import KIND as HANG

log = logging.getLogger("profd.watch")

#: Seconds a stalled job's agent threads have to send their stacks or flight recorder.
AGENT_ANSWER_S = 4.0


class Hangs:
    def __init__(
        self,
        registry: Registry,
        stacks: RankStacks,
        incidents: Incidents,
        stall_after: float | None,
        enabled: bool = True,
    ) -> None:
        self.registry = registry
        self.stacks = stacks
        self.incidents = incidents
        self.stall_after = stall_after
        self.enabled = enabled
        self.clocks: dict[str, hang.StallClock] = {}
        #: Jobs whose stacks are being read, and jobs whose hang incident is open.
        self.reading: set[str] = set()
        self.stalled: set[str] = set()

    def reconfigure(self, stall_after: float | None, enabled: bool) -> None:
        self.stall_after, self.enabled = stall_after, enabled

    def tick(self, now: float) -> None:
        """Once a tick (monotonic ``now``): whose step moved, which jobs stalled, which
        stalled ones stepped again."""
        by_job: dict[str, list[Client]] = {}
        for job, owned in self.registry.owned_by_job().items():
            stepping = [c for c in owned if not c.attaching]
            if stepping:
                by_job[job] = stepping
        for job in [j for j in self.clocks if j not in by_job]:
            del self.clocks[job]
        for job in [j for j in self.stalled if j not in by_job]:
            # Its processes are gone (the watchdog killed them): the incident stays open
            # until its hold passes without the rule seeing it, as any other.
            self.stalled.discard(job)
        if not self.enabled:
            self.clocks.clear()
            return
        for job, clients in by_job.items():
            self._job(job, clients, now)

    def _job(self, job: str, clients: list[Client], now: float) -> None:
        clock = self.clocks.get(job)
        if clock is None:
            clock = self.clocks[job] = hang.StallClock()
        quiet = clock.observe(now, ((c.key, c.step, c.observed_sps) for c in clients))
        if quiet is None:
            return
        limit = hang.stall_limit(self.stall_after, clock.step_s)
        if quiet < limit:
            self.stalled.discard(job)
            # Whether this daemon opened the incident or restored it from the index (a
            # restart while the job was stalled): a job seen stepping here is not stalled.
            if self.incidents.clear(HANG.name, job):
                log.info("job %s steps again", job)
            return
        if job in self.stalled:
            self.incidents.still(HANG.name, job)
            return
        if job in self.reading:
            return
        self.reading.add(job)
        steps = {c.key: c.step for c in clients}
        # Native frames: where in C++ a wedged rank is (a collective's wait, a lock); the
        # half second of pause they cost does not matter to a job that is not stepping. Nobody
        # waits for this read: agent threads get longer to answer than a profctl's.
        self.stacks.read(
            list(clients),
            lambda rows: self._read(job, clients, steps, quiet, limit, rows),
            native=True,
            answer_s=AGENT_ANSWER_S,
        )

    def _read(
        self,
        job: str,
        clients: list[Client],
        steps: dict[tuple[str, int], int],
        quiet: float,
        limit: float,
        rows: Rows,
    ) -> None:
        """The stalled job's stacks, read: the incident (unless it stepped meanwhile)."""
        self.reading.discard(job)
        if not self.enabled:
            return
        clock = self.clocks.get(job)
        if clock is None or any(
            (r := clock.ranks.get(k)) is not None and r.step != s for k, s in steps.items()
        ):
            return  # it left, or stepped while its stacks were read: not stalled after all
        node = self.incidents.host
        # Named by this node, as profctl --cluster names rows, so every node's ranks of one
        # job group together (a pod's own hostname stays as client_host).
        found = hang.diagnose([row.on_node(node) for row in rows])
        roles = {c.role for c in clients}
        suspects = [Suspect(node, m.role, m.rank) for m in found.suspects]
        step_s = clock.step_s
        evidence: dict[str, Any] = {
            "stalled_s": round(quiet, 1),
            "stall_after_s": round(limit, 1),
            "step_ms": None if step_s is None else round(step_s * 1000, 3),
            "ranks_here": len(clients),
            **found.evidence(),
        }
        self.incidents.open(
            HANG.name,
            job,
            next(iter(roles)) if len(roles) == 1 else None,
            suspects,
            max(steps.values()),
            evidence,
        )
        self.stalled.add(job)
