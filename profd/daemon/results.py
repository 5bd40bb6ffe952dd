"""Finished pipeline work into the index, the session and the upload queue."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol

from profd.daemon.captures.lanes import Job
from profd.daemon.sessions.state import Sessions
from profd.pipeline.process import ProcessedTrace
from profd.store import layout
from profd.store.index import Index

log = logging.getLogger("profd.results")


class UploadQueue(Protocol):
    def kick(self) -> None: ...


class Results:
    def __init__(
        self,
        sessions: Sessions,
        index: Index,
        spool: Path,
        uploads: UploadQueue | None,
        node: str,
    ) -> None:
        self.node = node
        self.sessions = sessions
        self.index = index
        self.spool = spool
        self.uploads = uploads

    @property
    def upload_state(self) -> str:
        return "pending" if self.uploads is not None else "local"

    def kick(self) -> None:
        if self.uploads is not None:
            self.uploads.kick()

    def retry(self, session: str | None) -> int:
        n: int = self.index.requeue(session)
        self.kick()
        return n

    def on_processed(
        self, j: Job, res: ProcessedTrace | None, error: str | None, retryable: bool
    ) -> None:
        # One commit for the trace, its inbox row and its target: a daemon killed on either
        # side of it redoes the capture from the raw trace or finds it whole.
        with self.index.transaction():
            self._record(j, res, error, retryable)
        self.kick()

    def _record(
        self, j: Job, res: ProcessedTrace | None, error: str | None, retryable: bool
    ) -> None:
        s = self.sessions.exact(j.session)
        t = s.targets.get((j.host, j.pid)) if s is not None else None
        if res is not None:
            self.index_trace(j, res)
        if not retryable:
            self.index.inbox_done(j.key, raw_left=res is not None)
        if s is None or t is None:
            return
        result: dict[str, Any] = {"cycle": j.cycle, "steps": j.report.get("steps", [])}
        notes = list(j.report.get("notes") or [])
        if res is not None:
            notes += res.notes  # values of the trace the pipeline left out
        if res is not None and res.output_errors:
            # A report plug-in failed: the trace is kept; say what is missing beside it.
            missing = [f"{e.kind} not written: {e.error}" for e in res.output_errors]
            log.warning("session %s rank %s: %s", j.session, j.rank, "; ".join(missing))
            notes += missing
        if notes:
            result["notes"] = notes
        if res is not None:
            result.update(
                path=self._rel(res.trace_path),
                stall_ms=j.report.get("stall_ms"),
                step_ms_p50=res.step_ms_p50,
                # session.json is the S3 index (profctl traces --s3): enough to list and
                # pull a session's files without the node's SQLite index.
                bytes=_trace_bytes(res),
                state="ok" if not j.report.get("error") else "partial",
                created_at=time.time(),
                files=[
                    {"kind": f.kind, "path": self._rel(f.path), "bytes": f.bytes} for f in res.files
                ],
            )
            # The pipeline's records (per-rank statistics) travel with the result: into the
            # index's targets and session.json, which is all profctl report reads.
            result.update(res.records)
        else:
            result["error"] = error
        self.sessions.processed(s, t, result, traced=res is not None, error=error)

    def raw_deleted(self, j: Job) -> None:
        """The capture's raw trace is gone: nothing of it is left for a restart to redo."""
        self.index.inbox_done(j.key)

    def _rel(self, path: str) -> str:
        return str(Path(path).relative_to(self.spool))

    def index_trace(self, j: Job, res: ProcessedTrace) -> None:
        files = [
            {
                "session": j.session,
                "job": j.job,
                "kind": f.kind,
                "path": f.path,
                "rel": self._rel(f.path),
                "bytes": f.bytes,
                "upload_state": self.upload_state,
            }
            for f in res.files
        ]
        self.index.add_trace(
            {
                "session": j.session,
                "job": j.job,
                "host": j.host,
                "pid": j.pid,
                "role": j.role,
                "rank": j.rank,
                "cycle": j.cycle,
                "region": j.report.get("region"),
                "steps": j.report.get("steps", []),
                "path": res.trace_path,
                "bytes": _trace_bytes(res),
                "state": "ok" if not j.report.get("error") else "partial",
                "stall_ms": j.report.get("stall_ms"),
                "step_ms_p50": res.step_ms_p50,
                "step_ms_max": res.step_ms_max,
                "torch": j.report.get("torch"),
                "device": j.report.get("device"),
                "stats": res.records.get("stats"),
                "created_at": time.time(),
            },
            files,
        )

    def session_manifest(self, session: str, job: str, manifest: Path, cluster: bool) -> None:
        """Index a finished session's ``session.json`` (the last file uploaded); a cluster
        session's goes to S3 under this node's name, beside the other nodes'."""
        rel = self._rel(str(manifest))
        if cluster:
            rel = str(Path(rel).with_name(layout.manifest_name(self.node)))
        self.index.add_file(
            {
                "session": session,
                "job": job,
                "kind": "session",
                "path": str(manifest),
                "rel": rel,
                "bytes": manifest.stat().st_size,
                "upload_state": self.upload_state,
            }
        )
        self.kick()


def _trace_bytes(res: ProcessedTrace) -> int:
    return next((f.bytes for f in res.files if f.path == res.trace_path), 0)
