"""What every request handler is given: the daemon's fixed facts and the collaborators that
own the answers. Handlers see this, never the router or the daemon."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profd.daemon.clients.blackbox_collect import BlackboxCollector
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.registry import Registry
from profd.daemon.clients.stack_sources import RankStacks
from profd.daemon.runtime.peers import Requester
from profd.daemon.sessions.starts import Starter
from profd.daemon.sessions.state import Sessions
from profd.daemon.watch.incident_store import Incidents
from profd.store.index import (
    FileRepo,
    SessionRepo,
    StepMinuteRepo,
    TraceRepo,
    UploadQueueRepo,
    WarehouseQueueRepo,
)

if TYPE_CHECKING:  # the export imports pyarrow: only a daemon that exports loads it
    from profd.warehouse.export import Exporter


@dataclass(frozen=True)
class DaemonFacts:
    """What ``status`` reports about the daemon itself; fixed at start."""

    host: str  # the node name: ``[daemon] node_name``, else the hostname
    started: float
    runtime_dir: Path
    state_dir: Path
    spool: Path
    max_spool_bytes: int | None
    #: The machine's boot id: tells profctl --cluster pull whether spool paths are its own.
    boot_id: str | None = None
    #: Members of ``[daemon] admin_group`` may stop and retry any user's sessions.
    admin_gid: int | None = None
    #: The clients' heartbeat interval (``[daemon] heartbeat_interval``): how long a rank's
    #: step is moved on at its rate (``step_now``).
    heartbeat_interval: float = 1.0


@dataclass(frozen=True)
class Context:
    facts: DaemonFacts
    registry: Registry
    ledgers: Ledgers
    sessions: Sessions
    #: The index, by area: what requests read back (sessions, traces, spool and queue
    #: figures, step minutes).
    session_rows: SessionRepo
    traces: TraceRepo
    files: FileRepo
    queue: UploadQueueRepo
    minutes: StepMinuteRepo
    starter: Starter
    #: Persists the loop's session changes: requests that read the index call it first, so
    #: the answer has every change so far.
    flush: Callable[[], None]
    #: Counters owned elsewhere (pipeline, uploads, rejected agent frames).
    live_status: Callable[[], dict[str, Any]]
    retry: Callable[[str | None], int]
    incidents: Incidents
    stacks: RankStacks | None
    #: Control requests the router could not decode (owned by the router).
    rejected: Callable[[], int]
    #: Collects ranks' black boxes (``blackbox``); None: this daemon asks for none.
    blackboxes: BlackboxCollector | None = None
    #: The fleet warehouse's export (``warehouse``); None: no export here.
    warehouse: Exporter | None = None
    #: The index rows the export has not written yet, on the loop's connection.
    warehouse_rows: WarehouseQueueRepo | None = None

    def stamp(self, rows: Iterable[dict[str, Any]]) -> None:
        # Which daemon a row came from, for profctl --cluster: a row's own ``host`` is what
        # the client called its machine (a pod's name, or the same host for several test
        # daemons), which does not tell nodes apart.
        for r in rows:
            r["node"] = self.facts.host


#: A request type's handler: the decoded request and who asks -> the reply's ``data`` (or a
#: :class:`Later`); raises ``Refused`` for an answer that is an error.
Handler = Callable[[Context, dict[str, Any], Requester], Any]


class Later:
    """A handler's answer that is not ready yet (stacks read by worker threads). ``start``
    is given the function that sends the reply; the work must call it exactly once, on the
    loop (through the Reactor), so the REQ peer gets its one reply."""

    def __init__(self, start: Callable[[Callable[[Any], None]], None]) -> None:
        self.start = start
