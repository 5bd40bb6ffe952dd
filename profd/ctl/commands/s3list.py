"""``profctl traces --s3``: list captures straight from the session manifests in S3.

No daemon and no SQLite index needed, so any node (or a laptop with credentials) sees the
whole cluster's captures. A session is listed only once its ``session.json`` is in S3, which
the uploader writes last: its presence means every file of the session is there.
"""

from __future__ import annotations

import calendar
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from profd import globs
from profd.config import ConfigError, S3Config, load
from profd.ctl.errors import CtlCode, CtlError
from profd.ctl.render import say
from profd.store import layout, s3

#: Sessions whose id says they started this long before ``--since`` are not even fetched.
SINCE_SLACK_S = 7 * 86400
FETCH_THREADS = 16


def ctl_s3(url: str | None) -> tuple[Any, S3Config]:
    """An S3 client for profctl: endpoint, region, addressing and checksum settings come from
    the same config and ``PROFD_S3_*`` environment as the daemon's; ``url`` overrides."""
    try:
        cfg = load().s3
        if url:
            cfg = replace(cfg, url=url)
        if not cfg.url:
            raise CtlError("no S3 location: pass --s3 s3://bucket/prefix or set PROFD_S3_URL")
        cfg.bucket_prefix()
    except ConfigError as exc:
        raise CtlError(str(exc), code=CtlCode.BAD_CONFIG) from None
    s3.quiet_sdk_logs()
    s3.remember_secrets()
    try:
        return s3.make_client(cfg, pool=FETCH_THREADS), cfg
    except Exception as exc:
        raise CtlError(f"S3: {s3.describe(exc)}", code=CtlCode.S3) from None


def s3_error(exc: BaseException) -> CtlError:
    return CtlError(f"S3: {s3.describe(exc)}", code=CtlCode.S3)


def child_dirs(client: Any, bucket: str, prefix: str) -> Iterator[str]:
    """Names of the "directories" right below ``prefix`` (which may end mid-name)."""
    base = prefix[: prefix.rfind("/") + 1]
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, Delimiter="/"
    )
    for page in pages:
        for cp in page.get("CommonPrefixes", []):
            name = cp["Prefix"][len(base) :].strip("/")
            if name:
                yield name


def session_started(session_id: str) -> float | None:
    """Session ids start with their UTC creation time: ``20250101-120000-abcdef``."""
    try:
        return float(calendar.timegm(time.strptime(session_id[:15], "%Y%m%d-%H%M%S")))
    except ValueError:
        return None


def find_sessions(
    client: Any,
    bucket: str,
    prefix: str,
    job: str | None = None,
    session: str | None = None,
    since: float | None = None,
) -> list[tuple[str, str]]:
    """(job, session) pairs under ``prefix``; ``session`` may be a unique-prefix short id."""
    base = f"{prefix}/" if prefix else ""
    jobs = [job] if job else list(child_dirs(client, bucket, base))
    out = []
    for j in jobs:
        # Ids starting with ``session``: the name is matched as a prefix.
        for sid in child_dirs(client, bucket, base + layout.session_key(j, session or "")):
            started = session_started(sid)
            if since is not None and started is not None and started < since - SINCE_SLACK_S:
                continue
            out.append((j, sid))
    return out


def read_manifests(client: Any, bucket: str, prefix: str, job: str, sid: str) -> list[Any]:
    """The session's manifests: its ``session.json``, or for a cluster session each node's
    ``session.{node}.json``; empty while the session is not complete in S3. Says on stderr
    when a cluster session's nodes have not all uploaded theirs: what is listed from them
    is then not the whole session."""
    one = _get_json(client, bucket, s3.join_key(prefix, layout.manifest_key(job, sid)))
    if one is not None:
        return [one]
    # Only a cluster session lacks session.json: one listing finds every node's manifest.
    base = s3.join_key(prefix, layout.session_key(job, sid)) + "/"
    keys = [
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=base + "session.", Delimiter="/"
        )
        for obj in page.get("Contents", [])
        if layout.is_manifest(obj["Key"][len(base) :])
    ]
    found = [m for k in sorted(keys) if (m := _get_json(client, bucket, k)) is not None]
    gap = layout.missing_manifests(found)
    if gap is not None:
        say(f"profctl: session {sid}: {gap}", err=True)
    return found


def _get_json(client: Any, bucket: str, key: str) -> Any:
    from botocore.exceptions import ClientError

    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return None
        raise
    try:
        return json.loads(body)
    except ValueError as exc:
        # One damaged manifest must not hide every other session.
        say(f"profctl: skipping s3://{bucket}/{key}: not JSON ({exc})", err=True)
        return None


def manifest_rows(m: dict[str, Any], bucket: str, prefix: str) -> list[dict[str, Any]]:
    """One row per rank per cycle, shaped like the daemon's ``traces --json`` rows."""

    def s3_file(kind: str, rel: str, size: int | None) -> dict[str, Any]:
        u = s3.uri(bucket, s3.join_key(prefix, rel))
        return {
            "kind": kind,
            "path": u,
            "bytes": size,
            "upload_state": "uploaded",
            "s3_uri": u,
            "last_error": None,
            "deleted": 0,
        }

    rows = []
    for t in m.get("targets", []):
        for res in t.get("results", []):
            rel = res.get("path")
            if not rel:
                continue  # this cycle failed on this rank: no trace
            files = [s3_file(f["kind"], f["path"], f.get("bytes")) for f in res.get("files", [])]
            if not files:
                files = [s3_file("trace", rel, res.get("bytes"))]
            trace_uri = s3.uri(bucket, s3.join_key(prefix, rel))
            rows.append(
                {
                    "session": m["id"],
                    "job": m["job"],
                    "host": t["host"],
                    "node": m.get("node"),
                    "pid": t["pid"],
                    "role": t["role"],
                    "rank": t["rank"],
                    "world_size": t.get("world_size"),
                    "cycle": res.get("cycle"),
                    "region": m.get("region"),
                    "steps": res.get("steps", []),
                    "path": trace_uri,
                    "bytes": res.get("bytes"),
                    "state": res.get("state", "ok"),
                    "stall_ms": res.get("stall_ms"),
                    "step_ms_p50": res.get("step_ms_p50"),
                    "created_at": res.get("created_at") or m.get("finished_at"),
                    "label": m.get("label"),
                    "files": files,
                    "upload_state": "uploaded",
                    "s3_uri": trace_uri,
                }
            )
    return rows


def keep(
    row: dict[str, Any],
    *,
    rank: int | None = None,
    role: str | None = None,
    host: str | None = None,
    since: float | None = None,
) -> bool:
    """Whether a manifest row passes the filters that the daemon's index applies in SQL."""
    return not (
        (rank is not None and row["rank"] != rank)
        or (role and not globs.match(row["role"], role))
        or (host and row["host"] != host)
        or (since is not None and (row["created_at"] or 0) < since)
    )


def list_from_s3(
    s3_url: str,
    since: float | None = None,
    job: str | None = None,
    session: str | None = None,
    rank: int | None = None,
    role: str | None = None,
    host: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    client, cfg = ctl_s3(s3_url)
    bucket, prefix = cfg.bucket_prefix()

    rows: list[dict[str, Any]] = []
    try:
        # Newest sessions first (ids start with their UTC start time), a batch at a time, so
        # --limit reads the recent manifests instead of every one in the bucket.
        pairs = find_sessions(client, bucket, prefix, job, session, since)
        pairs.sort(key=lambda p: (session_started(p[1]) is None, p[1]), reverse=True)
        with ThreadPoolExecutor(FETCH_THREADS) as pool:
            for i in range(0, len(pairs), 2 * FETCH_THREADS):
                batch = pairs[i : i + 2 * FETCH_THREADS]
                if len(rows) >= limit:
                    cutoff = sorted((r["created_at"] or 0 for r in rows), reverse=True)[limit - 1]
                    batch = [p for p in batch if could_rank(p[1], cutoff)]
                if not batch:
                    break  # the rest are older still
                for ms in pool.map(lambda p: read_manifests(client, bucket, prefix, *p), batch):
                    rows.extend(
                        r
                        for m in ms
                        for r in manifest_rows(m, bucket, prefix)
                        if keep(r, rank=rank, role=role, host=host, since=since)
                    )
    except CtlError:
        raise
    except Exception as exc:
        raise s3_error(exc) from None
    rows.sort(key=lambda r: (-(r["created_at"] or 0), r["rank"]))
    return rows[:limit]


def could_rank(session_id: str, cutoff: float) -> bool:
    """Whether a session can still have a trace created at or after ``cutoff`` (the newest
    ``--limit`` rows so far end there).

    Its traces were made after it started and, taking sessions to last at most
    ``SINCE_SLACK_S``, before ``start + SINCE_SLACK_S``.
    """
    started = session_started(session_id)
    return started is None or started + SINCE_SLACK_S >= cutoff
