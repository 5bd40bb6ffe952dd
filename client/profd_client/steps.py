"""The training-thread side of the client: the step counter, the step ledger's clock readings,
region timers and the armed sessions.

The hot path (:meth:`Stepper.tick`) is one clock read stored in a preallocated ring, an integer
increment and one compare. Everything else runs in :meth:`Stepper._boundary`, entered only
when ``count`` reaches ``next_event``; the agent thread forces that by posting a command and
setting ``next_event = 0``. The training thread owns ``count``, the ring, the region timers,
the armed sessions and the live capture; the agent thread only reads them (``count`` is an
atomic read under the GIL) and talks to it through two deques.

The step ledger: ``_ring[k & _MASK]`` holds the :func:`time.perf_counter` reading at the end of
step ``k``. Step 1 is not timed: from ``attach()`` to its end the process may load data,
build the model or wait for its peers, which is no step time; the first boundary moves the
ledger's base to step 1's end as a jump would. A slot is written before
``count`` says its step is done, so a reader that sees ``count == k`` finds step ``k``'s slot
written; the agent thread reads ``count`` again after copying slots to tell which of them the
training thread may have overwritten meanwhile (``profd_client.ledger``). ``step(n)`` that is
not ``count + 1`` is a jump: ``epoch`` moves on and no step is timed across it. ``region()``
times every entry into each of the first :data:`~.protocol.MAX_LEDGER_REGIONS` names it sees
(:class:`RegionTimer`), captured or not.

Every report to the daemon carries an ``id`` and stays in the agent's outbox until the
daemon acks it, so a capture that ends while the daemon is down is delivered later.
Terminal report states per session: ``done``, ``failed``, ``stopped``, ``cancelled``. An
armed session whose first step had passed when it reached the training thread is reported
``late`` and dropped; the daemon then re-plans the session (``--next``) or fails the rank.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from . import protocol as P
from .capture import (
    CUDA_MEMORY,
    CaptureResult,
    MemoryHistory,
    SnapshotWrite,
    TorchCapture,
    torch_info,
)
from .nsysrange import NsysRange

NEVER = 1 << 62
_ids = itertools.count(1)
#: Steps the clock ring holds: the ledger reads the last ``LEDGER_RING`` of them, the black
#: box (``blackbox.py``) as many as it keeps.
RING: Final = 1 << 15
#: Ring index of a step: ``k & _MASK`` (RING is a power of two).
_MASK: Final = RING - 1
assert RING & _MASK == 0 and RING >= P.LEDGER_RING
#: A ledger's ``epoch`` is at most 2**31: it wraps.
_EPOCH_MASK: Final = (1 << 31) - 1
#: What ``region()`` returns for a block it does not time (not attached, a name it cannot
#: send, or one name too many).
NULL_REGION: AbstractContextManager[None] = contextlib.nullcontext()
#: The key of a report that names a file still being written off the training thread; the
#: agent thread holds the report, and every report after it, until :func:`ready`.
PENDING: Final = "_pending"


def ready(report: dict[str, Any]) -> bool:
    """Whether ``report`` may go to the daemon: no file it names is still being written.
    Once its write has ended the key is removed; a write that failed takes its file out of
    the report and leaves a note why (the trace beside it is still delivered)."""
    write: SnapshotWrite | None = report.get(PENDING)
    if write is None:
        return True
    if not write.done.is_set():
        return False
    del report[PENDING]
    if write.error is not None:
        report["files"] = [f for f in report["files"] if f["path"] != str(write.path)]
        report["notes"] = [*report["notes"], write.error]
    return True


def pending_write(reports: Iterable[dict[str, Any]]) -> SnapshotWrite | None:
    """The first unfinished write among ``reports`` (what an exiting agent waits for)."""
    for r in reports:
        w: SnapshotWrite | None = r.get(PENDING)
        if w is not None and not w.done.is_set():
            return w
    return None


#: Exits the black box keeps of each region: its last ``REGION_SLOTS`` outermost exits.
REGION_SLOTS: Final = 1 << 12
_REGION_MASK: Final = REGION_SLOTS - 1
assert REGION_SLOTS & _REGION_MASK == 0


class RegionLog:
    """Whether the region timers record their exits for the black box, and reading them.

    Each timer (:class:`RegionTimer`) keeps its own ring of ``REGION_SLOTS`` exits, two
    adjacent doubles each (end, seconds), allocated when the black box first records it and
    never grown: at most ``MAX_LEDGER_REGIONS`` of them. An exit stores its record before
    ``entries`` counts it, so a reader that copies after reading ``entries`` finds the
    records below it written (as the step ring). An exit stores no step: the step it ran in
    is the one whose end follows it on the same clock (:meth:`BlackBox.snapshot` looks it
    up in the step ring), so the exit, which comes right after a step's work has pushed this
    process's data out of the CPU's caches, costs two array stores (docs/design.md "Black
    box"; measured in docs/benchmarks.md)."""

    __slots__ = ("_on", "_timers")

    def __init__(self, timers: dict[str, RegionTimer]) -> None:
        self._timers = timers
        self._on = False

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, on: bool) -> None:
        if on != self._on:
            self._on = on
            for t in list(self._timers.values()):
                t.recording(on)

    def adopt(self, timer: RegionTimer) -> None:
        """A timer made after the black box: it records if the box does."""
        if self._on:
            timer.recording(True)

    def held(self) -> tuple[list[int], list[float], list[float]]:
        """The exits still held, by end time: region indexes, ends, durations."""
        out: list[tuple[float, int, float]] = []
        if not self._on:
            return [], [], []
        for t in list(self._timers.values()):
            ring = t._ring
            if ring is None:
                continue
            n1 = t.entries
            rec = ring.tolist()
            # Exits up to n2 may have been stored meanwhile, each over the one REGION_SLOTS
            # before it: only those after that are whole. A slot never written (or cleared
            # when recording restarted) holds an end of 0.
            first = max(0, n1 - REGION_SLOTS, t.entries + 1 - REGION_SLOTS)
            for i in range(first, n1):
                k = (i & _REGION_MASK) << 1
                if rec[k] > 0.0:
                    out.append((rec[k], t.index, rec[k + 1]))
        out.sort()
        return [r[1] for r in out], [r[0] for r in out], [r[2] for r in out]


def slots(ring: list[float], first: int, last: int) -> list[float]:
    """The clock ring's times of steps ``first..last`` (at most ``RING``), oldest first."""
    if last < first:
        return []
    i, j = first & _MASK, last & _MASK
    return ring[i : j + 1] if i <= j else ring[i:] + ring[: j + 1]


class RegionTimer:
    """Wall time spent inside one region name: ``seconds`` and ``entries`` (outermost entries;
    a nested entry of the same name adds neither). Reused for every entry, so entering costs
    no allocation beyond the clock's float.

    The open entries are a stack of start times: ``list.append``/``pop`` are atomic under the
    GIL, so entries from several threads can make the time the span during which any of them
    was open, but never leave the timer stuck open (as a depth counter's lost update could).
    Time is added when the outermost entry exits; while the black box records
    (:class:`RegionLog`), that exit's end and duration also go into this timer's ring.
    """

    __slots__ = ("_clock", "_open", "_rec", "_ring", "entries", "index", "name", "seconds")

    def __init__(self, name: str, clock: Callable[[], float], index: int = 0) -> None:
        self.name = name
        self.seconds = 0.0
        self.entries = 0
        self._open: list[float] = []
        self._clock = clock
        self.index = index  # its place in ``Stepper.regions`` (the black box's records name it)
        #: This timer's ring of exits, once the black box has recorded it; ``_rec`` is the
        #: ring while recording and None otherwise (one load and one test on the exit).
        self._ring: array[float] | None = None
        self._rec: array[float] | None = None

    def recording(self, on: bool) -> None:
        """Start or stop storing exits (the agent thread, between the training thread's
        exits or during one: an exit reads ``_rec`` once)."""
        if not on:
            self._rec = None
            return
        if self._ring is None:
            self._ring = array("d", bytes(16 * REGION_SLOTS))
        else:  # what was stored before a pause would be read as exits after it
            self._ring[:] = array("d", bytes(16 * REGION_SLOTS))
        self._rec = self._ring

    def __enter__(self) -> None:
        self._open.append(self._clock())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        opened = self._open
        t0 = opened.pop()
        if not opened:
            t1 = self._clock()
            d = t1 - t0
            self.seconds += d
            n = self.entries
            rec = self._rec
            if rec is not None:
                # Stored before ``entries`` counts the exit (see :class:`RegionLog`).
                k = (n & _REGION_MASK) << 1
                rec[k] = t1
                rec[k + 1] = d
            self.entries = n + 1


def _sendable(name: object) -> bool:
    """A region name a ledger can carry (``protocol.Ledger``'s ``r``), checked once per name."""
    if type(name) is not str or not 1 <= len(name) <= P.MAX_NAME:
        return False
    try:
        name.encode()  # a lone surrogate would make msgpack refuse the whole heartbeat
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class ArmedSession:
    """An armed session on this process: cycles of absolute steps ``[warmup, start, stop)``."""

    session: str
    job: str
    backend: str
    cycles: list[tuple[int, int, int]]
    options: dict[str, Any]
    incoming: Path
    region: str | None = None
    revision: int = 0  # the daemon's revision of these steps (``arm``'s ``plan`` field)
    #: "{role}-r{rank}" as the daemon knew this process when it armed it: the names its files
    #: must have, even if the process re-registers under another rank meanwhile.
    stem: str = ""
    next_cycle: int = 0
    region_entries: int = 0

    def pending_start(self) -> int:
        if self.next_cycle >= len(self.cycles):
            return NEVER
        return self.cycles[self.next_cycle][0]


@dataclass
class Live:
    """The step window being captured now."""

    armed: ArmedSession
    cycle: int
    stop: int  # first step not captured
    # For region-scoped plans the window is open but a profiler runs only inside the region.
    capture: TorchCapture | NsysRange | None = None
    # A region capture is ended only by its region's exit: stopping the profiler inside the
    # region's open record_function would corrupt torch's state. A stop, cancel or re-plan
    # that arrives meanwhile leaves its verdict here for that exit to carry out.
    keep: bool = True
    final_state: str | None = None  # the progress to report once the region has exited


class Stepper:
    __slots__ = (
        "_armed",
        "_clock",
        "_notify",
        "_ring",
        "_untimed_first",
        "base",
        "blackbox_log",
        "count",
        "epoch",
        "inbox",
        "live",
        "memory",
        "next_event",
        "outbox",
        "regions",
        "stem",
        "training_ident",
        "training_tid",
    )

    def __init__(
        self,
        stem: str,
        notify: Callable[[], None],
        clock: Callable[[], float] = time.perf_counter,
        memory: MemoryHistory = CUDA_MEMORY,
    ) -> None:
        self.count = 0  # steps completed; the step running now is count + 1
        self.next_event = 1  # the first step's end starts the ledger (see _rebase)
        self.inbox: deque[tuple[str, Any]] = deque()  # from the agent thread
        self.outbox: deque[dict[str, Any]] = deque()  # to the agent thread
        self.live: Live | None = None
        self.stem = stem  # "{role}-r{rank}"
        self._notify = notify
        self.memory = memory  # where --memory-snapshot captures take their snapshot
        self._armed: list[ArmedSession] = []
        # The ledger (see the module docstring). Bound here so tick() reads two attributes
        # and allocates nothing but the clock's float.
        self._clock = clock
        self._ring = [0.0] * RING
        t = clock()
        self._ring[0] = t
        self.epoch = 0
        #: ``(epoch, step, time)`` of the last jump (attach: step 0), replaced in one store so
        #: the agent reads it whole; None while a jump is being made.
        self.base: tuple[int, int, float] | None = (0, 0, t)
        #: Region name -> its timer; the agent thread reads it (``list(values())``).
        self.regions: dict[str, RegionTimer] = {}
        #: Until the first step ends: then the ledger starts from its end (see the docstring).
        self._untimed_first = True
        #: The native id of the thread that counts steps, for ``profctl stacks``: the one
        #: that attached until the first step's end says which thread steps (once, off the
        #: hot path). The agent thread reads it.
        self.training_tid: int = threading.get_native_id()
        #: Its Python id (``threading.get_ident()``): the black box samples its frames.
        self.training_ident: int = threading.get_ident()
        #: Where region exits are recorded for the black box (set by ``BlackBox``), if any.
        self.blackbox_log: RegionLog | None = None

    # --- hot path ----------------------------------------------------------------------------
    def tick(self) -> None:
        n = self.count + 1
        self._ring[n & _MASK] = self._clock()  # before count: see the module docstring
        self.count = n
        if n >= self.next_event:
            self._boundary()

    def set_step(self, n: int) -> None:
        """Resumed runs: ``n`` steps are done, the next one is ``n + 1``."""
        if n == self.count:
            return  # no step ended: a capture must not count one
        if n == self.count + 1:
            # step(i) called every step with the loop's own counter: a step ended, timed.
            self._ring[n & _MASK] = self._clock()
            self.count = n
        else:
            live = self.live
            if live is not None:
                self._cut(live, n)
            t = self._clock()
            self._ring[n & _MASK] = t
            self.count = n
            self._rebase(t)
        self._boundary()

    def _rebase(self, t: float) -> None:
        """Time only the steps after step ``count``, which ended at ``t`` (a jump, or the
        untimed first step): a new epoch tells the agent's reader to start from here."""
        self._untimed_first = False
        self.base = None  # the agent skips a ledger it read while this is None
        self.epoch = (self.epoch + 1) & _EPOCH_MASK
        self.base = (self.epoch, self.count, t)

    def boundary_now(self) -> None:
        """Apply what the agent posted at once (attach(): the boundary before step 1)."""
        self._boundary()

    # --- agent side (called on the agent thread) ----------------------------------------------
    def post(self, kind: str, payload: Any) -> None:
        self.inbox.append((kind, payload))
        self.next_event = 0

    def busy_sessions(self) -> list[str]:
        names = [p.session for p in list(self._armed)]
        live = self.live
        if live is not None and live.armed.session not in names:
            names.append(live.armed.session)
        return names

    def state(self) -> str:
        live = self.live
        if live is not None:
            return "capturing" if live.capture is not None else "region-wait"
        return "armed" if self._armed else "idle"

    # --- boundary (training thread) -----------------------------------------------------------
    def _boundary(self) -> None:
        if self._untimed_first and self.count >= 1:
            self.training_tid = threading.get_native_id()
            self.training_ident = threading.get_ident()
            self._rebase(self._ring[self.count & _MASK])
        try:
            self._drain_inbox()
            self._advance()
        except Exception as exc:  # never let profiling break training
            live, self.live = self.live, None
            if live is not None:
                self._discard(live)
                self._progress(live.armed, "failed", f"client error: {exc!r}")
        self._reschedule()

    def _reschedule(self) -> None:
        live = self.live
        if live is not None and live.capture is not None:
            nxt = self.count + 1
        elif live is not None:
            nxt = live.stop - 1  # region window: close it when its last step completes
        else:
            nxt = min((p.pending_start() for p in self._armed), default=NEVER) - 1
        if self._untimed_first:
            nxt = min(nxt, 1)  # the first step's end starts the ledger (slow path, once)
        self.next_event = nxt
        # Close the race with post(): an item appended after the drain must not wait.
        if self.inbox:
            self.next_event = 0

    def _drain_inbox(self) -> None:
        while self.inbox:
            kind, payload = self.inbox.popleft()
            if kind == "arm":
                self._arm(payload)
            elif kind == "disarm":
                self._disarm(payload[0], keep=payload[1])
            elif kind == "shutdown":
                self._disarm(None, keep=True)

    def _arm(self, armed: ArmedSession) -> None:
        live = self.live
        held = next((p for p in self._armed if p.session == armed.session), None)
        if held is None and live is not None and live.armed.session == armed.session:
            held = live.armed
        if held is not None:
            if armed.revision <= held.revision:
                return  # a repeated arm (re-sent after a reconnect): already armed
            self._drop(held)  # the daemon moved this session's steps: the old steps are void
        first = armed.cycles[0][0]
        if first <= self.count:
            # Not final: for --next the daemon answers with later steps for every rank.
            self._progress(armed, "late", f"steps already passed: at step {self.count}")
            return
        self._armed.append(armed)

    def _drop(self, armed: ArmedSession) -> None:
        """Forget a superseded arm without a report; its partial capture is discarded."""
        live = self.live
        if live is not None and live.armed is armed:
            self.live = None
            self._discard(live)
        if armed in self._armed:
            self._armed.remove(armed)

    @staticmethod
    def _discard(live: Live) -> None:
        """Throw the window's capture away (a region capture: when its region exits)."""
        if live.capture is None:
            return
        if live.armed.region is None:
            live.capture.abandon()
        else:
            live.keep = False

    def _cut(self, live: Live, n: int) -> None:
        """``step(n)`` jumped the count while a window was open: end it at the last step that
        really ran, so no report names steps that did not run here."""
        self.live = None
        why = f"step count set from {self.count} to {n} during the capture"
        cap = live.capture
        try:
            if cap is None or live.armed.region is not None:
                return  # nothing running, or a region capture that its exit ends
            _, a, b = live.armed.cycles[live.cycle]
            if self.count < a:  # still warming up: nothing was recorded
                cap.abandon()
                self._progress(live.armed, "missed", f"cycle {live.cycle} ({a}:{b}) missed: {why}")
                return
            res = cap.finish(self.count)
            res.notes.append(why)
            self._deliver(live.armed, live.cycle, res, None)
        except Exception as exc:  # never let profiling break training
            self._progress(live.armed, "failed", f"client error: {exc!r}")

    def _disarm(self, session: str | None, keep: bool) -> None:
        state = "stopped" if keep else "cancelled"
        live = self.live
        if live is not None and (session is None or live.armed.session == session):
            self.live = None
            if live.capture is not None and live.armed.region is not None:
                # Inside the region: its exit ends the capture, then reports the state.
                live.keep, live.final_state = keep, state
            else:
                if live.capture is not None:
                    if keep:
                        self._deliver(live.armed, live.cycle, live.capture.finish(self.count), None)
                    else:
                        live.capture.abandon()
                self._progress(live.armed, state, None)
        kept = []
        for p in self._armed:
            if session is None or p.session == session:
                if live is None or p is not live.armed:
                    self._progress(p, state, None)
            else:
                kept.append(p)
        self._armed = kept

    def _advance(self) -> None:
        step_next = self.count + 1
        live = self.live
        if live is not None:
            if live.armed.region is not None and live.capture is not None:
                return  # the window closes when the open region exits
            if step_next < live.stop:
                if live.capture is not None and live.armed.region is None:
                    live.capture.step()
                return
            self.live = None
            if live.capture is not None:
                self._deliver(live.armed, live.cycle, live.capture.finish(self.count), None)
            self._maybe_done(live.armed)
        # A cycle whose start passed while another capture ran is missed, not shifted: every
        # targeted rank must capture the same steps.
        for p in list(self._armed):
            while p.pending_start() < step_next:
                _, a, b = p.cycles[p.next_cycle]
                self._progress(p, "missed", f"cycle {p.next_cycle} ({a}:{b}) missed")
                p.next_cycle += 1
            self._maybe_done(p)
        due = [p for p in self._armed if p.pending_start() == step_next]
        if not due:
            return
        armed = due[0]
        cycle = armed.next_cycle
        w, a, b = armed.cycles[cycle]
        armed.next_cycle += 1
        if armed.region is not None:
            self.live = Live(armed=armed, cycle=cycle, stop=b)
            self._progress(armed, "capturing", None)
            return
        cap: TorchCapture | NsysRange
        if armed.backend == "nsys":
            cap = NsysRange(a)
        else:
            out = armed.incoming / f"c{cycle}"
            cap = TorchCapture(armed.options, out, armed.stem or self.stem, w, a, self.memory)
        try:
            cap.start()
        except Exception as exc:
            # The same cause would fail every later cycle too: give the whole session up.
            self._armed.remove(armed)
            what = "cudaProfilerStart" if armed.backend == "nsys" else "torch.profiler start"
            self._progress(armed, "failed", f"{what} failed: {exc}")
            return
        self.live = Live(armed=armed, cycle=cycle, stop=b, capture=cap)
        self._progress(armed, "capturing", None)

    def _maybe_done(self, armed: ArmedSession) -> None:
        live = self.live
        idle = live is None or live.armed is not armed
        if idle and armed.pending_start() == NEVER and armed in self._armed:
            self._armed.remove(armed)
            self._progress(armed, "done", None)

    # --- regions --------------------------------------------------------------------------------
    def timer(self, name: str) -> AbstractContextManager[None]:
        """The timer of region ``name``, made on its first entry; :data:`NULL_REGION` for a
        name a ledger cannot carry or beyond the first ``MAX_LEDGER_REGIONS`` names (the
        first seen keep their timers: names are not evicted, so totals only ever grow)."""
        regions = self.regions
        try:
            t = regions.get(name)
        except TypeError:  # unhashable: not a name
            return NULL_REGION
        if t is not None:
            return t
        if len(regions) >= P.MAX_LEDGER_REGIONS or not _sendable(name):
            return NULL_REGION
        t = regions[name] = RegionTimer(name, self._clock, len(regions))
        log = self.blackbox_log
        if log is not None:
            log.adopt(t)
        return t

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Only entered while a capture or a region window is live (see ``region()``); the
        block is timed as when idle, inside the profiler's start and stop."""
        with self._live_region(name), self.timer(name):
            yield

    @contextlib.contextmanager
    def _live_region(self, name: str) -> Iterator[None]:
        live = self.live
        if live is not None and live.armed.region == name and live.capture is None:
            with self._region_capture(live, name):
                yield
            return
        if live is None or live.capture is None:
            yield
            return
        with _marked(name):
            yield

    @contextlib.contextmanager
    def _region_capture(self, live: Live, name: str) -> Iterator[None]:
        armed = live.armed
        cycle = armed.region_entries
        armed.region_entries += 1
        running = self.count + 1
        out = armed.incoming / f"c{cycle}"
        cap = TorchCapture(
            armed.options, out, armed.stem or self.stem, running, running, self.memory
        )
        try:
            cap.start()
            live.capture = cap
        except Exception as exc:
            self._progress(armed, "missed", f"region capture failed to start: {exc!r}")
            yield
            return
        try:
            with _marked(name):
                yield
        finally:
            live.capture = None
            if live.keep:
                res = cap.finish(last_step=running)
                self._deliver(armed, cycle, res, name)
            else:
                cap.abandon()
            if live.final_state is not None:
                self._progress(armed, live.final_state, None)
            if self.live is live and self.count + 1 >= live.stop:
                self.live = None
                self._maybe_done(armed)
            self._reschedule()

    # --- reports to the daemon ------------------------------------------------------------------
    def _deliver(
        self, armed: ArmedSession, cycle: int, res: CaptureResult, region: str | None
    ) -> None:
        tv, dev = torch_info()
        report: dict[str, Any] = {
            "t": P.CAPTURED,
            "session": armed.session,
            "job": armed.job,
            "cycle": cycle,
            "steps": res.steps,
            "files": res.files,
            "started_at": res.started_at,
            "ended_at": res.ended_at,
            "stall_ms": res.stall_ms,
            "error": res.error,
            "notes": res.notes,
            "region": region,
            "torch": tv,
            "device": dev,
            "plan": armed.revision,
        }
        if res.pending is not None:
            report[PENDING] = res.pending
            res.pending.start(self._notify)
        self._send(report)

    def _progress(self, armed: ArmedSession, state: str, error: str | None) -> None:
        self._send(
            {
                "t": P.PROGRESS,
                "session": armed.session,
                "state": state,
                "step": self.count,
                "error": error,
                "plan": armed.revision,
            }
        )

    def _send(self, msg: dict[str, Any]) -> None:
        msg["id"] = next(_ids)
        self.outbox.append(msg)
        self._notify()


@contextlib.contextmanager
def _marked(name: str) -> Iterator[None]:
    """record_function plus an NVTX range (for nsys) around a region."""
    import torch
    from torch.profiler import record_function

    nvtx = torch.cuda.nvtx if torch.cuda.is_available() else None
    if nvtx is not None:
        nvtx.range_push(name)
    try:
        with record_function(name):
            yield
    finally:
        if nvtx is not None:
            nvtx.range_pop()
