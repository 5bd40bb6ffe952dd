"""Freezing the black box into every new incident (docs/design.md "Black box").

When an incident opens, :class:`Freezer` (one of the incident's sinks) asks the job's ranks on
this node for their black boxes, the suspects first (``BlackboxCollector``: 5 s at most, a
rank that does not answer or exits is named, not waited for). A worker thread writes them as
one Perfetto trace, ``{job}/incidents/{id}.blackbox.json.gz`` (written whole, then renamed:
a daemon killed meanwhile leaves no half file, and the incident without a black box rather
than with a broken one), and reads what they show (:func:`profd.blackbox.onset.onset`).
:class:`FrozenBoxes`, a part of the loop, then adds that to the incident's evidence
(``blackbox``) and queues the trace for S3 beside the incident's record.

The trace shows the job's code (stack samples): like a hang's stacks it is the job owner's
file alone (0600, the owner's uid).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from profd.blackbox import perfetto
from profd.blackbox.onset import onset
from profd.daemon.clients.blackbox_collect import BlackboxCollector, Collected
from profd.daemon.clients.registry import Client
from profd.daemon.runtime import faults
from profd.daemon.spool.clientfiles import made_dir
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.reactor import Reactor
from profd.store import layout
from profd.watch.incident_record import Incident

log = logging.getLogger("profd")


class Frozen(NamedTuple):
    """A black box written and read, waiting for the loop to add it to its incident."""

    incident: str  # the incident's id
    evidence: dict[str, Any]  # what goes into the incident's evidence, as ``blackbox``
    path: Path  # the Perfetto trace written


class Freezer:
    """An incident sink: a new incident's black box, collected and written off the loop."""

    def __init__(
        self,
        collector: BlackboxCollector,
        clients_of: Callable[[str], list[Client]],
        spool: Path,
        perms: SpoolPerms,
        reactor: Reactor,
        enabled: bool = True,
    ) -> None:
        self.collector = collector
        self.clients_of = clients_of
        self.spool = spool
        self.perms = perms
        self.reactor = reactor
        self.enabled = enabled
        #: Written and read, waiting for the loop to add them to their incidents.
        self.frozen: list[Frozen] = []

    def save(self, inc: Incident, new: bool) -> None:
        if not new or not self.enabled:
            return
        clients = self.clients_of(inc.job)
        if not clients:
            log.info(
                "incident %s: no rank of job %s is attached here: no black box", inc.id, inc.job
            )
            return
        asked = time.monotonic()
        ratio = float(inc.evidence.get("ratio") or 1.0)

        def collected(got: Collected) -> None:
            args = (inc.id, inc.job, inc.kind, inc.step, ratio, inc.owner, got, asked)
            threading.Thread(
                target=self._write, args=args, name="profd-blackbox", daemon=True
            ).start()

        self.collector.collect(clients, collected, first=[s.rank for s in inc.suspects])

    def _write(
        self,
        iid: str,
        job: str,
        kind: str,
        step: int | None,
        ratio: float,
        owner: int | None,
        got: Collected,
        asked: float,
    ) -> None:
        collect_s = time.monotonic() - asked
        faults.point("blackbox-collected")
        try:
            path = self._path(job, iid)
            size = perfetto.write(got.boxes, path, 0o600)
            if owner is not None and owner >= 0 and os.geteuid() == 0:
                os.chown(path, owner, -1)
            shown = onset(got.boxes, step, kind, ratio)
            doc = {
                "file": layout.key(layout.blackbox_parts(job, iid)),
                "bytes": size,
                "collect_s": round(collect_s, 3),
                "frozen_s": round(time.monotonic() - asked, 3),
                "missing": got.missing_maps(),
                **shown,
            }
        except Exception as exc:  # a full disk: the incident stays, without its black box
            log.warning("incident %s: cannot keep its black box: %s", iid, exc)
            return
        self.reactor.call_soon(self.frozen.append, Frozen(iid, doc, path))

    def _path(self, job: str, iid: str) -> Path:
        parts = layout.blackbox_parts(job, iid)
        with made_dir(self.spool, [self.perms.shared(job), self.perms.final(parts[1])]):
            pass
        return self.spool.joinpath(*parts)

    def take(self) -> list[Frozen]:
        out, self.frozen = self.frozen, []
        return out


def file_row(job: str, iid: str, path: Path, uploading: bool) -> dict[str, Any]:
    """The trace's row in the index's files (queued for S3 when ``uploading``)."""
    return {
        "session": iid,
        "job": job,
        "kind": "blackbox",
        "path": str(path),
        "rel": layout.key(layout.blackbox_parts(job, iid)),
        "bytes": path.stat().st_size,
        "upload_state": "pending" if uploading else "local",
    }
