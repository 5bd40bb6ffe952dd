"""Per-operator time from a kineto trace: CPU operators by self time, GPU activities.

Both are collected one event at a time (:class:`CpuOps`, :class:`GpuOps`, fed by
:class:`~.parsed.EventGroups`), so that a trace of millions of events never has to be held as
dicts: GPU activities are summed as they come, CPU operators are kept as three compact
columns per thread (start, duration, name id: 20 bytes an event) until their nesting is
resolved.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from profd.pipeline.columns import sorted_order
from profd.pipeline.spans import STEP_PREFIX

CPU_OP_CATS = frozenset({"cpu_op", "user_annotation", "python_function"})
GPU_OP_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass(frozen=True)
class OpStat:
    name: str
    calls: int
    self_us: float
    total_us: float


class _Thread:
    """One thread's CPU events, in trace order."""

    __slots__ = ("_order", "dur", "name", "ts")

    def __init__(self) -> None:
        self.ts = array("d")
        self.dur = array("d")
        self.name = array("I")  # index into CpuOps.names
        self._order: Sequence[int] | None = None

    def order(self) -> Sequence[int]:
        """Parents before children: earlier start first, and at equal start the longer one
        (then trace order: the sort is stable). Sorted once for every analysis that sweeps."""
        if self._order is None or len(self._order) != len(self.ts):
            self._order = sorted_order(self.ts, self.dur)
        return self._order


class CpuOps:
    """The complete events of the CPU categories (``EventGroups.cpu``), as compact columns."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}  # name -> id, each distinct name stored once
        self.names: list[str] = []
        # The category a name was first seen with: kept per name rather than per event, since
        # a name keeps its category in practice, and it costs nothing per event.
        self.cats: list[str] = []
        self.threads: dict[Hashable, _Thread] = {}  # (pid, tid) -> columns, first seen first

    def __len__(self) -> int:
        return sum(len(t.ts) for t in self.threads.values())

    def add(
        self, pid: Any, tid: Any, name: str, ts: float, dur: float, cat: str = "cpu_op"
    ) -> None:
        key: Hashable
        try:
            thread = self.threads.get((pid, tid))
            key = (pid, tid)
        except TypeError:  # a malformed (unhashable) pid or tid is a thread of its own
            key = ("\0unhashable", repr(pid), repr(tid))
            thread = self.threads.get(key)
        if thread is None:
            thread = self.threads[key] = _Thread()
        nid = self.ids.get(name)
        if nid is None:
            nid = self.ids[name] = len(self.names)
            self.names.append(name)
            self.cats.append(cat)
        thread.ts.append(ts)
        thread.dur.append(dur)
        thread.name.append(nid)

    def stats(self) -> list[OpStat]:
        """Per-name CPU operator stats with self time = duration minus direct children.

        Nesting is resolved per (pid, tid) with one sort and a stack sweep, O(n log n), because
        a large trace holds hundreds of thousands of events. ProfilerStep annotations take part
        in the nesting (so they do not leak into the self time of anything) but are left out
        of the result, since they are whole steps, not operators.
        """
        step = [name.startswith(STEP_PREFIX) for name in self.names]
        calls = [0] * len(self.names)
        self_us = [0.0] * len(self.names)
        total_us = [0.0] * len(self.names)
        for thread in self.threads.values():
            ts, dur, nid = thread.ts, thread.dur, thread.name
            order = thread.order()
            children_us = array("d", bytes(8 * len(ts)))
            stack: list[tuple[float, int]] = []  # (end, index)
            for i in order:
                start, d = ts[i], dur[i]
                # Compare starts against ends, not ends against ends: kineto rounds timestamps
                # to ns in floating point, so a child's end may overshoot its parent's by a hair.
                while stack and stack[-1][0] <= start:
                    stack.pop()
                if stack:
                    children_us[stack[-1][1]] += d
                stack.append((start + d, i))
            # Summed in the same order as the sweep, so the floats come out the same however
            # the trace was read.
            for i in order:
                n = nid[i]
                if step[n]:
                    continue
                d = dur[i]
                calls[n] += 1
                self_us[n] += max(d - children_us[i], 0.0)
                total_us[n] += d
        stats = [
            OpStat(name, calls[n], self_us[n], total_us[n])
            for n, name in enumerate(self.names)
            if calls[n]
        ]
        return _sort(stats)


class GpuOps:
    """Per-name GPU kernel/memcpy/memset totals (``EventGroups.gpu``), summed as they come,
    and each activity's interval as compact columns (the rank statistics need the device's
    busy time per step: 20 bytes an activity)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.dur_us: dict[str, float] = {}
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.ts = array("d")
        self.dur = array("d")
        self.name = array("I")

    def add(self, name: str, dur: float, ts: float | None = None) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.dur_us[name] = self.dur_us.get(name, 0.0) + dur
        if ts is None:
            return
        nid = self.ids.get(name)
        if nid is None:
            nid = self.ids[name] = len(self.names)
            self.names.append(name)
        self.ts.append(ts)
        self.dur.append(dur)
        self.name.append(nid)

    def stats(self) -> list[OpStat]:
        """Device activities do not nest, so self time is total time."""
        return _sort([OpStat(n, c, self.dur_us[n], self.dur_us[n]) for n, c in self.calls.items()])


def _sort(stats: list[OpStat]) -> list[OpStat]:
    stats.sort(key=lambda s: (-s.self_us, s.name))
    return stats
