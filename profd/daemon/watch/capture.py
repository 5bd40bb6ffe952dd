"""An incident's automatic capture (docs/design.md "Watch", "Automatic capture").

The suspects and one healthy peer of each suspect's role (a ``regression``: the job's ranks
on this node, at most ``capture_ranks``), armed at the earliest step every one of them can
make: the planner's ``--next``, through the same :class:`Starter` as ``profctl start``, with
``record_shapes`` and ``with_stack`` on, 2 active steps, labelled ``incident:ID``. Only the
job owner's processes (``Registry.owned``): an automatic capture acts for the owner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from statistics import median_high

from profd.config import WatchConfig
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.sessions.starts import Starter, StartRequest
from profd.daemon.watch.incident_store import LABEL
from profd.scheduling.refusal import Refused
from profd.watch.incident_record import Incident
from profd.watch.kinds import registry as kinds
from profd_client.protocol import ErrorCode

#: Steps an incident's capture records.
ACTIVE_STEPS = 2


class IncidentCapture:
    def __init__(
        self,
        registry: Registry,
        ledgers: Ledgers,
        starter: Starter,
        cfg: Callable[[], WatchConfig],
    ) -> None:
        self.registry = registry
        self.ledgers = ledgers
        self.starter = starter
        self.cfg = cfg

    def __call__(self, inc: Incident) -> str:
        """Arm ``inc``'s capture; its session id (:class:`Refused`: why not)."""
        chosen = self.choose(inc)
        if not chosen:
            raise Refused(ErrorCode.NO_MATCH, f"no rank of job {inc.job} to capture is attached")
        spec: dict[str, object] = {
            "job": inc.job,
            "pids": sorted({c.pid for c in chosen}),
            "next": True,
            "active": ACTIVE_STEPS,
            "options": {"record_shapes": True, "with_stack": True},
            "label": LABEL + inc.id,
        }
        hosts = {c.host for c in chosen}
        if len(hosts) == 1:
            spec["host"] = hosts.pop()  # pids are unique per host only
        return self.starter.start(StartRequest.parse(spec)).id

    def choose(self, inc: Incident) -> list[Client]:
        """The ranks to capture: see the module's docstring. Only ranks their job's
        ``PROFD_RANKS`` lets profile, of the job's owner."""
        reg = self.registry
        mine = [c for c in reg if c.job == inc.job and c.allowed and reg.owned(c)]
        mine.sort(key=lambda c: (c.role, c.rank, c.host, c.pid))
        if kinds.known(inc.kind).job_wide or not inc.suspects:
            return mine[: self.cfg().capture_ranks]
        named = {(s.host, s.role, s.rank) for s in inc.suspects}
        suspects = [c for c in mine if (c.host, c.role, c.rank) in named]
        out = list(suspects)
        taken = {c.key for c in suspects}
        now = time.monotonic()
        for role in sorted({c.role for c in suspects}):
            peers = [c for c in mine if c.role == role and c.key not in taken]
            peer = self._typical(peers, now)
            if peer is not None:
                out.append(peer)
        return out

    def _typical(self, peers: list[Client], now: float) -> Client | None:
        """The peer whose step time is nearest its peers' median: healthy, by that measure
        (the lowest rank when none has step times)."""
        timed = []
        for c in peers:
            p50 = self.ledgers.figures(c, now).p50_ms
            if p50 is not None:
                timed.append((p50, c))
        if not timed:
            return peers[0] if peers else None
        # A value one of them has (of two middle ones, the upper): that peer is nearest.
        mid = median_high(p for p, _ in timed)
        return min(timed, key=lambda pc: (abs(pc[0] - mid), pc[1].rank))[1]
