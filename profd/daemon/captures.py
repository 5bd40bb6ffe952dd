"""Finished captures: check, post-process in worker processes, report back to the loop.

The loop calls :meth:`Captures.submit` with a client's ``captured`` report once it is safely
in the index inbox; the gzip/fix/summarise work runs in a process pool (JSON parsing of a
tens-of-MB trace would otherwise hold the loop's GIL); the result comes back through the
reactor to ``on_done``, on the loop thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..pipeline.process import PipelineError, ProcessedTrace, process_trace
from .reactor import Reactor

log = logging.getLogger("profd.captures")

INCOMING = ".incoming"


@dataclass(frozen=True)
class Job:
    key: str
    session: str
    job: str
    host: str
    pid: int
    role: str
    rank: int
    world_size: int
    cycle: int
    report: dict[str, Any]


def inside(spool: Path, path: str) -> Path | None:
    """The resolved path if it lies inside the spool, else None (never trust a client path)."""
    try:
        p = Path(path).resolve(strict=True)
        p.relative_to(spool.resolve())
    except (OSError, ValueError):
        return None
    return p


def _run(job_args: dict[str, Any]) -> ProcessedTrace:
    return process_trace(**job_args)


class Captures:
    def __init__(
        self,
        spool: Path,
        reactor: Reactor,
        workers: int,
        on_done: Callable[[Job, ProcessedTrace | None, str | None, bool], None],
    ) -> None:
        self.spool = spool
        self.reactor = reactor
        self.on_done = on_done
        self.in_flight = 0
        ctx = multiprocessing.get_context("spawn")
        self.pool = cf.ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx)

    def incoming_dir(self, job: str, session: str) -> Path:
        return self.spool / INCOMING / job / session

    def remove_incoming(self, job: str, session: str) -> None:
        """Drop a finished session's emptied ``.incoming`` dirs; any holding a file stay."""
        root = self.incoming_dir(job, session)
        if not root.is_dir():
            return
        for d in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        for d in (root, root.parent):
            try:
                d.rmdir()
            except OSError:
                return

    def final_dir(self, job: str, session: str, cycle: int) -> Path:
        return self.spool / job / session / f"c{cycle}"

    def submit(self, j: Job) -> None:
        """Validate and queue one capture; bad reports fail at once, without the pool."""
        files = j.report.get("files") or []
        trace: Path | None = None
        extras: list[tuple[str, str]] = []
        for f in files:
            if not isinstance(f, dict) or not isinstance(f.get("path"), str):
                return self._fail(j, "malformed file entry in report")
            p = inside(self.spool, f["path"])
            if p is None:
                return self._fail(j, f"rejected path outside the spool or missing: {f['path']}")
            if f.get("kind") == "trace" and trace is None:
                trace = p
            else:
                extras.append((str(f.get("kind", "extra")), str(p)))
        if trace is None:
            return self._fail(j, j.report.get("error") or "no trace file in report")
        args = {
            "raw_trace": str(trace),
            "final_dir": str(self.final_dir(j.job, j.session, j.cycle)),
            "stem": f"{j.role}-r{j.rank}",
            "rank": j.rank,
            "world_size": j.world_size,
            "extra_files": extras,
            "header": {
                "session": j.session,
                "job": j.job,
                "host": j.host,
                "pid": str(j.pid),
                "role": j.role,
                "cycle": str(j.cycle),
                "steps": ",".join(map(str, j.report.get("steps", []))),
                "region": str(j.report.get("region") or ""),
                "stall_ms": f"{j.report.get('stall_ms', 0):.1f}",
                "torch": str(j.report.get("torch")),
                "device": str(j.report.get("device")),
            },
        }
        self.in_flight += 1
        try:
            fut = self.pool.submit(_run, args)
        except RuntimeError as exc:  # pool shut down or broken
            self.in_flight -= 1
            return self._fail(j, f"pipeline unavailable: {exc}")
        fut.add_done_callback(lambda f: self.reactor.call_soon(self._finished, j, f))

    def _finished(self, j: Job, fut: cf.Future[ProcessedTrace]) -> None:
        self.in_flight -= 1
        try:
            res = fut.result()
        except PipelineError as exc:
            self.on_done(j, None, f"pipeline: {exc}", False)
            return
        except Exception as exc:
            # A full disk or a killed worker: the raw trace is still in place, so the next
            # daemon start tries again (the inbox row stays open).
            log.error("pipeline failed on %s: %r", j.key, exc)
            self.on_done(j, None, f"pipeline error: {type(exc).__name__}: {exc}", True)
            return
        self.on_done(j, res, None, False)

    def _fail(self, j: Job, error: str) -> None:
        self.on_done(j, None, error, False)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=False)
