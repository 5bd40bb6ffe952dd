"""The training-thread side of the client: the step counter and capture plans.

The hot path (:meth:`Stepper.tick`) is an integer increment and one compare. Everything else
runs in :meth:`Stepper._boundary`, entered only when ``count`` reaches ``next_event``; the
agent thread forces that by posting a command and setting ``next_event = 0``. The training
thread owns ``count``, the plans and the live capture; the agent thread only reads ``count``
(an atomic read under the GIL) and talks to it through two deques.

Every report to the daemon carries an ``id`` and stays in the agent's outbox until the
daemon acks it, so a capture that ends while the daemon is down is delivered later.
Terminal report states per session: ``done``, ``failed``, ``stopped``, ``cancelled``. A plan
whose first step had passed when it reached the training thread is reported ``late`` and
dropped; the daemon then re-plans the session (``--next``) or fails the rank.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import protocol as P
from .capture import CaptureResult, TorchCapture, torch_info
from .nsysrange import NsysRange

NEVER = 1 << 62
_ids = itertools.count(1)


@dataclass
class Plan:
    """An armed session on this process: cycles of absolute steps ``[warmup, start, stop)``."""

    session: str
    job: str
    backend: str
    cycles: list[tuple[int, int, int]]
    options: dict[str, Any]
    incoming: Path
    region: str | None = None
    rev: int = 0  # the daemon's revision of these steps (``arm``'s ``plan``)
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

    plan: Plan
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
    __slots__ = ("_notify", "_plans", "count", "inbox", "live", "next_event", "outbox", "stem")

    def __init__(self, stem: str, notify: Callable[[], None]) -> None:
        self.count = 0  # steps completed; the step running now is count + 1
        self.next_event = NEVER
        self.inbox: deque[tuple[str, Any]] = deque()  # from the agent thread
        self.outbox: deque[dict[str, Any]] = deque()  # to the agent thread
        self.live: Live | None = None
        self.stem = stem  # "{role}-r{rank}"
        self._notify = notify
        self._plans: list[Plan] = []

    # --- hot path ----------------------------------------------------------------------------
    def tick(self) -> None:
        self.count += 1
        if self.count >= self.next_event:
            self._boundary()

    def set_step(self, n: int) -> None:
        """Resumed runs: ``n`` steps are done, the next one is ``n + 1``."""
        if n == self.count:
            return  # no step ended: a capture must not count one
        live = self.live
        if live is not None and n != self.count + 1:
            self._cut(live, n)
        self.count = n
        self._boundary()

    def boundary_now(self) -> None:
        """Apply what the agent posted at once (attach(): the boundary before step 1)."""
        self._boundary()

    # --- agent side (called on the agent thread) ----------------------------------------------
    def post(self, kind: str, payload: Any) -> None:
        self.inbox.append((kind, payload))
        self.next_event = 0

    def busy_sessions(self) -> list[str]:
        names = [p.session for p in list(self._plans)]
        live = self.live
        if live is not None and live.plan.session not in names:
            names.append(live.plan.session)
        return names

    def state(self) -> str:
        live = self.live
        if live is not None:
            return "capturing" if live.capture is not None else "region-wait"
        return "armed" if self._plans else "idle"

    # --- boundary (training thread) -----------------------------------------------------------
    def _boundary(self) -> None:
        try:
            self._drain_inbox()
            self._advance()
        except Exception as exc:  # never let profiling break training
            live, self.live = self.live, None
            if live is not None:
                self._discard(live)
                self._progress(live.plan, "failed", f"client error: {exc!r}")
        self._reschedule()

    def _reschedule(self) -> None:
        live = self.live
        if live is not None and live.capture is not None:
            nxt = self.count + 1
        elif live is not None:
            nxt = live.stop - 1  # region window: close it when its last step completes
        else:
            nxt = min((p.pending_start() for p in self._plans), default=NEVER) - 1
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

    def _arm(self, plan: Plan) -> None:
        live = self.live
        held = next((p for p in self._plans if p.session == plan.session), None)
        if held is None and live is not None and live.plan.session == plan.session:
            held = live.plan
        if held is not None:
            if plan.rev <= held.rev:
                return  # a repeated arm (re-sent after a reconnect): the plan is already here
            self._drop(held)  # the daemon moved this session's steps: the old plan is void
        first = plan.cycles[0][0]
        if first <= self.count:
            # Not final: for --next the daemon answers with later steps for every rank.
            self._progress(plan, "late", f"steps already passed: at step {self.count}")
            return
        self._plans.append(plan)

    def _drop(self, plan: Plan) -> None:
        """Forget a superseded plan without a report; its partial capture is discarded."""
        live = self.live
        if live is not None and live.plan is plan:
            self.live = None
            self._discard(live)
        if plan in self._plans:
            self._plans.remove(plan)

    @staticmethod
    def _discard(live: Live) -> None:
        """Throw the window's capture away (a region capture: when its region exits)."""
        if live.capture is None:
            return
        if live.plan.region is None:
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
            if cap is None or live.plan.region is not None:
                return  # nothing running, or a region capture that its exit ends
            _, a, b = live.plan.cycles[live.cycle]
            if self.count < a:  # still warming up: nothing was recorded
                cap.abandon()
                self._progress(live.plan, "missed", f"cycle {live.cycle} ({a}:{b}) missed: {why}")
                return
            res = cap.finish(self.count)
            res.notes.append(why)
            self._deliver(live.plan, live.cycle, res, None)
        except Exception as exc:  # never let profiling break training
            self._progress(live.plan, "failed", f"client error: {exc!r}")

    def _disarm(self, session: str | None, keep: bool) -> None:
        state = "stopped" if keep else "cancelled"
        live = self.live
        if live is not None and (session is None or live.plan.session == session):
            self.live = None
            if live.capture is not None and live.plan.region is not None:
                # Inside the region: its exit ends the capture, then reports the state.
                live.keep, live.final_state = keep, state
            else:
                if live.capture is not None:
                    if keep:
                        self._deliver(live.plan, live.cycle, live.capture.finish(self.count), None)
                    else:
                        live.capture.abandon()
                self._progress(live.plan, state, None)
        keep_plans = []
        for p in self._plans:
            if session is None or p.session == session:
                if live is None or p is not live.plan:
                    self._progress(p, state, None)
            else:
                keep_plans.append(p)
        self._plans = keep_plans

    def _advance(self) -> None:
        step_next = self.count + 1
        live = self.live
        if live is not None:
            if live.plan.region is not None and live.capture is not None:
                return  # the window closes when the open region exits
            if step_next < live.stop:
                if live.capture is not None and live.plan.region is None:
                    live.capture.step()
                return
            self.live = None
            if live.capture is not None:
                self._deliver(live.plan, live.cycle, live.capture.finish(self.count), None)
            self._maybe_done(live.plan)
        # A cycle whose start passed while another capture ran is missed, not shifted: every
        # targeted rank must capture the same steps.
        for p in list(self._plans):
            while p.pending_start() < step_next:
                _, a, b = p.cycles[p.next_cycle]
                self._progress(p, "missed", f"cycle {p.next_cycle} ({a}:{b}) missed")
                p.next_cycle += 1
            self._maybe_done(p)
        due = [p for p in self._plans if p.pending_start() == step_next]
        if not due:
            return
        plan = due[0]
        cycle = plan.next_cycle
        w, a, b = plan.cycles[cycle]
        plan.next_cycle += 1
        if plan.region is not None:
            self.live = Live(plan=plan, cycle=cycle, stop=b)
            self._progress(plan, "capturing", None)
            return
        cap: TorchCapture | NsysRange
        if plan.backend == "nsys":
            cap = NsysRange(a)
        else:
            cap = TorchCapture(
                plan.options, plan.incoming / f"c{cycle}", plan.stem or self.stem, w, a
            )
        try:
            cap.start()
        except Exception as exc:
            # The same cause would fail every later cycle too: give the whole plan up.
            self._plans.remove(plan)
            what = "cudaProfilerStart" if plan.backend == "nsys" else "torch.profiler start"
            self._progress(plan, "failed", f"{what} failed: {exc}")
            return
        self.live = Live(plan=plan, cycle=cycle, stop=b, capture=cap)
        self._progress(plan, "capturing", None)

    def _maybe_done(self, plan: Plan) -> None:
        live = self.live
        idle = live is None or live.plan is not plan
        if idle and plan.pending_start() == NEVER and plan in self._plans:
            self._plans.remove(plan)
            self._progress(plan, "done", None)

    # --- regions --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Only entered while a capture or a region window is live (see ``region()``)."""
        live = self.live
        if live is not None and live.plan.region == name and live.capture is None:
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
        plan = live.plan
        cycle = plan.region_entries
        plan.region_entries += 1
        running = self.count + 1
        cap = TorchCapture(
            plan.options, plan.incoming / f"c{cycle}", plan.stem or self.stem, running, running
        )
        try:
            cap.start()
            live.capture = cap
        except Exception as exc:
            self._progress(plan, "missed", f"region capture failed to start: {exc!r}")
            yield
            return
        try:
            with _marked(name):
                yield
        finally:
            live.capture = None
            if live.keep:
                res = cap.finish(last_step=running)
                self._deliver(plan, cycle, res, name)
            else:
                cap.abandon()
            if live.final_state is not None:
                self._progress(plan, live.final_state, None)
            if self.live is live and self.count + 1 >= live.stop:
                self.live = None
                self._maybe_done(plan)
            self._reschedule()

    # --- reports to the daemon ------------------------------------------------------------------
    def _deliver(self, plan: Plan, cycle: int, res: CaptureResult, region: str | None) -> None:
        tv, dev = torch_info()
        self._send(
            {
                "t": P.CAPTURED,
                "session": plan.session,
                "job": plan.job,
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
                "plan": plan.rev,
            }
        )

    def _progress(self, plan: Plan, state: str, error: str | None) -> None:
        self._send(
            {
                "t": P.PROGRESS,
                "session": plan.session,
                "state": state,
                "step": self.count,
                "error": error,
                "plan": plan.rev,
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
