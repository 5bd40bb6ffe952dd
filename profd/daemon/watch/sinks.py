"""Where an incident goes each time it changes (docs/design.md "Incidents"): each a
:class:`Sink`, passed to :class:`~profd.daemon.watch.incident_store.Incidents` in the order they
run. A sink that raises stops the ones after it, and the incident is saved again at the next
tick (``new`` False then): the record first, its upload only once it is written.

An incident whose evidence holds stacks (a hang's: function names, file paths, native
frames, flight records) is a file of the job owner's alone (0600, the owner's uid), not the
group's like other spool files: the group shares traces on purpose, but ``profctl stacks``
shows a member only their own processes, and an incident must not be a way around that.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from profd.daemon.spool.clientfiles import made_dir
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.fsutil import atomic_path
from profd.store import layout
from profd.store.index import FileRepo, IncidentRepo
from profd.watch.incident_record import Incident, has_stacks
from profd.watch.kinds import registry as kinds


class Sink(Protocol):
    def save(self, inc: Incident, new: bool) -> None:
        """``inc`` changed (``new``: it was just opened); raises when it could not be kept."""


class UploadQueue(Protocol):
    def kick(self) -> None: ...


class IncidentCounts:
    """Incidents opened since the daemon started, by kind (``/metrics``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(kinds.names(), 0)

    def save(self, inc: Incident, new: bool) -> None:
        if new:
            self.counts[inc.kind] = self.counts.get(inc.kind, 0) + 1

    def published(self) -> tuple[tuple[str, int], ...]:
        """(metric label, count) of every kind, each present."""
        return tuple((k.label, self.counts.get(k.name, 0)) for k in kinds.ALL)


class SpoolFile:
    """``{job}/incidents/{id}.json`` in the spool."""

    def __init__(self, spool: Path, perms: SpoolPerms) -> None:
        self.spool = spool
        self.perms = perms

    def path(self, inc: Incident) -> Path:
        return self.spool.joinpath(*layout.incident_parts(inc.job, inc.id))

    def save(self, inc: Incident, new: bool) -> None:
        parts = layout.incident_parts(inc.job, inc.id)
        with made_dir(self.spool, [self.perms.shared(inc.job), self.perms.final(parts[1])]):
            pass
        private = has_stacks(inc.evidence)
        with atomic_path(self.path(inc), 0o600 if private else self.perms.file_mode) as tmp:
            tmp.write_text(json.dumps(inc.to_dict(), indent=2, sort_keys=True))
            if private and inc.owner is not None and inc.owner >= 0 and os.geteuid() == 0:
                os.chown(tmp, inc.owner, -1)


class IndexRows:
    """The incident's row in the index, and its spool file's (``file``, written before),
    queued for S3 when ``uploading``."""

    def __init__(
        self, store: IncidentRepo, files: FileRepo, file: SpoolFile, uploading: bool
    ) -> None:
        self.store = store
        self.files = files
        self.file = file
        self.uploading = uploading

    def save(self, inc: Incident, new: bool) -> None:
        path = self.file.path(inc)
        # One transaction over both repositories (one connection): the row and its file.
        with self.store.transaction():
            self.store.save_incident(inc.to_dict())
            self.files.add_file(
                {
                    "session": inc.id,
                    "job": inc.job,
                    "kind": "incident",
                    "path": str(path),
                    "rel": layout.incident_key(inc.job, inc.id),
                    "bytes": path.stat().st_size,
                    "upload_state": "pending" if self.uploading else "local",
                }
            )


class UploadKick:
    """Wakes the uploader: the incident's file is queued."""

    def __init__(self, uploads: UploadQueue) -> None:
        self.uploads = uploads

    def save(self, inc: Incident, new: bool) -> None:
        self.uploads.kick()


def record_sinks(
    store: IncidentRepo,
    files: FileRepo,
    spool: Path,
    perms: SpoolPerms,
    uploads: UploadQueue | None,
) -> list[Sink]:
    """The spool file, the index and, with an uploader, S3: in the order they must run."""
    file = SpoolFile(spool, perms)
    out: list[Sink] = [file, IndexRows(store, files, file, uploads is not None)]
    if uploads is not None:
        out.append(UploadKick(uploads))
    return out
