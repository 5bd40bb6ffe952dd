"""The loop's periodic work as uniform parts: each tick the loop runs every :class:`Part` in
order, and a SIGHUP hands each the new ``[watch]``. A part that fails is logged and counted,
and the others run as if it had not (:class:`Parts`).

Each part wraps the collaborator that owns its work; it is given that collaborator at
construction and never reaches for anything else.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from profd.config import WatchConfig
from profd.daemon.agent.attach import Attach
from profd.daemon.agent.handler import AgentHandler
from profd.daemon.agent.intake import Intake
from profd.daemon.agent.liveness import Liveness
from profd.daemon.captures.lanes import Captures
from profd.daemon.clients.agent_dumps import AgentBlackboxes, AgentStacks
from profd.daemon.clients.history import StepHistory
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.metrics import MetricsServer
from profd.daemon.sessions.nsysruns import NsysRuns
from profd.daemon.sessions.samples import Samples, rules_of
from profd.daemon.sessions.state import Sessions
from profd.daemon.watch.blackbox_freeze import Freezer, file_row
from profd.daemon.watch.detector_runs import Detectors
from profd.daemon.watch.incident_store import Incidents
from profd.daemon.watch.sinks import IncidentCounts, UploadQueue
from profd.daemon.watch.stall_watch import Hangs
from profd.scheduling.refusal import Refused
from profd.states import LIVE
from profd.store.index import FileRepo, UploadQueueRepo
from profd.watch.snapshot import Snapshot

log = logging.getLogger("profd")

#: Seconds between two reads of the upload queue's size for ``/metrics``: a query of the
#: queued files (~2 ms for 1,000 of them), too much for every tick.
QUEUE_BYTES_EVERY = 10.0


class Part(Protocol):
    """One unit of the loop's periodic work."""

    #: What it does, as the log says when it fails ("running the detectors").
    what: str

    def tick(self, mono: float, wall: float) -> Iterator[None] | None:
        """Once a tick: ``mono`` from ``time.monotonic``, ``wall`` from ``time.time``. A part
        whose work grows with the ranks returns an iterator that does it in slices, yielding
        between two (where nothing it holds is half changed): operators are answered there."""
        ...

    def reconfigure(self, watch: WatchConfig) -> None:
        """A new ``[watch]`` (SIGHUP). Parts with no setting of their own keep this one."""
        return None


class Parts:
    """Runs its parts in order; owns how many times each failed."""

    def __init__(self, parts: Iterable[Part]) -> None:
        self.parts = tuple(parts)
        #: Ticks and reconfigurations that raised, by the part's ``what``.
        self.failures: dict[str, int] = {p.what: 0 for p in self.parts}

    def tick(self, mono: float, wall: float, between: Callable[[], bool] | None = None) -> None:
        """Run every part once; ``between`` after each and after each slice of a sliced part
        (the loop answers operators there, so a request waits for one slice at most, not for
        the whole tick: ~1 ms at 1,024 ranks). When ``between`` did something (True), the
        parts after it are given the clocks as they are then."""
        for p in self.parts:
            if not guarded(p.what, _run, p, mono, wall, between):
                self.failures[p.what] += 1
            if between is not None and between():
                mono, wall = time.monotonic(), time.time()

    def reconfigure(self, watch: WatchConfig) -> None:
        for p in self.parts:
            if not guarded(f"reconfiguring {p.what}", p.reconfigure, watch):
                self.failures[p.what] += 1


def _run(p: Part, mono: float, wall: float, between: Callable[[], bool] | None) -> None:
    slices = p.tick(mono, wall)
    if slices is not None:
        for _ in slices:
            if between is not None:
                between()


def guarded(what: str, fn: Callable[..., Any], *args: Any) -> bool:
    """Run one unit of work; a bug in it is logged once with context and the loop goes on.
    False when it raised."""
    try:
        fn(*args)
    except Refused as exc:
        log.warning("%s: %s", what, exc)
    except Exception:
        log.exception("error %s", what)
    else:
        return True
    return False


class HeartbeatAnswers(Part):
    """The heartbeat answers owed to ``quiet`` clients since the last tick."""

    what = "answering heartbeats"

    def __init__(self, agents: AgentHandler) -> None:
        self.agents = agents

    def tick(self, mono: float, wall: float) -> None:
        self.agents.answer_owed()


class Pacing(Part):
    """The heartbeat pace for the processes attached now, told to each when it changes."""

    what = "pacing heartbeats"

    def __init__(self, attach: Attach) -> None:
        self.attach = attach

    def tick(self, mono: float, wall: float) -> None:
        self.attach.repace(mono)


class Housekeeping(Part):
    """Clients whose heartbeats stopped, and the targets they leave."""

    what = "housekeeping"

    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness

    def tick(self, mono: float, wall: float) -> None:
        self.liveness.tick(mono)


class StackExpiry(Part):
    """Questions to agent threads (stacks, black boxes) past their deadline or whose client
    left."""

    what = "expiring agent-thread requests"

    def __init__(self, *askers: AgentStacks | AgentBlackboxes) -> None:
        self.askers = askers

    def tick(self, mono: float, wall: float) -> None:
        for a in self.askers:
            a.expire(mono)


class LedgerMinutes(Part):
    """Closes the ended minutes of ``clients`` (the registry: those attached), and every
    open minute of the ranks not among them."""

    what = "closing step-ledger minutes"

    def __init__(self, ledgers: Ledgers, clients: Iterable[Client]) -> None:
        self.ledgers = ledgers
        self.clients = clients

    def tick(self, mono: float, wall: float) -> None:
        # The tick's monotonic clock: what it holds back over the heartbeat rate is applied
        # as of the tick the other parts see. Minutes are closed by the ledger's own wall
        # clock, the one its heartbeats are filed by.
        self.ledgers.tick(self.clients, mono)


class MinuteWriter(Part):
    """Writes the closed minutes into the index (a separate part: the minutes closed before
    a failure here are written on the next tick)."""

    what = "writing step-ledger minutes"

    def __init__(self, history: StepHistory, ledgers: Ledgers) -> None:
        self.history = history
        self.ledgers = ledgers

    def tick(self, mono: float, wall: float) -> None:
        self.history.tick(self.ledgers.take_minutes())

    def reconfigure(self, watch: WatchConfig) -> None:
        self.history.reconfigure(watch.keep_history)


class Detecting(Part):
    what = "running the detectors"

    def __init__(self, detectors: Detectors) -> None:
        self.detectors = detectors

    def tick(self, mono: float, wall: float) -> Iterator[None]:
        return self.detectors.slices(mono)

    def reconfigure(self, watch: WatchConfig) -> None:
        self.detectors.reconfigure(watch.rules(), watch.enabled)


class StallWatch(Part):
    what = "watching for stalls"

    def __init__(self, hangs: Hangs) -> None:
        self.hangs = hangs

    def tick(self, mono: float, wall: float) -> None:
        self.hangs.tick(mono)

    def reconfigure(self, watch: WatchConfig) -> None:
        self.hangs.reconfigure(watch.stall_after, watch.enabled)


class IncidentKeeping(Part):
    """Resolves incidents no longer reported, forgets them after their cooldown."""

    what = "keeping incidents"

    def __init__(self, incidents: Incidents) -> None:
        self.incidents = incidents

    def tick(self, mono: float, wall: float) -> None:
        self.incidents.tick(wall)

    def reconfigure(self, watch: WatchConfig) -> None:
        self.incidents.reconfigure(watch)


class NsysPolling(Part):
    what = "polling nsys"

    def __init__(self, nsys: NsysRuns) -> None:
        self.nsys = nsys

    def tick(self, mono: float, wall: float) -> None:
        self.nsys.poll(mono)


class Sampling(Part):
    what = "sampling"

    def __init__(self, samples: Samples) -> None:
        self.samples = samples

    def tick(self, mono: float, wall: float) -> None:
        self.samples.tick(mono, wall)

    def reconfigure(self, watch: WatchConfig) -> None:
        self.samples.set_rules(rules_of(watch))


class FrozenBoxes(Part):
    """Adds each black box frozen since the last tick to its incident, and queues its trace
    for S3 beside the incident's record."""

    what = "keeping frozen black boxes"

    def __init__(
        self, freezer: Freezer, incidents: Incidents, files: FileRepo, uploads: UploadQueue | None
    ) -> None:
        self.freezer = freezer
        self.incidents = incidents
        self.files = files
        self.uploads = uploads

    def tick(self, mono: float, wall: float) -> None:
        for box in self.freezer.take():
            inc = self.incidents.attach_blackbox(box.incident, box.evidence)
            if inc is None:
                log.info("incident %s: forgotten before its black box was frozen", box.incident)
                continue
            self.files.add_file(file_row(inc.job, box.incident, box.path, self.uploads is not None))
            if self.uploads is not None:
                self.uploads.kick()


class MetricsPublisher(Part):
    """Hands ``/metrics`` a new snapshot of this daemon; owns the upload queue's size, read
    at most every :data:`QUEUE_BYTES_EVERY` seconds."""

    what = "publishing metrics"

    def __init__(
        self,
        server: MetricsServer,
        queue: UploadQueueRepo,
        sessions: Sessions,
        ledgers: Ledgers,
        registry: Registry,
        incidents: IncidentCounts,
    ) -> None:
        self.server = server
        self.queue = queue
        self.sessions = sessions
        self.ledgers = ledgers
        self.registry = registry
        self.incidents = incidents
        self._queue_bytes = 0
        self._queue_bytes_due = 0.0

    def tick(self, mono: float, wall: float) -> None:
        if wall >= self._queue_bytes_due:
            self._queue_bytes_due = wall + QUEUE_BYTES_EVERY
            try:
                self._queue_bytes = self.queue.queue_bytes()
            except sqlite3.Error as exc:  # the page goes on, with the last size read
                log.warning("metrics: cannot read the upload queue's size: %s", exc)
        by_state = dict.fromkeys(LIVE, 0)
        for s in self.sessions.live():
            by_state[s.state] = by_state.get(s.state, 0) + 1
        self.server.publish(
            Snapshot(
                at=wall,
                ranks=self.ledgers.series(self.registry),
                attached=len(self.registry),
                sessions=tuple(by_state.items()),
                incidents=self.incidents.published(),
                upload_queue_bytes=self._queue_bytes,
            )
        )


# What a full disk stopped, tried again each tick: the first success is the recovery.
class DeferredReports(Part):
    what = "storing deferred reports"

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    def tick(self, mono: float, wall: float) -> None:
        self.intake.retry_deferred()


class ParkedCaptures(Part):
    what = "retrying captures"

    def __init__(self, captures: Captures) -> None:
        self.captures = captures

    def tick(self, mono: float, wall: float) -> None:
        self.captures.retry_parked()


class OwedManifests(Part):
    what = "writing owed session.json files"

    def __init__(self, sessions: Sessions, write: Callable[[], None]) -> None:
        self.sessions = sessions
        self.write = write

    def tick(self, mono: float, wall: float) -> None:
        if self.sessions.manifests_owed:
            self.write()
