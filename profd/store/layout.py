"""Where a session's files live below the spool and the S3 prefix (one rule, both sides).

A session is ``{job}/{session}/``, one ``c{cycle}/`` per cycle holding every rank's files. Its
manifest is ``session.json``, except for a cluster session (one id, several nodes, one S3
directory): there each node's manifest is ``session.{node}.json``, so none overwrites another.
A job's incidents are ``{job}/incidents/{id}.json``.

Training processes write their raw captures below ``.incoming/{job}/{session}/``, in
``plan{N}/`` for revision N of the session's steps (none for revision 0), each process in its
own directory (``protocol.target_dir``), one ``c{cycle}/`` per cycle. Only the final files go
to S3: their key below the prefix is their path below the spool.

Paths are given as their components (:data:`Parts`), because the daemon walks and creates
spool directories one component at a time; :func:`key` joins them for S3.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from profd_client.protocol import target_dir

MANIFEST = "session.json"
#: A job's incidents (docs/design.md "Watch"), one ``{id}.json`` each, beside its sessions.
INCIDENTS = "incidents"
INCOMING = ".incoming"
#: nsys writes a collection's reports here, below the session's incoming dir.
NSYS = "nsys"

#: A path below the spool root (and, for final files, below the S3 prefix), by component.
Parts = tuple[str, ...]


def key(parts: Parts) -> str:
    """``parts`` as a relative S3 key (or relative path)."""
    return "/".join(parts)


def revision_dir(revision: int) -> str:
    """The incoming dir of a re-planned revision: a stale capture of the old steps may still
    arrive, so its files stay apart. (``plan`` on disk, after the wire's field name.)"""
    return f"plan{revision}"


def cycle_dir(cycle: int) -> str:
    return f"c{cycle}"


def session_parts(job: str, session: str) -> Parts:
    """A session's final files: every node's, every cycle's."""
    return (job, session)


def session_key(job: str, session: str) -> str:
    """A session's directory as an S3 key below the prefix (no trailing ``/``)."""
    return key(session_parts(job, session))


def cycle_parts(job: str, session: str, cycle: int) -> Parts:
    """One cycle's final files, every rank's."""
    return (*session_parts(job, session), cycle_dir(cycle))


def manifest_parts(job: str, session: str, node: str | None = None) -> Parts:
    """A session's manifest; ``node`` names a cluster session's node (see :func:`manifest_name`)."""
    return (*session_parts(job, session), manifest_name(node))


def manifest_key(job: str, session: str, node: str | None = None) -> str:
    return key(manifest_parts(job, session, node))


def incoming_parts(job: str, session: str, revision: int = 0) -> Parts:
    """Where the processes armed with a session's revision write: below it, each its own dir."""
    parts: Parts = (INCOMING, job, session)
    return (*parts, revision_dir(revision)) if revision else parts


def home_parts(job: str, session: str, revision: int, host: str, pid: int) -> Parts:
    """The directory only process ``pid`` on ``host`` writes into."""
    return (*incoming_parts(job, session, revision), target_dir(host, pid))


def capture_parts(job: str, session: str, revision: int, host: str, pid: int, cycle: int) -> Parts:
    """A process's raw files of one cycle."""
    return (*home_parts(job, session, revision, host, pid), cycle_dir(cycle))


def raw_names(stem: str) -> dict[str, str]:
    """The only raw files a process may report for a cycle, by kind (the client names them
    the same way)."""
    return {"trace": f"{stem}.pt.trace.json", "memory": f"{stem}.memory.pickle"}


def incident_parts(job: str, incident: str) -> Parts:
    """An incident's record: ``{job}/incidents/{id}.json``, in the spool and in S3."""
    return (job, INCIDENTS, f"{incident}.json")


def incident_key(job: str, incident: str) -> str:
    return key(incident_parts(job, incident))


def blackbox_parts(job: str, incident: str) -> Parts:
    """The black box frozen into an incident, a Perfetto trace:
    ``{job}/incidents/{id}.blackbox.json.gz``, in the spool and in S3."""
    return (job, INCIDENTS, f"{incident}.blackbox.json.gz")


def nsys_parts(job: str, session: str) -> Parts:
    """Where nsys writes the reports of a session's collections."""
    return (*incoming_parts(job, session), NSYS)


def is_cluster_session(request: dict[str, object]) -> bool:
    """Started by a cluster coordinator (its cycles came with the request)."""
    return "cycles" in request


def manifest_name(node: str | None) -> str:
    """The manifest's file name in S3: per node for a cluster session (``node`` given)."""
    return MANIFEST if node is None else f"session.{safe_name(node)}.json"


def is_manifest(name: str) -> bool:
    return name == MANIFEST or bool(_NODE_MANIFEST.fullmatch(name))


def safe_name(name: str) -> str:
    """A node name as a file name: anything but ``[A-Za-z0-9._-]`` becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


_NODE_MANIFEST = re.compile(r"session\.[A-Za-z0-9._-]+\.json")


def missing_manifests(manifests: Sequence[dict[str, Any]]) -> str | None:
    """Why a cluster session's manifests in S3 are not all there yet, or None.

    Each node uploads its own when its part of the session ends; every manifest knows how
    many nodes the coordinator started the session on (``request.nodes``).
    """
    expected = max((int((m.get("request") or {}).get("nodes") or 0) for m in manifests), default=0)
    have = sorted({str(m.get("node")) for m in manifests})
    if len(have) >= expected:
        return None
    return (
        f"only {len(have)} of {expected} nodes' manifests are in S3 ({', '.join(have)}):"
        " the others are still uploading, or their daemon stopped before the session ended"
    )
