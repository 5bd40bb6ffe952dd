"""The agent thread: owns the ZeroMQ socket to the daemon.

It registers (``hello``), heartbeats, turns ``arm``/``disarm`` pushes into commands for the
training thread, and delivers the training thread's reports, keeping each one until the
daemon acks it. If the daemon sends nothing for three of its answer intervals (the heartbeat
interval, times the welcome's ``acks``: our hello asks for ``quiet`` answers, one every few
heartbeats) the agent drops the socket and registers again. A restarted daemon answers the
next heartbeat with "say hello first", and the agent registers again at once.
Nothing here can raise into training code: every failure ends in a retry.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import flight
from . import protocol as P
from .blackbox import BlackBox
from .capture import torch_info
from .identity import DistInfo, Identity, RayInfo, detect, probe_dist
from .ledger import Reader
from .locations import locate_socket, warn_untrusted
from .stacks import own_stacks
from .steps import ArmedSession, Stepper, pending_write, ready
from .waits import Waits

log = logging.getLogger("profd_client")

MISSED_HEARTBEATS = 3
#: Heartbeat phases after a new pace: a generator of our own, since training scripts seed
#: ``random`` alike on every rank, which would give every rank the same phase.
_PHASES = random.Random()
#: How long an exiting process waits for a memory snapshot still being written, so that the
#: report naming it reaches the daemon.
WRITE_WAIT_S = 30.0


@dataclass(frozen=True)
class Explicit:
    """What ``attach()`` was told: it wins over everything detected, every time."""

    job: str | None = None
    role: str | None = None
    rank: int | None = None
    world_size: int | None = None


class Agent(threading.Thread):
    def __init__(
        self,
        ident: Identity,
        stepper: Stepper,
        step_mode: str,
        allowed: bool,
        runtime_dir: str | None,
        hb_interval: float,
        explicit: Explicit | None = None,
        ray: RayInfo | None = None,
        dist: DistInfo | None = None,
        allow: Callable[[int], bool] | None = None,
        box: BlackBox | None = None,
    ) -> None:
        super().__init__(name="profd-agent", daemon=True)
        #: This rank's black box (None: ``PROFD_BLACKBOX=0``); sampled from this thread.
        self.box = box
        self.who = ident
        # For detecting the identity again once the job's process group exists.
        self._explicit = explicit or Explicit()
        self._ray = ray
        self._dist = dist
        self._allow = allow
        self.stepper = stepper
        self.step_mode = step_mode
        self.allowed = allowed
        self.runtime_dir = runtime_dir
        self.hb_interval = hb_interval
        self.stopping = threading.Event()
        self.connected = threading.Event()  # set while welcomed by a daemon
        self.attaching = False  # attach() waits for the welcome (see attach(wait=...))
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._unacked: dict[int, dict[str, Any]] = {}
        self._sock: Any = None
        self._last_rx = 0.0
        #: Seconds between the daemon's answers to our heartbeats (its welcome's ``acks``).
        self._answer_every = hb_interval
        self._last_tx = 0.0
        self._welcomed = False
        self._last_step = 0
        self._last_step_t = time.monotonic()
        self._sent_tid: int | None = None
        self._sps = 0.0
        self._ledger = Reader(stepper)
        #: This rank's collective wait, read with the ledger where torch times collectives.
        self._waits = Waits(stepper)
        #: The protocol version spoken now: ours, or lower once a daemon refused it.
        self.proto = P.VERSION
        self._warned_version = False
        self._warned_step_down = False
        #: The first version refused since we last connected, and why; said once welcomed,
        #: naming the version that was (not every version tried on the way down).
        self._refused: tuple[int, str] | None = None
        self._warned_identity = False

    # Called from the training thread (slow path only) and from detach().
    def notify(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # pipe full: the agent is already due to wake

    def stop(self, timeout: float = 1.0) -> None:
        self.stopping.set()
        self.notify()
        if pending_write(list(self.stepper.outbox)) is not None:
            timeout += WRITE_WAIT_S  # _goodbye waits for it
        self.join(timeout)

    # --- thread ---------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            import zmq
        except Exception as exc:  # pragma: no cover - pyzmq is a hard dependency
            log.warning("profd_client: pyzmq unavailable (%s); profiling disabled", exc)
            return
        ctx: Any = zmq.Context.instance()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        self._connect(zmq, ctx, poller)
        while not self.stopping.is_set():
            try:
                self._loop_once(zmq, ctx, poller)
            except Exception as exc:  # keep serving: a bad frame must not end the agent
                log.debug("profd_client agent error: %r", exc)
                time.sleep(self.hb_interval)
        self._goodbye(zmq)

    def _loop_once(self, zmq: Any, ctx: Any, poller: Any) -> None:
        now = time.monotonic()
        wait = max(0.0, self._last_tx + self.hb_interval - now)
        box = self.box
        if box is not None:
            due = box.due(time.perf_counter())
            if due is not None:
                wait = min(wait, due)
        events = dict(poller.poll(math.ceil(wait * 1000.0)))
        if box is not None:
            try:
                box.sample(time.perf_counter())
            except Exception as exc:  # a sample lost, never the agent
                log.debug("profd_client: black box sample failed: %r", exc)
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        if self._sock in events:
            for _ in range(256):
                try:
                    frame = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frame)
        self._flush_outbox()
        now = time.monotonic()
        if now - self._last_tx >= self.hb_interval:
            # Once per heartbeat, on this thread: the training thread never pays for it.
            if self._identity_changed() and self._welcomed:
                self._send(self._hello())  # re-register; the daemon drops what no longer fits
                self._last_tx = now
                return
            if self._welcomed:
                self._send(self._heartbeat_frame())
            else:
                self._send(self._hello())
            self._last_tx = now
        if self._welcomed and now - self._last_rx > MISSED_HEARTBEATS * self._answer_every:
            log.info("profd_client: daemon silent; re-registering")
            self._connect(zmq, ctx, poller)

    def _connect(self, zmq: Any, ctx: Any, poller: Any) -> None:
        if self._sock is not None:
            poller.unregister(self._sock)
            self._sock.close(0)
        found = locate_socket(P.AGENT_SOCKET, self.runtime_dir, wait=True)
        if found.untrusted is not None:
            warn_untrusted(found.untrusted, found.path)
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a daemon that is not there
        s.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if found.path is not None:
            s.connect(f"ipc://{found.path}")
        # Else the socket stays unconnected: every send fails at once, as with no daemon, and
        # the loop runs unchanged without a hello ever reaching a listener we cannot trust.
        poller.register(s, zmq.POLLIN)
        self._sock = s
        self._welcomed = False
        self.connected.clear()
        self.proto = P.VERSION  # a new daemon may speak ours
        self._refused = None
        self._last_tx = 0.0  # say hello at once

    def _send(self, frame: bytes) -> bool:
        import zmq

        try:
            self._sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def _hello(self) -> bytes:
        i = self.who
        tv, dev = torch_info()
        # Whoever reads this hello learns of us now: the next ledger covers what follows.
        self._ledger.restart()
        self._waits.restart()
        extra: dict[str, Any] = {"flight": True} if flight.enabled() else {}
        if self.box is not None:
            extra["blackbox"] = True
        return P.encode(
            P.HELLO,
            quiet=True,
            v=self.proto,
            pid=i.pid,
            host=i.host,
            job=i.job,
            role=i.role,
            rank=i.rank,
            local_rank=i.local_rank,
            world_size=i.world_size,
            step=self.stepper.count,
            step_mode=self.step_mode,
            allowed=self.allowed,
            client_version=P.RELEASE,
            torch=tv,
            device=dev,
            sessions=self.stepper.busy_sessions(),
            nsys_session=os.environ.get(P.NSYS_SESSION_ENV) or None,
            waiting=self.attaching,
            identity_source=dict(i.sources),
            training_tid=self._told_tid(),
            **extra,
        )

    def _told_tid(self) -> int:
        """The training thread's id, remembered as told (heartbeats repeat it only when
        it changes)."""
        tid = self._sent_tid = self.stepper.training_tid
        return tid

    def _identity_changed(self) -> bool:
        """Detect again when the process group appeared, went or changed; True if this
        process is now someone else (rank, world size, job)."""
        d = probe_dist()
        if d == self._dist:
            return False
        self._dist = d
        x = self._explicit
        new = detect(
            job=x.job, role=x.role, rank=x.rank, world_size=x.world_size, dist=d, ray=self._ray
        )
        if new.key() == self.who.key():
            self.who = new  # the same, maybe from another source now
            return False
        old, self.who = self.who, new
        self.stepper.stem = f"{new.role}-r{new.rank}"
        if self._allow is not None:
            self.allowed = self._allow(new.rank)
        log.info(
            "profd_client: now job %s role %s rank %d/%d (was job %s role %s rank %d/%d)",
            new.job,
            new.role,
            new.rank,
            new.world_size,
            old.job,
            old.role,
            old.rank,
            old.world_size,
        )
        return True

    def _heartbeat(self) -> dict[str, Any]:
        step = self.stepper.count
        now = time.monotonic()
        dt = now - self._last_step_t
        if dt >= 0.5:
            self._sps = max(0.0, (step - self._last_step) / dt)
            self._last_step, self._last_step_t = step, now
        hb: dict[str, Any] = {
            "step": step,
            "sps": round(self._sps, 3),
            "state": self.stepper.state(),
        }
        if self.stepper.training_tid != self._sent_tid:
            hb["training_tid"] = self._told_tid()
        # Taken whatever the daemon's version (``adapter`` drops it for one before 3).
        try:
            ledger = self._ledger.take()
        except Exception as exc:  # never let the ledger cost the heartbeat
            log.debug("profd_client: ledger not read: %r", exc)
            ledger = None
        if ledger is not None:
            try:
                wait = self._waits.take()
            except Exception as exc:  # nor the collective wait
                log.debug("profd_client: collective wait not read: %r", exc)
                wait = None
            if wait is not None:
                ledger["wait"] = wait
            hb["ledger"] = ledger
        return hb

    def _heartbeat_frame(self) -> bytes:
        hb = self._heartbeat()
        try:
            return P.encode(P.HEARTBEAT, v=self.proto, **hb)
        except P.ProtocolError as exc:
            # A ledger this side got wrong (a bug) must not cost the heartbeat: the daemon
            # would drop this process.
            if hb.pop("ledger", None) is None:
                raise
            log.debug("profd_client: ledger not sent: %s", exc)
            return P.encode(P.HEARTBEAT, v=self.proto, **hb)

    def _handle(self, frame: bytes) -> None:
        try:
            msg = P.decode(frame, P.CLIENT_INBOUND)
        except P.ProtocolError as exc:
            self._refuse(exc)
            return
        self._last_rx = time.monotonic()
        if type(msg) is P.Welcome:
            # The daemon drops clients after missing *its* heartbeat interval: follow it.
            interval = max(0.05, msg.hb_interval)
            if self._welcomed and interval != self.hb_interval:
                # A new pace, told to every client of the node at once: a phase of our own
                # keeps their heartbeats spread over the new interval instead of together.
                self._last_tx = self._last_rx - _PHASES.random() * interval
            self.hb_interval = interval
            # An older daemon answers every heartbeat and says nothing of it.
            acks = 1 if msg.acks is P.UNSET else msg.acks
            self._answer_every = acks * self.hb_interval
            if self.box is not None and msg.blackbox is not P.UNSET:
                self.box.configure(P.fields_of(msg.blackbox))
            self._welcomed = True
            self.connected.set()
            refused, self._refused = self._refused, None
            if refused is not None and self.proto < refused[0] and not self._warned_step_down:
                log.warning(
                    "profd_client: the profd daemon refused protocol version %d (%s);"
                    " stepped down to version %d",
                    refused[0],
                    refused[1],
                    self.proto,
                )
                self._warned_step_down = True
            for m in list(self._unacked.values()):
                self._send_report(m)
        elif type(msg) is P.Arm:
            self._arm(msg)
        elif type(msg) is P.Disarm:
            self.stepper.post("disarm", (msg.session, msg.keep))
        elif type(msg) is P.Ack:
            self._unacked.pop(msg.id, None)
        elif type(msg) is P.DumpStacks:
            self._send_stacks(msg.id, msg.stacks, msg.flight)
        elif type(msg) is P.Blackbox:
            self._send_blackbox(msg.id)
        elif type(msg) is P.Error:
            self._error(msg)

    def _error(self, msg: P.Error) -> None:
        if msg.code == P.ErrorCode.UNKNOWN_CLIENT:
            self._welcomed = False
            self._send(self._hello())
        elif msg.code == P.ErrorCode.VERSION and msg.v <= self.proto:
            # Also once welcomed: the daemon was replaced by one that no longer speaks our
            # version (a rollback). Its error says so; say hello again in one it may speak.
            # (An error in a higher version is about a message sent before we stepped down.)
            self._welcomed = False
            self.connected.clear()
            self._version_refused(msg.msg)
        elif msg.code in (P.ErrorCode.IDENTITY, P.ErrorCode.LIMIT) and not self._warned_identity:
            # Not ours to fix from here (a daemon that cannot see our pid, one run by another
            # user, or this process or user has as many ranks attached as the daemon takes):
            # say so once and train on; hellos go on in case it changes.
            log.warning("profd_client: the profd daemon refused this process: %s", msg.msg)
            self._warned_identity = True

    def _version_refused(self, why: str) -> None:
        """The daemon does not speak our version: try the older ones we still speak."""
        if self._refused is None:
            self._refused = (self.proto, why)
        if self.proto > P.MIN_VERSION:
            self.proto -= 1
            self._send(self._hello())
            return
        if not self._warned_version:
            # Training goes on unprofiled; hellos continue (at our own version again, after
            # the next reconnect) in case the daemon is upgraded.
            log.warning("profd_client: the profd daemon refused this client: %s", why)
            self._warned_version = True

    def _send_stacks(self, request: int, stacks: bool, recorder: bool) -> None:
        extra: dict[str, Any] = {}
        if recorder:
            try:
                extra["flight"] = flight.summary()
            except Exception as exc:  # its one line goes back instead; training goes on
                extra["flight_error"] = f"{type(exc).__name__}: {exc}"[: P.MAX_TEXT]
        try:
            threads = own_stacks() if stacks else []
            frame = P.encode(P.STACKS_RESULT, v=self.proto, id=request, threads=threads, **extra)
            if len(frame) > P.MAX_FRAME_BYTES and "flight" in extra:
                extra = {"flight_error": "its flight recorder's summary is too large to send"}
                frame = P.encode(
                    P.STACKS_RESULT, v=self.proto, id=request, threads=threads, **extra
                )
        except Exception as exc:  # never let the answer cost the agent thread
            log.debug("profd_client: stacks not sent: %r", exc)
            return
        if len(frame) <= P.MAX_FRAME_BYTES:
            self._send(frame)

    def _send_blackbox(self, request: int) -> None:
        """The black box, within one frame: halved (its oldest steps dropped) until it fits."""
        box = self.box
        if box is None:
            return
        most: int | None = None
        try:
            for _ in range(16):
                fields = box.snapshot(most)
                frame = P.encode(P.BLACKBOX_RESULT, v=self.proto, id=request, **fields)
                if len(frame) <= P.MAX_FRAME_BYTES:
                    self._send(frame)
                    return
                held = len(fields["ends"]) // 8
                if held <= 2:
                    break  # the daemon names this rank as not answering
                most = held // 2
        except Exception as exc:  # never let the answer cost the agent thread
            log.debug("profd_client: black box not sent: %r", exc)

    def _refuse(self, exc: P.ProtocolError) -> None:
        """A frame we cannot use. An ``arm`` we cannot follow is said so, never dropped
        silently: the session would wait for this rank forever."""
        raw = exc.raw
        session = raw.get("session") if isinstance(raw, dict) else None
        if isinstance(raw, dict) and raw.get("t") == P.ARM and isinstance(session, str):
            self._arm_failed(session, f"cannot follow this arm: {exc}", raw.get("plan"))
            return
        log.debug("profd_client: dropped bad frame from daemon: %s", exc)

    def _arm_failed(self, session: str, error: str, revision: object) -> None:
        """``revision``: the arm's ``plan`` field, as sent (the report names it back)."""
        if not (isinstance(revision, int) and 0 <= revision <= P.MAX_REVISION):
            revision = 0
        try:
            frame = P.encode(
                P.PROGRESS,
                v=self.proto,
                id=0,
                session=session,
                state="failed",
                step=self.stepper.count,
                error=error,
                plan=revision,
            )
        except P.ProtocolError as bad:  # a session id we could not even name back
            log.debug("profd_client: dropped bad arm: %s (%s)", error, bad)
            return
        self._send(frame)

    def _arm(self, msg: P.Arm) -> None:
        session = msg.session
        me = P.Peer(self.who.host, self.who.pid)
        try:
            if not self.allowed:
                raise P.ProtocolError(P.ErrorCode.NOT_ALLOWED, "rank excluded by PROFD_RANKS")
            armed = ArmedSession(
                session=session,
                job=msg.job,
                backend=msg.backend,
                cycles=[(w, a, b) for w, a, b in msg.cycles],
                options=P.fields_of(msg.options),
                incoming=Path(P.adapter.home(msg.incoming, msg.v, me)),
                region=msg.region,
                revision=msg.plan,
                # The identity of our last hello: the one the daemon armed, or one it is about
                # to see and then disarm this session for.
                stem=f"{self.who.role}-r{self.who.rank}",
            )
        except P.ProtocolError as exc:
            self._arm_failed(session, str(exc), msg.plan)
            return
        self.stepper.post("arm", armed)
        self._send(
            P.encode(
                P.ARMED,
                v=self.proto,
                session=session,
                cycles=[list(c) for c in armed.cycles],
                plan=armed.revision,
            )
        )

    def _flush_outbox(self) -> None:
        out = self.stepper.outbox
        if not out:
            return
        # A report whose file is still being written waits, and so does every report behind
        # it (a session's ``done`` must not overtake its last capture); the writer notifies.
        while out and ready(out[0]):
            m = out.popleft()
            self._unacked[m["id"]] = m
            if self._welcomed:
                self._send_report(m)
        if self._welcomed:
            # The state ``ps`` shows is the last heartbeat's: right behind the reports, it
            # reads ``idle`` before their session can end, never the ``armed`` of a beat
            # sent before the capture.
            self._send(self._heartbeat_frame())
            self._last_tx = time.monotonic()

    def _send_report(self, m: dict[str, Any]) -> None:
        try:
            frame = P.encode(v=self.proto, **m)
        except P.ProtocolError as exc:
            # Our own report breaks the contract (a bug): say so instead of retrying forever.
            log.warning("profd_client: report %s not sent: %s", m.get("t"), exc)
            self._unacked.pop(m["id"], None)
            return
        self._send(frame)

    def _goodbye(self, zmq: Any) -> None:
        # Give reports from a capture cut short by exit a moment to reach the daemon.
        write = pending_write(list(self.stepper.outbox))
        if write is not None:
            write.done.wait(WRITE_WAIT_S)
        self._flush_outbox()
        deadline = time.monotonic() + 1.0
        while self._unacked and self._welcomed and time.monotonic() < deadline:
            if self._sock.poll(50):
                try:
                    self._handle(self._sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    pass
        if self._welcomed:
            self._send(P.encode(P.BYE, v=self.proto))
        try:
            self._sock.close(100)
        except Exception:
            pass
