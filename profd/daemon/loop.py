"""The daemon's event loop: wires the collaborators, binds the sockets, runs the poller.

Everything that mutates the registry or a session runs on this thread. Workers (pipeline,
process statistics, uploaders, nsys commands) report back through the :class:`Reactor`. No handler
sees this object: each gets the collaborators it needs.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NamedTuple

import zmq

from profd import __version__, fsutil
from profd.config import Config, ConfigError, reload_watch
from profd.daemon.agent.attach import QUIET_ACKS, Attach, Welcome
from profd.daemon.agent.handler import AgentHandler
from profd.daemon.agent.intake import Intake
from profd.daemon.agent.liveness import Liveness
from profd.daemon.agent.pace import HeartbeatPace
from profd.daemon.captures.lanes import Captures
from profd.daemon.captures.record import CaptureReport
from profd.daemon.clients.agent_dumps import AgentBlackboxes, AgentStacks
from profd.daemon.clients.blackbox_collect import BlackboxCollector
from profd.daemon.clients.history import StepHistory
from profd.daemon.clients.ledger import Ledgers
from profd.daemon.clients.procstats import ProcStats
from profd.daemon.clients.pyspy_reader import StackReader
from profd.daemon.clients.registry import Registry
from profd.daemon.clients.stack_sources import RankStacks
from profd.daemon.control.handler import ControlHandler, DaemonFacts
from profd.daemon.control.tcp import TcpControl
from profd.daemon.metrics import MetricsServer
from profd.daemon.parts import (
    DeferredReports,
    Detecting,
    FrozenBoxes,
    HeartbeatAnswers,
    Housekeeping,
    IncidentKeeping,
    LedgerMinutes,
    MetricsPublisher,
    MinuteWriter,
    NsysPolling,
    OwedManifests,
    Pacing,
    ParkedCaptures,
    Part,
    Parts,
    Sampling,
    StackExpiry,
    StallWatch,
    guarded,
)
from profd.daemon.results import Results
from profd.daemon.runtime import faults
from profd.daemon.runtime import rundir as runtime
from profd.daemon.runtime.gcpauses import GcPauses
from profd.daemon.runtime.peers import PeerCred
from profd.daemon.runtime.sdnotify import Notifier
from profd.daemon.sessions.arming import Arms
from profd.daemon.sessions.autorules import AutoRules
from profd.daemon.sessions.autorules import check as check_rules
from profd.daemon.sessions.nsysruns import NsysRuns
from profd.daemon.sessions.quota import Quota
from profd.daemon.sessions.samples import Samples, rules_of
from profd.daemon.sessions.starts import Starter, StartRequest
from profd.daemon.sessions.state import Sessions
from profd.daemon.spool import leftovers
from profd.daemon.spool.incoming import Incoming
from profd.daemon.spool.spoolperms import SpoolPerms
from profd.daemon.spool.storage import Storage
from profd.daemon.watch.blackbox_freeze import Freezer
from profd.daemon.watch.capture import IncidentCapture
from profd.daemon.watch.detector_runs import Detectors
from profd.daemon.watch.incident_store import Incidents
from profd.daemon.watch.sinks import IncidentCounts, record_sinks
from profd.daemon.watch.stall_watch import Hangs
from profd.reactor import Reactor
from profd.store import layout
from profd.store.index import (
    Database,
    FileRepo,
    InboxRepo,
    IncidentRepo,
    SessionRepo,
    StepMinuteRepo,
    TraceRepo,
    UploadQueueRepo,
    WarehouseQueueRepo,
)
from profd.watch.incident_record import Incident, Suspect
from profd_client import protocol as P

if TYPE_CHECKING:  # boto3 only when S3 is configured, pyarrow only when the export is on
    from profd.store.uploads import Uploads
    from profd.warehouse.export import Exporter

log = logging.getLogger("profd")

BATCH = 512
#: After a wake-up that read agent messages, the loop leaves agent.sock unpolled this long, so
#: heartbeats (1,024 a second from 1,024 ranks, almost each alone) are read in batches of
#: ~20 per wake-up instead of one: the wake-up, not the message, was most of the daemon's CPU
#: per heartbeat (docs/benchmarks.md). Operators (control.sock, TCP) and workers (the
#: reactor) still wake it at once, so a start is never delayed; a client's reply may be.
AGENT_LINGER_S = 0.02
#: Requests answered from each operator socket between two parts of a tick (the rest at the
#: next loop pass): a tick that answers a burst of ``ps`` at 1,024 clients must still end.
BETWEEN_PARTS = 4
#: Agent messages handled between two looks at the operators' sockets: a burst of heartbeats
#: (a batch reads up to :data:`BATCH`, ~50 us each at 1,024 clients) would otherwise hold a
#: ``ps`` for the whole batch, ~10 ms when many clients' heartbeats fall together.
OPERATORS_EVERY = 32
_MORE = zmq.SNDMORE | zmq.NOBLOCK


class _Repos(NamedTuple):
    """The index's areas the builders hand out, each to the components that use it."""

    sessions: SessionRepo
    traces: TraceRepo
    files: FileRepo
    minutes: StepMinuteRepo
    incidents: IncidentRepo


class Daemon:
    """Reads as its parts: the collaborators each builder makes, then :meth:`_parts`, the
    periodic work the loop runs each tick, in order."""

    def __init__(self, cfg: Config, make_uploads: Callable[[Reactor], Uploads] | None) -> None:
        self.cfg = cfg
        self.stopping = False
        self.sd = Notifier()  # systemd's READY/WATCHDOG/STOPPING; a no-op outside systemd
        self.ctx: Any = zmq.Context.instance()
        self.agent_sock: Any = None
        self.control_sock: Any = None
        # Keys are checked here, before anything is bound: a bad key file stops the start.
        self.tcp = TcpControl(self.ctx, cfg.cluster) if cfg.cluster.listen else None
        m = cfg.metrics
        self.metrics = MetricsServer(m.host, m.port, time.time) if m.listen else None
        self.reactor = Reactor()
        self.temp_files_removed = 0  # left in the spool by a killed daemon, removed at start
        self.gc_pauses = GcPauses()
        spool, perms = _prepare_spool(cfg)
        rules = check_rules(cfg.auto)
        repos = self._build_store(spool, perms, make_uploads)
        self._build_clients(repos)
        self._build_sessions(spool, perms, repos)
        self._build_watch(spool, perms, repos)
        self._build_agents(spool, rules)
        self.control = self._build_control(spool, repos)
        self.publisher = self._build_publisher()
        self.parts = Parts(self._parts())

    # --- construction ---------------------------------------------------------------------------
    def _build_store(
        self, spool: Path, perms: SpoolPerms, make_uploads: Callable[[Reactor], Uploads] | None
    ) -> _Repos:
        cfg = self.cfg
        self.storage = Storage({"index": cfg.state_dir, "spool": spool})
        # One connection for the event loop; each component gets the repositories it uses.
        self.index = Database(cfg.index_path)
        self.inbox = InboxRepo(self.index)
        self.upload_queue = UploadQueueRepo(self.index)
        self.uploads = make_uploads(self.reactor) if make_uploads is not None else None
        self.incoming = Incoming(spool, perms)
        self.warehouse = _make_exporter(cfg)
        db = self.index
        return _Repos(
            SessionRepo(db), TraceRepo(db), FileRepo(db), StepMinuteRepo(db), IncidentRepo(db)
        )

    def _build_clients(self, repos: _Repos) -> None:
        cfg = self.cfg
        self.registry = Registry()
        self.history = StepHistory(repos.minutes, self.storage, cfg.watch.keep_history)
        # A rank re-attaching after a restart shows its last minute until its ledger comes.
        self.ledgers = Ledgers(
            seed=self.history.seed,
            max_regions=cfg.limits.max_regions_per_rank,
            rate=cfg.limits.heartbeat_rate(cfg.heartbeat_interval),
        )
        self.agent_stacks = AgentStacks(self._send_agent)
        registry = self.registry
        self.agent_blackboxes = AgentBlackboxes(
            self._send_agent, lambda ident: registry.get(ident) is None
        )
        self.blackboxes = BlackboxCollector(self.agent_blackboxes, cfg.node_name)
        self.rank_stacks = RankStacks(
            StackReader(self.reactor.call_soon), self.agent_stacks, self.registry
        )

    def _build_sessions(self, spool: Path, perms: SpoolPerms, repos: _Repos) -> None:
        cfg, host = self.cfg, self.cfg.node_name
        self.sessions = Sessions(repos.sessions, spool, perms, host)
        self.results = Results(
            self.sessions,
            repos.traces,
            repos.files,
            self.inbox,
            self.upload_queue,
            self.incoming,
            self.uploads,
            host,
        )
        self.captures = Captures(
            self.incoming,
            self.reactor,
            cfg.pipeline_workers,
            self.results.commit,
            cfg.max_trace_bytes,
            self.storage,
        )
        self.arms = Arms(self._send_agent, self.incoming)
        self.nsys = NsysRuns(
            cfg.nsys,
            host,
            self.sessions,
            self.registry,
            self.arms,
            self.incoming,
            self.reactor,
            self.results.commit,
        )
        self.pace = HeartbeatPace(cfg.heartbeat_interval, cfg.max_heartbeats_per_s, QUIET_ACKS)
        self.liveness = Liveness(self.pace, self.registry, self.sessions, self.arms)
        quota = Quota(cfg.max_spool_bytes, repos.files, self.uploads)
        self.starter = Starter(self.registry, self.sessions, self.arms, self.nsys, quota.check)

    def _build_watch(self, spool: Path, perms: SpoolPerms, repos: _Repos) -> None:
        cfg = self.cfg
        self.incident_counts = IncidentCounts()
        by_job = self.registry.owned_by_job
        self.freezer = Freezer(
            self.blackboxes,
            lambda job: by_job().get(job, []),
            spool,
            perms,
            self.reactor,
            enabled=cfg.blackbox.enabled,
        )
        self.incidents = Incidents(
            repos.incidents,
            repos.sessions,
            cfg.node_name,
            cfg.watch,
            [
                self.incident_counts,
                *record_sinks(repos.incidents, repos.files, spool, perms, self.uploads),
                self.freezer,
            ],
            capture=IncidentCapture(
                self.registry, self.ledgers, self.starter, lambda: self.cfg.watch
            ),
            owner_of=self.registry.owner,
        )
        self.detectors = Detectors(
            self.ledgers, self.registry, self.incidents, cfg.watch.rules(), cfg.watch.enabled
        )
        self.samples = Samples(
            rules_of(cfg.watch),
            self.registry,
            self.sessions,
            self.starter,
            repos.sessions,
            repos.files,
            open_incident=self._sample_incident,
            referenced=self.incidents.referenced_sessions,
            clear_incident=self.incidents.clear_ranks,
        )
        self.hangs = Hangs(
            self.registry,
            self.rank_stacks,
            self.incidents,
            cfg.watch.stall_after,
            cfg.watch.enabled,
        )

    def _build_agents(self, spool: Path, rules: list[StartRequest]) -> None:
        cfg = self.cfg
        self.intake = Intake(
            self.sessions,
            self.inbox,
            self.captures,
            self.incoming,
            self.nsys,
            self.storage,
            self._send_agent,
        )
        self.attach = attach = Attach(
            Welcome(str(spool), cfg.blackbox.welcome()),
            self.pace,
            self.registry,
            self.sessions,
            self.arms,
            AutoRules(rules, self.starter, self.sessions, self.arms),
            self.liveness,
            self._send_agent,
            cfg.limits,
        )
        self.agents = AgentHandler(
            self.registry,
            self.sessions,
            self.starter,
            self.liveness,
            attach,
            self.intake,
            self._send_agent,
            self.ledgers,
            stacks_result=self.agent_stacks.result,
            blackbox_result=self.agent_blackboxes.result,
        )

    def _build_control(self, spool: Path, repos: _Repos) -> ControlHandler:
        cfg = self.cfg
        facts = DaemonFacts(
            cfg.node_name,
            time.time(),
            cfg.runtime_dir,
            cfg.state_dir,
            spool,
            cfg.max_spool_bytes,
            fsutil.boot_id(),
            runtime.group_id(cfg.admin_group),
            cfg.heartbeat_interval,
        )
        return ControlHandler(
            facts,
            self.registry,
            self.ledgers,
            self.sessions,
            repos.sessions,
            repos.traces,
            repos.files,
            self.upload_queue,
            repos.minutes,
            self.starter,
            self.flush,
            self._send_control,
            self._live_status,
            self.results.retry,
            self.incidents,
            stacks=self.rank_stacks,
            blackboxes=self.blackboxes,
            warehouse=self.warehouse,
            warehouse_rows=WarehouseQueueRepo(self.index),
        )

    def _build_publisher(self) -> MetricsPublisher | None:
        if self.metrics is None:
            return None
        return MetricsPublisher(
            self.metrics,
            self.upload_queue,
            self.sessions,
            self.ledgers,
            self.registry,
            self.incident_counts,
        )

    def _parts(self) -> list[Part]:
        """Each tick's work, in this order; then the loop flushes the session changes."""
        publishing: list[Part] = [self.publisher] if self.publisher is not None else []
        return [
            HeartbeatAnswers(self.agents),
            Pacing(self.attach),
            Housekeeping(self.liveness),
            StackExpiry(self.agent_stacks, self.agent_blackboxes),
            LedgerMinutes(self.ledgers, self.registry),
            MinuteWriter(self.history, self.ledgers),
            Detecting(self.detectors),
            StallWatch(self.hangs),
            IncidentKeeping(self.incidents),
            FrozenBoxes(self.freezer, self.incidents, FileRepo(self.index), self.uploads),
            NsysPolling(self.nsys),
            Sampling(self.samples),
            *publishing,
            DeferredReports(self.intake),
            ParkedCaptures(self.captures),
            OwedManifests(self.sessions, self.write_manifests),
        ]

    # --- wiring -----------------------------------------------------------------------------
    def _send_agent(self, ident: bytes, frame: bytes) -> None:
        # Two sends, not send_multipart: the same frames for a third of the Python cost, on
        # the path every heartbeat reply of every client takes.
        try:
            self.agent_sock.send(ident, _MORE)
            self.agent_sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("send to client failed: %s", exc)

    def _send_control(self, frames: list[bytes]) -> None:
        try:
            self.control_sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("control reply failed: %s", exc)

    def _send_tcp(self, frames: list[bytes]) -> None:
        assert self.tcp is not None
        try:
            self.tcp.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("TCP control reply failed: %s", exc)

    def _handle_tcp(self, frames: list[bytes], _peer: PeerCred | None) -> None:
        self.control.handle_operator(frames, self._send_tcp)

    def _live_status(self) -> dict[str, Any]:
        tcp = (
            {"listen": self.tcp.endpoint, "refused": self.tcp.refused}
            if self.tcp is not None
            else None
        )
        return {
            "tcp": tcp,
            "metrics": {"listen": self.metrics.address} if self.metrics is not None else None,
            "pipeline": self.captures.status(),
            "storage": {
                **self.storage.status(),
                "reports_waiting": self.intake.deferred,
                "manifests_waiting": self.sessions.manifests_owed,
                "temp_files_removed": self.temp_files_removed,
            },
            "rejected_messages": self.agents.rejected,
            "limits": {
                "regions_folded": self.ledgers.regions_folded,
                "heartbeats_coalesced": self.ledgers.coalesced,
                "peers_refused": self.agents.attach.peers_refused,
            },
            "heartbeat": {
                "interval_s": self.pace.interval,
                "base_s": self.pace.base,
                "max_per_s": self.pace.max_rate,
            },
            # Step jumps a rank's rate cannot explain, left out of the samples' steps.
            "watch": {"implausible_steps": self.samples.arming.trust.implausible},
            "gc": self.gc_pauses.status(),
            "s3": self.uploads.status() if self.uploads is not None else {"configured": False},
            "warehouse": (
                self.warehouse.status(WarehouseQueueRepo(self.index))
                if self.warehouse is not None
                else {"enabled": False}
            ),
        }

    # --- lifecycle ------------------------------------------------------------------------------
    def bind(self) -> None:
        rdir = self.cfg.runtime_dir
        gid = runtime.prepare(rdir, self.cfg.group)
        runtime.claim(rdir)
        self.agent_sock = self._router(rdir / P.AGENT_SOCKET, gid)
        self.control_sock = self._router(rdir / P.CONTROL_SOCKET, gid)
        if self.tcp is not None:
            self.tcp.bind()
        if self.metrics is not None:
            self.metrics.start()

    def _router(self, path: Path, gid: int | None) -> Any:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.bind(f"ipc://{path}")
        runtime.secure_socket(path, gid)
        return s

    def run(self) -> None:
        self.bind()
        self._install_signals()
        self._restore()
        # What start-up built (modules, classes, the config, the restored index) lives as long
        # as the daemon: frozen out of the collector's full passes, which otherwise walk all of
        # it every few seconds at 1,024 clients, ~20 ms on the loop each time (the ps round
        # trip's p99, docs/benchmarks.md). Before any worker thread starts: nothing a thread
        # holds for a while (a request, a frame) is frozen with it.
        gc.collect()
        gc.freeze()
        self.gc_pauses.install()
        liveness = self.liveness
        procstats = ProcStats(
            self.cfg.sample_interval,
            # The process-statistics thread reads a snapshot the loop publishes, never the registry.
            pids=lambda: list(liveness.read_pids),
            report=lambda readings: self.reactor.call_soon(liveness.on_readings, readings),
        )
        procstats.start()
        if self.uploads is not None:
            self.uploads.start()
        if self.warehouse is not None:
            self.warehouse.start()
        log.info(
            "profd %s (protocol %d..%d) listening on %s (state %s, spool %s)",
            __version__,
            P.MIN_VERSION,
            P.VERSION,
            self.cfg.runtime_dir,
            self.cfg.state_dir,
            self.sessions.spool,
        )
        if self.publisher is not None:  # a scrape before the first tick finds the daemon as it is
            guarded("publishing metrics", self.publisher.tick, time.monotonic(), time.time())
        self.sd.ready(f"listening on {self.cfg.runtime_dir}")
        try:
            self._loop()
        finally:
            procstats.stop()
            self._shutdown()

    def _install_signals(self) -> None:
        def on_signal(signum: int, _frame: FrameType | None) -> None:
            self.reactor.call_soon(self.stop, signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, lambda _s, _f: self.reactor.call_soon(self.reload))

    def reload(self) -> None:
        """SIGHUP: ``[watch]`` read again from the config file; the rest needs a restart. A
        ``[watch]`` that cannot be used leaves the one in use as it is."""
        try:
            watch = reload_watch(self.cfg.config_file)
        except ConfigError as exc:
            log.warning("reload: keeping [watch] as it was: %s", exc)
            return
        if watch == self.cfg.watch:
            log.info("reload: [watch] unchanged")
            return
        self.cfg = dataclasses.replace(self.cfg, watch=watch)
        self.parts.reconfigure(watch)
        log.info("reload: [watch] now %s", watch)

    def stop(self, why: str = "") -> None:
        log.info("shutting down%s", f" ({why})" if why else "")
        self.stopping = True

    def _shutdown(self) -> None:
        self.sd.stopping("shutting down")
        self.gc_pauses.uninstall()
        if self.metrics is not None:
            self.metrics.stop()
        for s in (self.agent_sock, self.control_sock):
            if s is not None:
                s.close(0)
        if self.tcp is not None:
            self.tcp.close()
        for name in (P.AGENT_SOCKET, P.CONTROL_SOCKET):
            (self.cfg.runtime_dir / name).unlink(missing_ok=True)
        guarded("writing the open incidents", self.incidents.save_open)
        if self.uploads is not None:
            self.uploads.stop()
        if self.warehouse is not None:
            self.warehouse.stop()
        # Let running post-processing finish: its raw input is deleted only on success, and
        # the inbox row makes the next daemon redo anything cut off.
        self.captures.shutdown()
        self.nsys.shutdown()
        self.rank_stacks.reader.close()
        while self.reactor.run_pending():
            pass
        self.flush()
        # Every rank's open minute, so far, as if all had left: a restarted daemon's history
        # has no gap.
        closing = [LedgerMinutes(self.ledgers, ()), MinuteWriter(self.history, self.ledgers)]
        Parts(closing).tick(time.monotonic(), time.time())
        self.index.close()
        log.info("stopped")

    def _restore(self) -> None:
        # Before anything is written again, and only now that this daemon holds the runtime
        # directory: a second daemon started by mistake must not take a running one's files.
        self.temp_files_removed = leftovers.remove_temp_files(self.sessions.spool)
        for s in self.sessions.restore():
            if s.backend == "nsys":
                self.nsys.restored(s)
            else:
                self.liveness.restored(s.targets)
        for _key, row in self.inbox.inbox_raw_left():
            guarded("deleting an indexed raw trace", self._delete_raw, row)
        for _key, row in self.inbox.inbox_pending():
            guarded("resubmitting a capture", self._resubmit, row)
        self.sessions.settle_restored()
        held = self.incidents.restore()
        if held:
            log.info("%d incident(s) still open", held)

    def _delete_raw(self, row: dict[str, Any]) -> None:
        self.results.delete_raw(CaptureReport.from_row(row))

    def _resubmit(self, row: dict[str, Any]) -> None:
        self.intake.resubmit(CaptureReport.from_row(row))

    # --- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.agent_sock, zmq.POLLIN)
        poller.register(self.control_sock, zmq.POLLIN)
        poller.register(self.reactor.fd, zmq.POLLIN)
        tcp = self.tcp
        if tcp is not None:
            poller.register(tcp.zap, zmq.POLLIN)
            poller.register(tcp.monitor, zmq.POLLIN)
            poller.register(tcp.sock, zmq.POLLIN)
        # The same sockets without agent.sock, polled while agent messages are let gather.
        quiet = zmq.Poller()
        for sock, _ in poller.sockets:
            if sock is not self.agent_sock:
                quiet.register(sock, zmq.POLLIN)
        agent_due = 0.0
        hb = self.cfg.heartbeat_interval
        next_tick = time.monotonic() + hb
        while not self.stopping:
            now = time.monotonic()
            due = min(next_tick, self.sd.next_ping)
            if now < agent_due:
                due = min(due, agent_due)
                events = dict(quiet.poll(int(max(0.0, due - now) * 1000.0) + 1))
            else:
                events = dict(poller.poll(int(max(0.0, due - now) * 1000.0)))
            if self.reactor.fd in events:
                self.reactor.run_pending()
            # Operators first: a start must not wait behind a batch of heartbeats.
            if self.control_sock in events:
                self._drain(self.control_sock, self.control.handle)
            if tcp is not None:
                if tcp.zap in events:
                    guarded("answering ZAP", tcp.handle_zap)
                if tcp.monitor in events:
                    guarded("reading the TCP monitor", tcp.handle_monitor)
                if tcp.sock in events:
                    self._drain(tcp.sock, self._handle_tcp)
            if self.agent_sock in events:
                self._drain(self.agent_sock, self.agents.handle, between=self._answer_operators)
                agent_due = time.monotonic() + AGENT_LINGER_S
            self.flush()
            now = time.monotonic()
            self.sd.watchdog(now)  # from this thread: a wedged loop stops pinging
            if now >= next_tick:
                # A tick at 1,024 ranks is ~10 ms of parts: operators are answered between them.
                self.parts.tick(now, time.time(), self._answer_operators)
                self.flush()
                next_tick = now + hb

    def _answer_operators(self) -> bool:
        """Requests waiting on control.sock or the TCP socket, answered now (between the
        parts of a tick, or between agent messages of one batch), at most
        :data:`BETWEEN_PARTS` from each: a burst of requests waits
        for the next loop pass rather than stretch the tick. A socket's events are read
        without blocking. True when a request was answered."""
        handled = 0
        if self.control_sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            handled += self._drain(self.control_sock, self.control.handle, BETWEEN_PARTS)
        tcp = self.tcp
        if tcp is not None and tcp.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            handled += self._drain(tcp.sock, self._handle_tcp, BETWEEN_PARTS)
        if not handled:
            return False
        self.flush()
        self.sd.watchdog(time.monotonic())
        return True

    def _sample_incident(
        self,
        kind: str,
        job: str,
        role: str | None,
        suspects: list[Suspect],
        step: int | None,
        evidence: dict[str, Any],
    ) -> Incident | None:
        # A straggler is named only when a sample ends: it stays open until a later sample
        # of its role names it no more (Incidents.clear_ranks), or for the cooldown.
        return self.incidents.open(
            kind, job, role, suspects, step, evidence, keep_for=self.cfg.watch.cooldown
        )

    def _drain(
        self,
        sock: Any,
        handle: Callable[[list[bytes], PeerCred | None], None],
        limit: int = BATCH,
        between: Callable[[], object] | None = None,
    ) -> int:
        """Messages waiting on ``sock`` handled, at most ``limit``; how many there were.
        ``between`` is called after every :data:`OPERATORS_EVERY` of them."""
        for n in range(limit):
            if between is not None and n and n % OPERATORS_EVERY == 0:
                between()
            try:
                # copy=False: only a zmq.Frame carries the connection's kernel credentials.
                # Frame by frame rather than recv_multipart, which asks the socket for
                # RCVMORE after each frame: this runs for every message of every client.
                last = sock.recv(zmq.NOBLOCK, copy=False)
                frames = [last.bytes]
                while last.more:
                    last = sock.recv(zmq.NOBLOCK, copy=False)
                    frames.append(last.bytes)
            except zmq.Again:
                return n
            guarded("handling a message", handle, frames, _peer(last))
        return limit

    def flush(self) -> None:
        """Persist this iteration's session changes; write finished sessions' manifests."""
        if not self.sessions.changed:
            return
        try:
            finished = self.sessions.flush()
        except Exception as exc:  # the index is unwritable now; changes wait for the next try
            self.storage.failed("index", exc, "session changes")
            return
        self.storage.ok("index")
        for s in finished:
            log.info("session %s %s", s.id, s.state)
            self.arms.ended(s.id)
            if s.backend == "nsys":
                guarded("ending an nsys session", self.nsys.session_ended, s)
            guarded("ending an incident's capture", self.incidents.capture_ended, s)
            self.incoming.remove_incoming(s.job, s.id)
            guarded("watching a sample", self.samples.finished, s)
        if finished:
            faults.point("session-ended")
            self.write_manifests()

    def write_manifests(self) -> None:
        """Write and index owed ``session.json`` files; what fails waits for the next tick."""
        exc = self.sessions.write_manifests(
            lambda s, path: self.results.session_manifest(
                s.id, s.job, path, layout.is_cluster_session(s.request)
            )
        )
        if exc is None:
            self.storage.ok("spool")
        else:
            area = "index" if isinstance(exc, sqlite3.Error) else "spool"
            self.storage.failed(area, exc, f"{self.sessions.manifests_owed} session.json")


def _make_exporter(cfg: Config) -> Exporter | None:
    if not cfg.warehouse.enabled:
        return None  # and pyarrow is never imported
    from profd.warehouse.export import Exporter

    return Exporter(cfg)


def _prepare_spool(cfg: Config) -> tuple[Path, SpoolPerms]:
    perms = SpoolPerms(runtime.group_id(cfg.group))
    cfg.spool_dir.mkdir(parents=True, exist_ok=True)
    spool = cfg.spool_dir.resolve()
    perms.prepare_root(spool)
    return spool, perms


#: Peer addresses seen, parsed: every message of every client carries its connection's, and
#: a client's is the same string each time. Bounded by emptying it when full.
_PEERS: dict[str, PeerCred | None] = {}
_PEERS_MAX = 8192


def _peer(frame: Any) -> PeerCred | None:
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:  # no such property: not an IPC connection, or an old libzmq
        return None
    try:
        return _PEERS[address]
    except KeyError:
        if len(_PEERS) >= _PEERS_MAX:
            _PEERS.clear()
        cred = _PEERS[address] = PeerCred.parse(address)
        return cred
