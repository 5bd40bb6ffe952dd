"""The daemon's event loop: binds the sockets, owns the registry and sessions, dispatches.

Everything that mutates the registry or a session runs on this thread. Workers (pipeline,
sampler, uploaders) report back through the :class:`Reactor`.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from pathlib import Path
from types import FrameType
from typing import Any

import zmq

from profd_client import protocol as P

from .. import __version__
from ..config import Config
from ..pipeline.process import ProcessedTrace
from ..store.index import Index
from . import runtime
from .agents import AgentHandler
from .captures import Captures, Job
from .control import ControlHandler
from .nsysruns import NsysRuns
from .reactor import Reactor
from .registry import Client, Registry
from .sampler import Sample, Sampler
from .sessions import Session, Sessions, Target

log = logging.getLogger("profd")

MISSED_HEARTBEATS = 3
#: Targets restored from a previous daemon must re-register within this many seconds.
RESTORE_GRACE_S = 10.0
BATCH = 512


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.host = socket.gethostname()
        self.started = time.time()
        self.stopping = False
        cfg.spool_dir.mkdir(parents=True, exist_ok=True)
        self.spool = cfg.spool_dir.resolve()
        self.index = Index(cfg.index_path)
        self.registry = Registry()
        self.sessions = Sessions(self.index, self.spool)
        self.reactor = Reactor()
        self.captures = Captures(self.spool, self.reactor, cfg.pipeline_workers, self.on_processed)
        self.agents = AgentHandler(self)
        self.control = ControlHandler(self)
        self.nsys = NsysRuns(self)
        self.control.check_auto_rules()
        self.uploads: Any = None  # set by the S3 layer when configured
        self.orphans: dict[tuple[str, int], float] = {}
        self.sample_pids: tuple[int, ...] = ()  # local pids, republished by tick()
        self.ctx: Any = zmq.Context.instance()
        self.agent_sock: Any = None
        self.control_sock: Any = None

    # --- lifecycle ------------------------------------------------------------------------------
    def bind(self) -> None:
        rdir = self.cfg.runtime_dir
        gid = runtime.prepare(rdir, self.cfg.group)
        runtime.claim(rdir)
        self.agent_sock = self._router(rdir / P.AGENT_SOCKET, gid)
        self.control_sock = self._router(rdir / P.CONTROL_SOCKET, gid)

    def _router(self, path: Path, gid: int | None) -> Any:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.bind(f"ipc://{path}")
        runtime.secure_socket(path, gid)
        return s

    def run(self) -> None:
        self.bind()
        self._install_signals()
        self._restore()
        sampler = Sampler(
            self.cfg.sample_interval,
            # The sampler thread reads a snapshot the loop publishes, never the registry.
            pids=lambda: list(self.sample_pids),
            report=lambda samples: self.reactor.call_soon(self.on_samples, samples),
        )
        sampler.start()
        if self.uploads is not None:
            self.uploads.start()
        log.info(
            "profd %s listening on %s (state %s, spool %s)",
            __version__,
            self.cfg.runtime_dir,
            self.cfg.state_dir,
            self.spool,
        )
        try:
            self._loop()
        finally:
            sampler.stop()
            self._shutdown()

    def _install_signals(self) -> None:
        def on_signal(signum: int, _frame: FrameType | None) -> None:
            self.reactor.call_soon(self.stop, signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def stop(self, why: str = "") -> None:
        log.info("shutting down%s", f" ({why})" if why else "")
        self.stopping = True

    def _shutdown(self) -> None:
        for s in (self.agent_sock, self.control_sock):
            if s is not None:
                s.close(0)
        for name in (P.AGENT_SOCKET, P.CONTROL_SOCKET):
            (self.cfg.runtime_dir / name).unlink(missing_ok=True)
        if self.uploads is not None:
            self.uploads.stop()
        # Let running post-processing finish: its raw input is deleted only on success, and
        # the inbox row makes the next daemon redo anything cut off.
        self.captures.shutdown()
        self.nsys.shutdown()
        while self.reactor.run_pending():
            pass
        self.flush()
        self.index.close()
        log.info("stopped")

    def _restore(self) -> None:
        deadline = time.monotonic() + RESTORE_GRACE_S
        for s in self.sessions.restore():
            if s.backend == "nsys":
                self.nsys.restored(s)
                continue
            for t in s.targets.values():
                self.orphans[t.key] = deadline
        for key, msg in self.index.inbox_pending():
            self.agents.resubmit(key, msg)

    # --- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.agent_sock, zmq.POLLIN)
        poller.register(self.control_sock, zmq.POLLIN)
        poller.register(self.reactor.fd, zmq.POLLIN)
        hb = self.cfg.heartbeat_interval
        next_tick = time.monotonic() + hb
        while not self.stopping:
            timeout = max(0.0, next_tick - time.monotonic())
            events = dict(poller.poll(int(timeout * 1000.0)))
            if self.reactor.fd in events:
                self.reactor.run_pending()
            # Operators first: a start must not wait behind a batch of heartbeats.
            if self.control_sock in events:
                self._drain(self.control_sock, self.control.handle)
            if self.agent_sock in events:
                self._drain(self.agent_sock, self.agents.handle)
            self.flush()
            now = time.monotonic()
            if now >= next_tick:
                self.tick(now)
                self.flush()
                next_tick = now + hb

    def _drain(self, sock: Any, handle: Any) -> None:
        for _ in range(BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(frames)
            except Exception:  # a handler bug must not take the daemon down
                log.exception("error handling a message")

    def send_agent(self, ident: bytes, frame: bytes) -> None:
        try:
            self.agent_sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("send to client failed: %s", exc)

    def tick(self, now: float) -> None:
        self.sample_pids = tuple(c.pid for c in self.registry if c.host == self.host)
        timeout = MISSED_HEARTBEATS * self.cfg.heartbeat_interval
        for c in self.registry.stale(now, timeout):
            self.drop_client(c, f"missed heartbeats for {timeout:.0f}s")
        for key, deadline in list(self.orphans.items()):
            if now >= deadline:
                del self.orphans[key]
                if key not in self.registry.by_key:
                    self.target_gone(key, "process did not come back after a daemon restart")
        self.rearm_pending()
        self.nsys.poll(now)

    def rearm_pending(self) -> None:
        """Send ``arm`` again to targets that have not acked it after a heartbeat interval.

        Pushes are fire-and-forget to a routing id; a reconnect between the send and the
        delivery loses one. Clients ignore an arm for a session they already hold.
        """
        now = time.time()
        for s in self.sessions.live():
            if now - s.created_at < self.cfg.heartbeat_interval:
                continue
            for t in s.targets.values():
                if t.state == "pending" and t.client_final is None and not t.hold:
                    c = self.registry.by_key.get(t.key)
                    if c is not None:
                        self.control.arm(s, c)

    # --- reports from workers -----------------------------------------------------------------
    def on_samples(self, samples: list[Sample]) -> None:
        for s in samples:
            c = self.registry.by_key.get((self.host, s.pid))
            if c is None:
                continue
            if not s.alive:
                self.drop_client(c, "process exited")
                continue
            c.cpu, c.rss, c.gpu_util, c.gpu_mem = s.cpu, s.rss, s.gpu_util, s.gpu_mem

    def on_processed(
        self, j: Job, res: ProcessedTrace | None, error: str | None, retryable: bool
    ) -> None:
        s = self.sessions.get(j.session)
        t = s.targets.get((j.host, j.pid)) if s is not None else None
        if res is not None:
            self.index_trace(j, res)
        if not retryable:
            self.index.inbox_done(j.key)
        if s is None or t is None:
            return
        t.outstanding = max(0, t.outstanding - 1)
        result: dict[str, Any] = {"cycle": j.cycle, "steps": j.report.get("steps", [])}
        if j.report.get("notes"):
            result["notes"] = j.report["notes"]
        if res is not None:
            t.traces += 1
            result.update(
                path=str(Path(res.trace_path).relative_to(self.spool)),
                stall_ms=j.report.get("stall_ms"),
                step_ms_p50=res.step_ms_p50,
                # session.json is the S3 index (profctl traces --s3): enough to list and
                # pull a session's files without the node's SQLite index.
                bytes=next((f.bytes for f in res.files if f.path == res.trace_path), 0),
                state="ok" if not j.report.get("error") else "partial",
                created_at=time.time(),
                files=[
                    {
                        "kind": f.kind,
                        "path": str(Path(f.path).relative_to(self.spool)),
                        "bytes": f.bytes,
                    }
                    for f in res.files
                ],
            )
        else:
            t.error = error
            result["error"] = error
        t.results.append(result)
        t.settle()
        self.save(s, t)

    def index_trace(self, j: Job, res: ProcessedTrace) -> None:
        upload = "pending" if self.uploads is not None else "local"
        files = [
            {
                "session": j.session,
                "job": j.job,
                "kind": f.kind,
                "path": f.path,
                "rel": str(Path(f.path).relative_to(self.spool)),
                "bytes": f.bytes,
                "upload_state": upload,
            }
            for f in res.files
        ]
        trace_bytes = next((f.bytes for f in res.files if f.path == res.trace_path), 0)
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
                "bytes": trace_bytes,
                "state": "ok" if not j.report.get("error") else "partial",
                "stall_ms": j.report.get("stall_ms"),
                "step_ms_p50": res.step_ms_p50,
                "step_ms_max": res.step_ms_max,
                "torch": j.report.get("torch"),
                "device": j.report.get("device"),
                "created_at": time.time(),
            },
            files,
        )
        if self.uploads is not None:
            self.uploads.kick()

    # --- sessions -------------------------------------------------------------------------------
    def save(self, s: Session, *targets: Target) -> None:
        self.sessions.save(s, *targets)

    def flush(self) -> None:
        """Persist this iteration's session changes; index finished sessions' manifests."""
        try:
            finished = self.sessions.flush()
        except Exception as exc:  # the index is unwritable now; changes wait for the next try
            log.error("cannot write the index: %r", exc)
            return
        for s, manifest in finished:
            log.info("session %s %s", s.id, s.state)
            if s.backend == "nsys":
                self.nsys.session_ended(s)
            _remove_empty_tree(self.captures.incoming_dir(s.job, s.id))
            self.index.add_file(
                {
                    "session": s.id,
                    "job": s.job,
                    "kind": "session",
                    "path": str(manifest),
                    "rel": str(manifest.relative_to(self.spool)),
                    "bytes": manifest.stat().st_size,
                    "upload_state": "pending" if self.uploads is not None else "local",
                }
            )
            if self.uploads is not None:
                self.uploads.kick()

    def drop_client(self, c: Client, why: str) -> None:
        log.info("client %s pid %s (%s rank %s) dropped: %s", c.host, c.pid, c.role, c.rank, why)
        self.registry.remove(c)
        self.target_gone(c.key, f"{why} at step {c.step}")

    def target_gone(self, key: tuple[str, int], why: str) -> None:
        for s in self.sessions.live():
            t = s.targets.get(key)
            if t is None or t.client_final is not None:
                continue
            t.gone = True
            t.error = t.error or why
            t.settle()
            self.save(s, t)


def _remove_empty_tree(root: Path) -> None:
    """Drop a session's emptied ``.incoming`` dirs; anything still holding a file stays."""
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
