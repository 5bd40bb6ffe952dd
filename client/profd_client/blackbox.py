"""The black box: what this rank did over its last steps, kept always, so a slowdown that is
already over still has evidence when the daemon asks (``blackbox`` request).

Four rings, all allocated at attach and never grown:

- step end times: the :class:`~.steps.Stepper`'s own clock ring (:data:`STEP_SLOTS` steps;
  the training thread's ``tick`` writes it anyway, for the ledger);
- region exits (:class:`~.steps.RegionLog`, ``REGION_SLOTS`` per region): each outermost
  exit of a ``region()`` stores its end time and duration in its region's ring (two array
  stores on the exit, none per step); its step is found when the box is read, as the one
  whose end follows it;
- stack samples (:class:`Sampler`): the agent thread reads the training thread's frames
  (``sys._current_frames()``) at ``sample_hz``, interning each frame's text once, and keeps
  ``(time, step, stack)`` per sample;
- the flight recorder's collectives with their timings (``flight.timed``), read only when
  the daemon asks: torch keeps that ring itself.

What is sent (:meth:`BlackBox.snapshot`) is the last ``keep_steps`` steps and, beyond them,
every step that ended within the last ``keep_seconds``, as far as the rings reach; times are
``perf_counter`` readings, with ``clock`` (wall minus ``perf_counter``) to place them.
"""

from __future__ import annotations

import bisect
import math
import os
import sys
import time
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from . import flight
from . import protocol as P
from .steps import RING, RegionLog, Stepper, slots

#: Steps the stepper's clock ring holds: 120 s of steps down to ~3.7 ms ones.
STEP_SLOTS: Final = RING
#: Stack samples kept: 120 s at 10 Hz is 1,200.
SAMPLE_SLOTS: Final = 1 << 12
#: Interned frame texts and distinct stacks at most; when full, the ones no kept sample uses
#: are dropped, and a sample that still finds no room is kept as "not recorded" (-1).
MAX_FRAMES: Final = 4096
MAX_STACKS: Final = 2048
#: Innermost frames kept per sample, and characters per frame text.
MAX_DEPTH: Final = 64
#: Instruction offsets the walk remembers the frame index of (several share a line).
MAX_AT: Final = MAX_FRAMES
FRAME_TEXT: Final = 240
_SAMPLE_MASK: Final = SAMPLE_SLOTS - 1
assert SAMPLE_SLOTS & _SAMPLE_MASK == 0

#: Environment variables that override what the daemon says (a user's choice for their own
#: process wins); ``PROFD_BLACKBOX=0`` also keeps the rings from being allocated at all.
ENV: Final = {
    "enabled": "PROFD_BLACKBOX",
    "keep_steps": "PROFD_BLACKBOX_KEEP_STEPS",
    "keep_seconds": "PROFD_BLACKBOX_KEEP_SECONDS",
    "sample_hz": "PROFD_BLACKBOX_SAMPLE_HZ",
}


@dataclass(frozen=True)
class Settings:
    """``[blackbox]``, as the daemon's ``welcome`` says it (environment overrides applied)."""

    enabled: bool = True
    keep_steps: int = 512
    keep_seconds: float = 120.0
    sample_hz: float = 10.0


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings this process's environment fixes; a malformed value is ignored."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for key, name in ENV.items():
        text = env.get(name, "").strip()
        if not text:
            continue
        try:
            if key == "enabled":
                out[key] = text.lower() not in ("0", "false", "no", "off")
            elif key == "keep_steps":
                out[key] = max(1, int(text))
            else:
                x = float(text)
                if math.isfinite(x) and x >= 0:
                    out[key] = x
        except ValueError:
            continue
    return out


class Sampler:
    """The training thread's stack, read from the agent thread. Owned by the agent thread."""

    def __init__(self) -> None:
        self.n = 0
        self.t = array("d", bytes(8 * SAMPLE_SLOTS))
        self.step = array("q", bytes(8 * SAMPLE_SLOTS))
        self.stack = array("i", bytes(4 * SAMPLE_SLOTS))
        self.frames: list[str] = []
        self._frame_ids: dict[tuple[Any, int], int] = {}
        #: ``(id(code), f_lasti)`` -> frame index: the walk's cache. A frame's line
        #: (``f_lineno``) is computed from the code's line table and ``(code, line)`` hashes
        #: the whole code object, each costing more than the rest of the walk; an instruction
        #: offset is read as is. An id here stays its code's: ``_frame_ids`` holds every
        #: code this names, and compaction, which drops codes, empties this first.
        self._at: dict[tuple[int, int], int] = {}
        self.stacks: list[tuple[int, ...]] = []
        self._stack_ids: dict[tuple[int, ...], int] = {}

    def sample(self, ident: int, step: int, now: float) -> bool:
        """Keep thread ``ident``'s stack now, tagged with ``step``; False when it has none."""
        frame: Any = sys._current_frames().get(ident)
        if frame is None:
            return False
        if len(self.frames) > MAX_FRAMES - MAX_DEPTH:
            self._compact()  # room for every frame of this stack, before reading it
        sid = self.stack_id(self._key(frame))
        j = self.n & _SAMPLE_MASK
        self.t[j] = now
        self.step[j] = step
        self.stack[j] = sid
        self.n += 1
        return True

    def stack_id(self, key: tuple[int, ...]) -> int:
        """The index of the stack of frame indexes ``key`` (-1: no room)."""
        sid = self._stack_ids.get(key)
        return self._intern(key) if sid is None else sid

    def frame_id(self, k: tuple[Any, int]) -> int:
        """The index of frame ``(code, line)`` (-1: no room)."""
        i = self._frame_ids.get(k)
        return self._frame(k) if i is None else i

    def _key(self, frame: Any) -> tuple[int, ...]:
        at = self._at
        out: list[int] = []
        f = frame
        while f is not None and len(out) < MAX_DEPTH:
            i = at.get((id(f.f_code), f.f_lasti))
            out.append(self._located(f) if i is None else i)
            f = f.f_back
        return tuple(out)

    def _located(self, f: Any) -> int:
        code = f.f_code
        i = self.frame_id((code, f.f_lineno or 0))
        if i >= 0:
            if len(self._at) >= MAX_AT:
                self._at.clear()  # a cache: it fills again from the stacks seen next
            self._at[(id(code), f.f_lasti)] = i
        return i

    def _frame(self, k: tuple[Any, int]) -> int:
        if len(self.frames) >= MAX_FRAMES:
            return -1  # (room is made before a stack is read: see ``sample``)
        code, line = k
        text = f"{code.co_name} ({code.co_filename}:{line})"[:FRAME_TEXT]
        i = self._frame_ids[k] = len(self.frames)
        self.frames.append(text)
        return i

    def _intern(self, key: tuple[int, ...]) -> int:
        if -1 in key:
            return -1
        if len(self.stacks) >= MAX_STACKS:
            key = self._compact(key)
            if len(self.stacks) >= MAX_STACKS:
                return -1
        sid = self._stack_ids[key] = len(self.stacks)
        self.stacks.append(key)
        return sid

    def _compact(self, pending: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Forget the stacks and frames no kept sample uses, renumbering the rest; the
        frames of ``pending`` (a stack about to be interned) are kept, and it is returned
        renumbered."""
        held = range(max(0, self.n - SAMPLE_SLOTS), self.n)
        live = sorted({self.stack[i & _SAMPLE_MASK] for i in held} - {-1})
        stack_map = {old: new for new, old in enumerate(live)}
        used = sorted({f for s in live for f in self.stacks[s]} | set(pending))
        frame_map = {old: new for new, old in enumerate(used)}
        keys = {i: k for k, i in self._frame_ids.items()}
        self.frames = [self.frames[i] for i in used]
        self._at.clear()  # its indexes are the old ones
        self._frame_ids = {keys[old]: new for old, new in frame_map.items()}
        self.stacks = [tuple(frame_map[f] for f in self.stacks[s]) for s in live]
        self._stack_ids = {k: i for i, k in enumerate(self.stacks)}
        for i in held:
            j = i & _SAMPLE_MASK
            self.stack[j] = stack_map.get(self.stack[j], -1)
        return tuple(frame_map[f] for f in pending)

    def held(self) -> tuple[list[float], list[int], list[int]]:
        """The samples kept, oldest first: times, steps, stack indexes."""
        order = [i & _SAMPLE_MASK for i in range(max(0, self.n - SAMPLE_SLOTS), self.n)]
        t, step, stack = self.t.tolist(), self.step.tolist(), self.stack.tolist()
        return [t[j] for j in order], [step[j] for j in order], [stack[j] for j in order]


def _bytes(kind: str, values: list[Any]) -> bytes:
    a = array(kind, values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


class BlackBox:
    """This rank's black box: the rings (allocated here, at attach) and the settings the
    daemon gave. The agent thread owns it; the training thread only writes the step ring
    and, through its region timers, :attr:`log`."""

    def __init__(self, stepper: Stepper, overrides: Mapping[str, Any] | None = None) -> None:
        self.st = stepper
        self.overrides = dict(env_overrides() if overrides is None else overrides)
        self.settings = replace(Settings(), **self.overrides)
        self.log = RegionLog(stepper.regions)
        self.sampler = Sampler()
        self.next_sample = 0.0
        stepper.blackbox_log = self.log
        self.log.on = self.settings.enabled

    def configure(self, given: Mapping[str, Any] | None) -> None:
        """The daemon's ``[blackbox]`` (``welcome``); this process's environment wins."""
        fields = {k: v for k, v in (given or {}).items() if k in Settings.__dataclass_fields__}
        self.settings = replace(Settings(), **{**fields, **self.overrides})
        self.log.on = self.settings.enabled

    def due(self, now: float) -> float | None:
        """Seconds until the next sample (0: now); None when not sampling."""
        s = self.settings
        if not s.enabled or s.sample_hz <= 0:
            return None
        return max(0.0, self.next_sample - now)

    def sample(self, now: float) -> None:
        """Take a sample if one is due (called by the agent thread, between its polls)."""
        wait = self.due(now)
        if wait is None or wait > 0:
            return
        period = 1.0 / self.settings.sample_hz
        # A late sample (a long poll, a GIL held elsewhere) is not caught up: the next one is
        # one period from now.
        self.next_sample = max(self.next_sample + period, now)
        st = self.st
        self.sampler.sample(st.training_ident, st.count + 1, now)

    def snapshot(self, max_steps: int | None = None) -> dict[str, Any]:
        """The ``blackbox_result`` fields (all but ``v`` and ``id``): the steps held (at
        most ``max_steps`` of them, the newest), their regions and samples, and the flight
        recorder's timed collectives where it is on."""
        s = self.settings
        out: dict[str, Any] = {
            "clock": time.time() - time.perf_counter(),
            "settings": {
                "enabled": s.enabled,
                "keep_steps": s.keep_steps,
                "keep_seconds": s.keep_seconds,
                "sample_hz": s.sample_hz,
            },
        }
        step0, ends = self._steps(max_steps)
        out["step0"] = step0
        out["ends"] = _bytes("d", ends)
        last = step0 + len(ends) - 1
        names = [t.name for t in list(self.st.regions.values())]
        regions, rends, seconds = self.log.held()
        # An exit ran in the step whose end follows it (ends[0] is step0's end): those
        # before step0's end are older than what is sent, those after the last end ran in
        # the step not finished yet (last + 1).
        steps = [step0 + bisect.bisect_left(ends, t) for t in rends]
        keep = [i for i, x in enumerate(steps) if step0 < x <= last + 1]
        out["regions"] = names
        out["region_steps"] = _bytes("q", [steps[i] for i in keep])
        out["region_ids"] = _bytes("h", [regions[i] for i in keep])
        out["region_ends"] = _bytes("d", [rends[i] for i in keep])
        out["region_seconds"] = _bytes("d", [seconds[i] for i in keep])
        out.update(self._samples(step0, last + 1))
        if flight.enabled():
            try:
                out["collectives"] = flight.timed()
            except Exception as exc:  # said instead; the rest of the box still goes
                out["collectives_error"] = f"{type(exc).__name__}: {exc}"[: P.MAX_TEXT]
        return out

    def _steps(self, max_steps: int | None) -> tuple[int, list[float]]:
        """``(step0, ends)``: the end times of steps ``step0 ..``; ``ends[0]`` is where step
        ``step0 + 1`` began."""
        st = self.st
        base = st.base
        c = st.count
        if base is None:
            return c, []
        s = self.settings
        # From the last jump on (the first step's end is one): slots before it are stale.
        first = max(base[1], c - STEP_SLOTS + 2)
        ends = slots(st._ring, first, c)
        c2 = st.count
        oldest = c2 + 2 - STEP_SLOTS
        if first < oldest:
            ends = ends[oldest - first :]
            first = oldest
        if not ends:
            return c, []
        # The last keep_steps steps, and before them those that ended in keep_seconds.
        cut = ends[-1] - s.keep_seconds
        i = max(0, len(ends) - 1 - s.keep_steps)
        while i > 0 and ends[i - 1] >= cut:
            i -= 1
        if max_steps is not None:
            i = max(i, len(ends) - 1 - max_steps)
        return first + i, ends[i:]

    def _samples(self, after: int, upto: int) -> dict[str, Any]:
        smp = self.sampler
        t, step, stack = smp.held()
        keep = [i for i, x in enumerate(step) if after < x <= upto]
        used = sorted({stack[i] for i in keep} - {-1})
        stack_map = {old: new for new, old in enumerate(used)}
        frames_used = sorted({f for s in used for f in smp.stacks[s]})
        frame_map = {old: new for new, old in enumerate(frames_used)}
        return {
            "frames": [smp.frames[f] for f in frames_used],
            "stacks": [[frame_map[f] for f in smp.stacks[s]] for s in used],
            "sample_t": _bytes("d", [t[i] for i in keep]),
            "sample_steps": _bytes("q", [step[i] for i in keep]),
            "sample_stacks": _bytes("i", [stack_map.get(stack[i], -1) for i in keep]),
        }
