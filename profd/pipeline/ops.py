"""Per-operator time from a kineto trace: CPU operators by self time, GPU activities."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .spans import STEP_PREFIX

CPU_OP_CATS = frozenset({"cpu_op", "user_annotation", "python_function"})
GPU_OP_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass(frozen=True)
class OpStat:
    name: str
    calls: int
    self_us: float
    total_us: float


def cpu_op_stats(events: Iterable[Mapping[str, Any]]) -> list[OpStat]:
    """Per-name CPU operator stats with self time = duration minus direct children.

    ``events`` are the complete events of the CPU categories (``EventGroups.cpu``).

    Nesting is resolved per (pid, tid) with one sort and a stack sweep, O(n log n), because a
    large trace holds hundreds of thousands of events. ProfilerStep annotations take part in
    the nesting (so they do not leak into the self time of anything) but are left out of the
    result, since they are whole steps, not operators.
    """
    by_thread: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for ev in events:
        key = (ev.get("pid"), ev.get("tid"))
        by_thread.setdefault(key, []).append(
            (float(ev["ts"]), float(ev["dur"]), str(ev.get("name", "")))
        )

    calls: dict[str, int] = {}
    self_us: dict[str, float] = {}
    total_us: dict[str, float] = {}
    for intervals in by_thread.values():
        # Parents before children: earlier start first, and at equal start the longer one.
        intervals.sort(key=lambda iv: (iv[0], -iv[1]))
        children_us = [0.0] * len(intervals)
        stack: list[tuple[float, int]] = []  # (end, index)
        for i, (ts, dur, _) in enumerate(intervals):
            # Compare starts against ends, not ends against ends: kineto rounds timestamps to
            # ns in floating point, so a child's end may overshoot its parent's by a hair.
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if stack:
                children_us[stack[-1][1]] += dur
            stack.append((ts + dur, i))
        for (_, dur, name), child in zip(intervals, children_us, strict=True):
            if name.startswith(STEP_PREFIX):
                continue
            calls[name] = calls.get(name, 0) + 1
            self_us[name] = self_us.get(name, 0.0) + max(dur - child, 0.0)
            total_us[name] = total_us.get(name, 0.0) + dur
    return _sorted_stats(calls, self_us, total_us)


def gpu_op_stats(events: Iterable[Mapping[str, Any]]) -> list[OpStat]:
    """Per-name GPU kernel/memcpy/memset stats of ``EventGroups.gpu``.

    Device activities do not nest, so self time is total time.
    """
    calls: dict[str, int] = {}
    dur_us: dict[str, float] = {}
    for ev in events:
        name = str(ev.get("name", ""))
        calls[name] = calls.get(name, 0) + 1
        dur_us[name] = dur_us.get(name, 0.0) + float(ev["dur"])
    return _sorted_stats(calls, dur_us, dur_us)


def _sorted_stats(
    calls: Mapping[str, int], self_us: Mapping[str, float], total_us: Mapping[str, float]
) -> list[OpStat]:
    stats = [OpStat(name, calls[name], self_us[name], total_us[name]) for name in calls]
    stats.sort(key=lambda s: (-s.self_us, s.name))
    return stats
