"""A kineto trace as the pipeline's outputs read it: read once, its events sorted once.

Every output (see :mod:`.outputs`) is handed the same :class:`ParsedTrace`. A large trace
holds millions of events, more than fit in a worker's memory as dicts, so the trace is read
one event at a time (see :mod:`.stream`) and each event goes, as it is read, into the compact
collectors of the analyses that need it (:class:`EventGroups`); each analysis then runs on its
collector the first time an output asks for it and is kept for the next. An output that needs
another kind of event adds a collector to :class:`EventGroups` rather than a pass of its own,
and keeps in it only the fields it needs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from profd.pipeline.memory import MEMORY_EVENT, MemoryEvents, MemorySeries
from profd.pipeline.ops import (
    CPU_OP_CATS,
    GPU_OP_CATS,
    LAUNCH_CATS,
    CpuOps,
    CpuTables,
    GpuOps,
    Launches,
    OpStat,
    correlation,
)
from profd.pipeline.spans import (
    MAX_US,
    STEP_PREFIX,
    StepSpan,
    StepStats,
    parse_step,
    step_spans,
    step_stats,
)


class EventGroups:
    """What each analysis keeps of the events, fed in trace order (its tie-breaks rely on it).

    ``add`` is the one place that decides what an event is; the analyses trust their group.
    It never raises on a malformed event: that would cost the whole trace, where a malformed
    event should cost at most the analysis that cannot read it.
    """

    def __init__(self) -> None:
        # complete ProfilerStep#N events, whatever their category: (name, start, duration)
        self.steps: list[tuple[str, float, float]] = []
        self.cpu = CpuOps()  # complete CPU_OP_CATS events, ProfilerSteps included for nesting
        self.gpu = GpuOps()  # complete GPU_OP_CATS events
        self.launches = Launches()  # complete LAUNCH_CATS events: thread, time, correlation
        self.memory = MemoryEvents()  # [memory] events
        # (pid, tid) -> ProfilerStep spans on it: which thread is the training thread, found
        # without a scan of every thread's events.
        self.step_threads: dict[Hashable, int] = {}
        #: ``ProfilerStep#`` spans whose number is no step (see :func:`.spans.parse_step`).
        self.no_steps = 0

    def add(self, ev: Any) -> None:
        if not isinstance(ev, dict):
            return
        get = ev.get
        name = get("name")
        if name == MEMORY_EVENT:
            self.memory.add(get("args"), get("ts"))
        # Only well-formed "X" events are timed intervals.
        if get("ph") != "X":
            return
        ts, dur = get("ts"), get("dur")
        if not (isinstance(ts, int | float) and isinstance(dur, int | float)):
            return
        try:
            ts, dur = float(ts), float(dur)
        except OverflowError:  # an integer beyond any float: no time at all
            return
        # Beyond the protocol's bounds (or NaN): no interval anything derived could store.
        if not (-MAX_US <= ts <= MAX_US and 0.0 <= dur <= MAX_US):
            return
        cat = get("cat")
        # The isinstance keeps a malformed (unhashable) category from failing the whole trace.
        if isinstance(cat, str):
            if cat in CPU_OP_CATS:
                op = name if isinstance(name, str) else str(get("name", ""))
                self.cpu.add(get("pid"), get("tid"), op, ts, dur, cat)
            elif cat in GPU_OP_CATS:
                op = name if isinstance(name, str) else str(get("name", ""))
                self.gpu.add(op, dur, ts, correlation(get("args")))
            elif cat in LAUNCH_CATS:
                self.launches.add(get("pid"), get("tid"), ts, correlation(get("args")))
        if isinstance(name, str) and name.startswith(STEP_PREFIX):
            if parse_step(name) is None:
                self.no_steps += 1
                return
            self.steps.append((name, ts, dur))
            key = (get("pid"), get("tid"))
            try:
                self.step_threads[key] = self.step_threads.get(key, 0) + 1
            except TypeError:  # an unhashable pid or tid: no thread to name
                pass


def group_events(events: Iterable[Any]) -> EventGroups:
    groups = EventGroups()
    for ev in events:
        groups.add(ev)
    return groups


@dataclass(frozen=True)
class ParsedTrace:
    """One trace for every output; its analyses are typed read-only because they are shared."""

    stem: str  # the outputs' file names start with it: {stem}{suffix}
    header: Mapping[str, str]  # what the capture is (session, rank, ...), for output headers
    top_n: int  # how many operators a ranking lists
    groups: EventGroups

    @classmethod
    def from_events(
        cls, events: Iterable[Any], stem: str, header: Mapping[str, str], top_n: int
    ) -> ParsedTrace:
        return cls(stem, header, top_n, group_events(events))

    @cached_property
    def spans(self) -> Sequence[StepSpan]:
        return step_spans(self.groups.steps)

    @cached_property
    def steps(self) -> StepStats:
        return step_stats(self.spans)

    @cached_property
    def cpu_tables(self) -> CpuTables:
        return self.groups.cpu.tables()

    @property
    def cpu_ops(self) -> Sequence[OpStat]:
        """CPU operators (no Python frames, nothing of profd's; see :mod:`.ops`)."""
        return self.cpu_tables.operators

    @property
    def call_sites(self) -> Sequence[OpStat]:
        """Python frames (``--with-stack``), profd's left out."""
        return self.cpu_tables.call_sites

    @cached_property
    def gpu_ops(self) -> Sequence[OpStat]:
        return self.groups.gpu.stats()

    @cached_property
    def memory(self) -> Mapping[str, MemorySeries]:
        return self.groups.memory.series()
