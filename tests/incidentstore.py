"""An incident store over a real index file and spool, wired as the daemon wires it (the
record's sinks in order), for tests and benchmarks that drive :class:`Incidents` directly."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from profd.config import WatchConfig
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.daemon.watch.incident_store import Capture, Incidents, OwnerOf
from profd.daemon.watch.sinks import IncidentCounts, Sink, record_sinks
from profd.store.index import Database, FileRepo, IncidentRepo, SessionRepo


def incidents_on(
    db: Database | Path,
    spool: Path,
    cfg: WatchConfig,
    perms: SpoolPerms | None = None,
    host: str = "n1",
    capture: Capture | None = None,
    clock: Callable[[], float] = time.time,
    owner_of: OwnerOf | None = None,
    counts: bool = False,
) -> Incidents:
    """``db``: an open index or its file; ``counts``: with the ``/metrics`` counting sink."""
    db = db if isinstance(db, Database) else Database(db)
    store = IncidentRepo(db)
    sinks: list[Sink] = [IncidentCounts()] if counts else []
    sinks += record_sinks(store, FileRepo(db), spool, perms or SpoolPerms(None), None)
    return Incidents(
        store, SessionRepo(db), host, cfg, sinks, capture=capture, clock=clock, owner_of=owner_of
    )
