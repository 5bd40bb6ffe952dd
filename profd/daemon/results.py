"""What became of each capture, committed: into the index, the session and the upload queue,
and only then its raw trace deleted."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol

from profd.daemon.captures.record import CaptureReport, Outcome
from profd.daemon.runtime import faults
from profd.daemon.sessions.state import Sessions
from profd.daemon.spool.incoming import Incoming
from profd.pipeline.process import ProcessedTrace
from profd.store import layout
from profd.store.index import FileRepo, InboxRepo, PathTaken, TraceRepo, UploadQueueRepo

log = logging.getLogger("profd.results")


class UploadQueue(Protocol):
    def kick(self) -> None: ...


class Results:
    def __init__(
        self,
        sessions: Sessions,
        traces: TraceRepo,
        files: FileRepo,
        inbox: InboxRepo,
        queue: UploadQueueRepo,
        incoming: Incoming,
        uploads: UploadQueue | None,
        node: str,
    ) -> None:
        self.node = node
        self.sessions = sessions
        self.traces = traces
        self.files = files
        self.inbox = inbox
        self.queue = queue
        self.incoming = incoming
        self.spool = incoming.spool
        self.uploads = uploads

    @property
    def upload_state(self) -> str:
        return "pending" if self.uploads is not None else "local"

    def kick(self) -> None:
        if self.uploads is not None:
            self.uploads.kick()

    def retry(self, session: str | None) -> int:
        n: int = self.queue.requeue(session)
        self.kick()
        return n

    def commit(self, o: Outcome) -> None:
        """Record what became of a capture, then delete its raw trace.

        One commit for the trace, its inbox row and its target: a daemon killed before it
        redoes the capture from the raw trace (the outputs it wrote are simply replaced), one
        killed after it finds the row marked as indexed with its raw trace left, and deletes
        that at its next start (:meth:`delete_raw`).

        A trace whose files the index already names for another capture is not indexed: the
        capture fails saying whose they are (two rows never name one file)."""
        try:
            self._commit(o)
        except PathTaken as exc:
            log.error("session %s: capture %s: %s", o.capture.session_id, o.capture.key, exc)
            self._commit(Outcome(o.capture, None, str(exc)))

    def _commit(self, o: Outcome) -> None:
        c = o.capture
        s = self.sessions.exact(c.session_id)
        t = s.targets.get(c.target) if s is not None else None
        raw_left = o.trace is not None and c.raw_trace is not None
        # The repositories share the loop's connection: the session's writes are part of it.
        with self.inbox.transaction():
            if o.trace is not None:
                self.index_trace(c, o.trace, o.shared)
            if not o.retry:
                # (An nsys capture has no inbox row: then this changes nothing.)
                self.inbox.inbox_done(c.key, raw_left=raw_left)
            if s is not None and t is not None:
                self.sessions.processed(
                    s, t, self._result(o), traced=o.trace is not None, error=o.error
                )
        self.kick()
        if raw_left:
            faults.point("trace-indexed")
            try:
                self.delete_raw(c)
            except Exception:
                # Committed already, so not the caller's to retry: the row stays marked as
                # indexed with its raw trace left, and the next daemon start deletes it.
                log.exception("deleting the raw trace of capture %s", c.key)
            faults.point("raw-deleted")

    def delete_raw(self, c: CaptureReport) -> None:
        """Delete an indexed capture's raw trace; then nothing of it is left to redo."""
        raw = c.raw_trace
        if raw is not None:
            self.incoming.discard(c.raw_dir, [raw], f"the raw trace of capture {c.key}")
        self.inbox.inbox_done(c.key)

    def _result(self, o: Outcome) -> dict[str, Any]:
        """The target's result of one cycle (into the index and ``session.json``)."""
        c, res = o.capture, o.trace
        result: dict[str, Any] = {"cycle": c.cycle, "steps": list(c.steps)}
        notes = list(c.notes)
        if res is not None:
            notes += res.notes  # values of the trace the pipeline left out
        if res is not None and res.output_errors:
            # A report plug-in failed: the trace is kept; say what is missing beside it.
            missing = [f"{e.kind} not written: {e.error}" for e in res.output_errors]
            log.warning("session %s rank %s: %s", c.session_id, c.rank, "; ".join(missing))
            notes += missing
        if notes:
            result["notes"] = notes
        if res is not None:
            result.update(
                path=self._rel(res.trace_path),
                stall_ms=c.stall_ms,
                step_ms_p50=res.step_ms_p50,
                # session.json is the S3 index (profctl traces --s3): enough to list and
                # pull a session's files without the node's SQLite index.
                bytes=_trace_bytes(res),
                state=c.state,
                created_at=time.time(),
                files=[
                    {"kind": f.kind, "path": self._rel(f.path), "bytes": f.bytes} for f in res.files
                ],
            )
            # The pipeline's records (per-rank statistics) travel with the result: into the
            # index's targets and session.json, which is all profctl report reads.
            result.update(res.records)
        else:
            result["error"] = o.error
        return result

    def _rel(self, path: str) -> str:
        return str(Path(path).relative_to(self.spool))

    def index_trace(self, c: CaptureReport, res: ProcessedTrace, shared: bool = False) -> None:
        files = [
            {
                "session": c.session_id,
                "job": c.training_job,
                "kind": f.kind,
                "path": f.path,
                "rel": self._rel(f.path),
                "bytes": f.bytes,
                "upload_state": self.upload_state,
            }
            for f in res.files
        ]
        self.traces.add_trace(
            {
                "session": c.session_id,
                "job": c.training_job,
                "host": c.host,
                "pid": c.pid,
                "role": c.role,
                "rank": c.rank,
                "cycle": c.cycle,
                "region": c.region,
                "steps": list(c.steps),
                "path": res.trace_path,
                "bytes": _trace_bytes(res),
                "state": c.state,
                "stall_ms": c.stall_ms,
                "step_ms_p50": res.step_ms_p50,
                "step_ms_max": res.step_ms_max,
                "torch": c.torch,
                "device": c.device,
                "stats": res.records.get("stats"),
                "created_at": time.time(),
            },
            files,
            shared,
        )

    def session_manifest(self, session: str, job: str, manifest: Path, cluster: bool) -> None:
        """Index a finished session's ``session.json`` (the last file uploaded); a cluster
        session's goes to S3 under this node's name, beside the other nodes'."""
        rel = layout.manifest_key(job, session, self.node if cluster else None)
        self.files.add_file(
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
