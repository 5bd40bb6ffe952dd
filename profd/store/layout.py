"""Where a session's files live below the spool and the S3 prefix (one rule, both sides).

A session is ``{job}/{session}/``, one ``c{cycle}/`` per cycle holding every rank's files. Its
manifest is ``session.json``, except for a cluster session (one id, several nodes, one S3
directory): there each node's manifest is ``session.{node}.json``, so none overwrites another.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

MANIFEST = "session.json"


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
