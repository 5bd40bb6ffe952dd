"""Per-operator time from a kineto trace: CPU operators by self time, GPU activities.

Both are collected one event at a time (:class:`CpuOps`, :class:`GpuOps`, fed by
:class:`~.parsed.EventGroups`), so that a trace of millions of events never has to be held as
dicts: GPU activities are summed as they come, CPU operators are kept as three compact
columns per thread (start, duration, name id: 20 bytes an event) until their nesting is
resolved.

What the CPU tables count (``docs/reports.md`` says it for users):

* **operators** are ``cpu_op`` and ``user_annotation`` events. Python frames
  (``python_function``, recorded with ``--with-stack``) are **call sites**, a table of their
  own: an operator's self time is the same with and without ``--with-stack`` (frames inside
  an operator do not take from it, and frames are no operators).
* **profd's own work is left out**: frames of the ``profd_client`` package, everything inside
  them (zmq, msgpack), and a thread that runs nothing else (the client's agent thread).
* **names without addresses**: ``<built-in method mm of type object at 0x7f..>`` is one name
  however many objects (or processes, or ranks) it was called on.
* **wall-clock time**: an operator's self (and total) time is the time during which at least
  one of its calls is running (innermost, for self), so calls that overlap on several threads
  (gloo's ``gloo:all_reduce``) or nest in one another count once, and no operator can take
  longer than the trace.
"""

from __future__ import annotations

import itertools
import operator
import re
from array import array
from bisect import bisect_right
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from profd.pipeline.columns import sorted_order, wall_us
from profd.pipeline.spans import STEP_PREFIX

CPU_OP_CATS = frozenset({"cpu_op", "user_annotation", "python_function"})
GPU_OP_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: CUDA calls on a CPU thread: the launches GPU activities name by correlation id.
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
#: The category of a Python frame (``with_stack``): a call site, not an operator.
FRAME_CAT = "python_function"
ANNOTATION_CAT = "user_annotation"

# ``... object at 0x7f39a1b2c3d0>``: the address goes with its " at"; any other long hex
# number (an address printed some other way) becomes "0x…". Short ones (0x1, template
# arguments) stay.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+\b|\b0x[0-9a-fA-F]{6,}\b")
# A frame of the profd client, as torch names frames: ``profd_client/steps.py(280): _advance``
# (the path relative to its sys.path entry), or an absolute path when it has none.
_PROFD_FRAME = re.compile(r"(?:^|/)profd_client/[^/()]+\.py\(\d+\): ")
#: A call that ends this little after the profd frame it started in is still inside it
#: (kineto rounds timestamps to ns in floating point).
_EPS_US = 1e-3

# How a name takes part in the nesting.
_OP, _ANNOTATION, _FRAME = 0, 1, 2


def strip_addresses(name: str) -> str:
    """``name`` without the memory addresses Python prints in object reprs."""
    if "0x" not in name:
        return name
    return _ADDRESS.sub(lambda m: "" if m.group().startswith(" at") else "0x…", name)


def is_profd_frame(name: str) -> bool:
    return _PROFD_FRAME.search(name) is not None


@dataclass(frozen=True)
class OpStat:
    name: str
    calls: int
    self_us: float
    total_us: float


@dataclass(frozen=True)
class CpuTables:
    operators: Sequence[OpStat]
    call_sites: Sequence[OpStat]  # Python frames (with_stack), profd's left out


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


class _Names:
    """What the sweep needs to know of each name id."""

    def __init__(self, ops: CpuOps) -> None:
        self.kind = [
            _FRAME if c == FRAME_CAT else _ANNOTATION if c == ANNOTATION_CAT else _OP
            for c in ops.cats
        ]
        self.step = [n.startswith(STEP_PREFIX) for n in ops.names]
        for n, is_step in enumerate(self.step):
            if is_step:  # a step span overlaps the frames that open and close it
                self.kind[n] = _ANNOTATION
        self.profd = [
            k == _FRAME and is_profd_frame(n) for k, n in zip(self.kind, ops.names, strict=True)
        ]


class _Sweep:
    """One thread's nesting: each call's direct children's time, and what is profd's.

    Two stacks, because with ``--with-stack`` the events do not all nest: an annotation
    (``record_function``, a ``ProfilerStep``) opens inside a frame's call and outlives it.
    Operators and annotations nest among themselves, frames and operators among themselves;
    an operator's children are the operators and annotations inside it, a frame's the frames
    and operators inside it.
    """

    def __init__(
        self, thread: _Thread, names: _Names, union: Sequence[bool], frames: bool = True
    ) -> None:
        """``union``: the names whose self-time segments to keep (in :attr:`segments`);
        ``frames``: whether the thread has Python frames (else one stack does)."""
        n = len(thread.ts)
        self.children = array("d", bytes(8 * n))
        self.skip = bytearray(n)  # profd's: inside one of its frames
        #: name id -> self-time segments (start, end) of the ``union`` names' calls
        self.segments: dict[int, list[tuple[float, float]]] = {}
        #: A thread where profd runs and nothing else (its frames aside): profd's agent.
        self.profd_thread = False
        self._sweep(thread, names, union, frames)

    def _sweep(self, thread: _Thread, names: _Names, union: Sequence[bool], frames: bool) -> None:
        ts, dur, nid = thread.ts, thread.dur, thread.name
        kind, profd = names.kind, names.profd
        children, skip = self.children, self.skip
        cursor: dict[int, float] = {}  # a ``union`` call open -> where its self time resumes
        ops: list[tuple[float, int]] = []  # (end, index)
        stack: list[tuple[float, int]] = []  # the frames and cpu_ops
        profd_end = -float("inf")
        skipped, enclosing = 0, -1
        for i in thread.order():
            start, d = ts[i], dur[i]
            n = nid[i]
            k = kind[n]
            # Compare starts against ends, not ends against ends: kineto rounds timestamps
            # to ns in floating point, so a child's end may overshoot its parent's by a hair.
            if k != _FRAME:
                while ops and ops[-1][0] <= start:
                    end, j = ops.pop()
                    if cursor and j in cursor:
                        self._close(nid[j], cursor.pop(j), end)
                if ops:
                    p = ops[-1][1]
                    children[p] += d
                    if cursor and p in cursor:
                        cursor[p] = self._hole(nid[p], cursor[p], start, start + d)
                ops.append((start + d, i))
                if not frames:  # no frame to nest in, none of profd's to be inside
                    if union[n]:
                        cursor[i] = start
                    continue
            if k != _ANNOTATION:
                while stack and stack[-1][0] <= start:
                    end, j = stack.pop()
                    if cursor and kind[nid[j]] == _FRAME and j in cursor:
                        self._close(nid[j], cursor.pop(j), end)
                if stack:
                    p = stack[-1][1]
                    if kind[nid[p]] == _FRAME:
                        children[p] += d
                        if cursor and p in cursor:
                            cursor[p] = self._hole(nid[p], cursor[p], start, start + d)
                stack.append((start + d, i))
            if start < profd_end and start + d <= profd_end + _EPS_US:
                skip[i] = 1
                skipped += 1
            elif profd[n]:
                if enclosing < 0:  # the frames it runs in: a thread's bootstrap, or user code
                    enclosing = sum(kind[nid[j]] == _FRAME for _, j in stack[:-1])
                profd_end = start + d
                skip[i] = 1
                skipped += 1
            elif union[n]:
                cursor[i] = start
        for open_calls in (ops, stack):
            for end, j in open_calls:
                if j in cursor:
                    self._close(nid[j], cursor.pop(j), end)
        self.profd_thread = enclosing >= 0 and skipped + enclosing == len(ts)

    def _hole(self, n: int, at: float, start: float, end: float) -> float:
        """A child from ``start`` to ``end`` of a ``union`` call whose self time resumed ``at``."""
        if start > at:
            self.segments.setdefault(n, []).append((at, start))
        return max(at, end)

    def _close(self, n: int, at: float, end: float) -> None:
        if end > at:
            self.segments.setdefault(n, []).append((at, end))


class CpuOps:
    """The complete events of the CPU categories (``EventGroups.cpu``), as compact columns."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}  # name as in the trace -> id
        self._norm_ids: dict[str, int] = {}  # name without addresses -> id
        self.names: list[str] = []  # by id: each distinct name (addresses stripped) once
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
            nid = self.ids[name] = self._name_id(name, cat)
        thread.ts.append(ts)
        thread.dur.append(dur)
        thread.name.append(nid)

    def _name_id(self, name: str, cat: str) -> int:
        """Once per distinct name in the trace: names that differ only by addresses share one."""
        norm = strip_addresses(name)
        nid = self._norm_ids.get(norm)
        if nid is None:
            nid = self._norm_ids[norm] = len(self.names)
            self.names.append(norm)
            self.cats.append(cat)
        return nid

    def stats(self) -> list[OpStat]:
        """The operators (see the module doc), by self time."""
        return list(self.tables().operators)

    def tables(self) -> CpuTables:
        """Operators and call sites with self time = time spent in no direct child.

        Nesting is resolved per (pid, tid) with one sort and a stack sweep, O(n log n), because
        a large trace holds hundreds of thousands of events. ProfilerStep annotations take part
        in the nesting (so they do not leak into the self time of anything) but are left out
        of the result, since they are whole steps, not operators.

        A name's calls on one thread do not overlap but by nesting, which the running end
        below merges. Calls on several threads may overlap: such a name's total is the union
        of its threads' intervals, and only when they do overlap (gloo's threads) are its
        threads swept again for the segments of its self time, so that a trace whose threads
        share names but take turns (the autograd thread) costs one sweep.
        """
        count = len(self.names)
        names = _Names(self)
        on, has_frames = self._presence(names)
        totals = _Totals(count, [len(keys) > 1 for keys in on], names.step)
        # name -> threads it is on, for the names on several
        on_several = {n: keys for n, keys in enumerate(on) if totals.shared[n]}
        none = [False] * count
        profd_threads: set[Hashable] = set()
        for key, thread in self.threads.items():
            sweep = _Sweep(thread, names, none, has_frames[key])
            if sweep.profd_thread:
                profd_threads.add(key)
                continue
            totals.add_thread(thread, sweep, on_several)
        overlap = totals.union_overlapping()
        redo = {key for n, keys in on_several.items() if overlap[n] for key in keys}
        segments: dict[int, list[tuple[float, float]]] = {}
        for key in self.threads:
            if key in redo and key not in profd_threads:
                again = _Sweep(self.threads[key], names, overlap, has_frames[key])
                for n, segs in again.segments.items():
                    segments.setdefault(n, []).extend(segs)
        for n, segs in segments.items():
            totals.self_us[n] = wall_us(segs)
        return totals.tables(self.names, names.kind)

    def _presence(self, names: _Names) -> tuple[list[list[Hashable]], dict[Hashable, bool]]:
        """Each name's threads (name id -> keys), and whether each thread has Python frames."""
        on: list[list[Hashable]] = [[] for _ in range(len(self.names))]
        has_frames: dict[Hashable, bool] = {}
        for key, thread in self.threads.items():
            present = set(thread.name)
            for n in present:
                on[n].append(key)
            has_frames[key] = any(names.kind[n] == _FRAME for n in present)
        return on, has_frames


class _Totals:
    """Calls, self and total time per name id, summed thread by thread (:meth:`add_thread`)."""

    __slots__ = ("_last_end", "_merged", "_step", "calls", "self_us", "shared", "total_us")

    def __init__(self, count: int, shared: list[bool], step: list[bool]) -> None:
        #: Whether a name is on several threads (its total is then a union of intervals).
        self.shared = shared
        self._step = step
        self.calls = [0] * count
        self.self_us = [0.0] * count
        self.total_us = [0.0] * count
        # A shared name's calls merged per thread: (starts, ends), each thread's in order.
        self._merged: dict[int, tuple[array[float], array[float]]] = {}
        self._last_end = [-float("inf")] * count

    def add_thread(self, thread: _Thread, sweep: _Sweep, on_several: Iterable[int]) -> None:
        # The hot loop of the tables (once per event): everything it touches is a local.
        ts, dur, nid = thread.ts, thread.dur, thread.name
        children, skip = sweep.children, sweep.skip
        step, shared, merged = self._step, self.shared, self._merged
        calls, self_us, total_us, last_end = self.calls, self.self_us, self.total_us, self._last_end
        for n in on_several:  # a shared name's running end starts again on each thread
            last_end[n] = -float("inf")
        # Summed in the same order as the sweep, so the floats come out the same however
        # the trace was read.
        for i in thread.order():
            if skip[i]:
                continue
            n = nid[i]
            if step[n]:
                continue
            start = ts[i]
            d = dur[i]
            calls[n] += 1
            c = children[i]
            if d > c:
                self_us[n] += d - c
            # A call inside another call of the same name (recursion) counts once.
            le = last_end[n]
            if start >= le:
                total_us[n] += d
                last_end[n] = end = start + d
                if shared[n]:
                    run = merged.get(n)
                    if run is None:
                        run = merged[n] = (array("d"), array("d"))
                    run[0].append(start)
                    run[1].append(end)
            else:
                end = start + d
                if end > le:
                    total_us[n] += end - le
                    last_end[n] = end
                    if shared[n]:
                        merged[n][1][-1] = end

    def union_overlapping(self) -> list[bool]:
        """Make the total of each shared name whose threads' calls overlap their union, and
        say which names those are (by id)."""
        overlap = [False] * len(self.calls)
        for n, (starts, ends) in self._merged.items():
            wall = _overlapping_union_us(starts, ends)
            if wall is not None:
                overlap[n] = True
                self.total_us[n] = wall
        return overlap

    def tables(self, names: Sequence[str], kind: Sequence[int]) -> CpuTables:
        ops: list[OpStat] = []
        sites: list[OpStat] = []
        for n, name in enumerate(names):
            if self.calls[n]:
                row = OpStat(name, self.calls[n], self.self_us[n], self.total_us[n])
                (sites if kind[n] == _FRAME else ops).append(row)
        return CpuTables(_sort(ops), _sort(sites))


def _overlapping_union_us(starts: array[float], ends: array[float]) -> float | None:
    """The time covered by the intervals, or None when no instant is covered twice (their
    durations' sum is the answer then: most names shared by threads never overlap)."""
    # Sorted apart, in C: no instant is covered twice iff each end (in order) comes no later
    # than the next start (in order); no Python step per interval on the common path.
    s, e = sorted(starts), sorted(ends)
    if all(map(operator.le, itertools.islice(e, len(e) - 1), itertools.islice(s, 1, None))):
        return None
    del s, e
    return wall_us(zip(starts, ends, strict=True))


#: The correlation id of an activity or launch that has none (or one that is no integer).
NO_CORRELATION = -1


def correlation(args: Any) -> int:
    """An event's ``args.correlation`` (what ties a GPU activity to the CUDA call that
    launched it), or :data:`NO_CORRELATION`."""
    c = args.get("correlation") if isinstance(args, dict) else None
    return (
        c if isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**63 else NO_CORRELATION
    )


class GpuOps:
    """Per-name GPU kernel/memcpy/memset totals (``EventGroups.gpu``), summed as they come,
    and each activity's interval and correlation id as compact columns (the rank statistics
    need the device's busy time per step, and which activities a collective launched: 28
    bytes an activity)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.dur_us: dict[str, float] = {}
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.ts = array("d")
        self.dur = array("d")
        self.name = array("I")
        self.corr = array("q")

    def add(
        self, name: str, dur: float, ts: float | None = None, corr: int = NO_CORRELATION
    ) -> None:
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
        self.corr.append(corr)

    def stats(self) -> list[OpStat]:
        """Device activities do not nest, so self time is total time; names that differ only
        by an address are one row."""
        calls: dict[str, int] = {}
        dur: dict[str, float] = {}
        for n, c in self.calls.items():
            norm = strip_addresses(n)
            calls[norm] = calls.get(norm, 0) + c
            dur[norm] = dur.get(norm, 0.0) + self.dur_us[n]
        return _sort([OpStat(n, c, dur[n], dur[n]) for n, c in calls.items()])


class Launches:
    """CUDA runtime and driver calls (``EventGroups.launches``) per thread: when each was
    made and its correlation id, so a GPU activity can be traced to the CPU range that
    launched it (16 bytes a call)."""

    def __init__(self) -> None:
        self.threads: dict[Hashable, tuple[array[float], array[int]]] = {}

    def add(self, pid: Any, tid: Any, ts: float, corr: int) -> None:
        if corr == NO_CORRELATION:
            return
        try:
            cols = self.threads.get((pid, tid))
        except TypeError:  # an unhashable pid or tid: no thread to match it with
            return
        if cols is None:
            cols = self.threads[(pid, tid)] = (array("d"), array("q"))
        cols[0].append(ts)
        cols[1].append(corr)

    def within(self, thread: Hashable, spans: Sequence[tuple[float, float]]) -> set[int]:
        """Correlation ids of the calls ``thread`` made inside any of ``spans``."""
        cols = self.threads.get(thread)
        if cols is None or not spans:
            return set()
        ordered = sorted(spans)
        starts = [lo for lo, _ in ordered]
        # The furthest end of the spans starting at or before each one: nested and
        # overlapping ranges (c10d::allreduce_ holding nccl:all_reduce) count once.
        reach: list[float] = []
        for _, hi in ordered:
            reach.append(max(hi, reach[-1]) if reach else hi)
        out: set[int] = set()
        for ts, corr in zip(*cols, strict=True):
            i = bisect_right(starts, ts) - 1
            if i >= 0 and ts <= reach[i]:
                out.add(corr)
        return out


def _sort(stats: list[OpStat]) -> list[OpStat]:
    stats.sort(key=lambda s: (-s.self_us, s.name))
    return stats
