"""A kineto trace as the pipeline's outputs read it: loaded once, its events sorted once.

Every output (see :mod:`.outputs`) is handed the same :class:`ParsedTrace`. A large trace
holds hundreds of thousands of events, so they are sorted into the groups the analyses read
in one pass when the trace is opened, and each analysis runs on its group the first time an
output asks for it and is kept for the next. An output that needs another kind of event adds
a group to :func:`group_events` rather than a pass of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .memory import MEMORY_EVENT, Sample, memory_series
from .ops import CPU_OP_CATS, GPU_OP_CATS, OpStat, cpu_op_stats, gpu_op_stats
from .spans import STEP_PREFIX, StepSpan, StepStats, step_spans, step_stats

Event = Mapping[str, Any]


@dataclass(frozen=True)
class EventGroups:
    """The events each analysis reads, in trace order (the analyses' tie-breaks rely on it)."""

    steps: Sequence[Event]  # complete ProfilerStep#N events, whatever their category
    cpu: Sequence[Event]  # complete CPU_OP_CATS events, ProfilerSteps included for nesting
    gpu: Sequence[Event]  # complete GPU_OP_CATS events
    memory: Sequence[Event]  # [memory] events


def group_events(events: Iterable[Any]) -> EventGroups:
    """The one place that decides what an event is; the analyses trust their group."""
    steps: list[Event] = []
    cpu: list[Event] = []
    gpu: list[Event] = []
    memory: list[Event] = []
    for ev in events:
        if not isinstance(ev, dict):
            continue
        name = ev.get("name")
        if name == MEMORY_EVENT:
            memory.append(ev)
        # Only well-formed "X" events are timed intervals.
        if not (
            ev.get("ph") == "X"
            and isinstance(ev.get("ts"), int | float)
            and isinstance(ev.get("dur"), int | float)
        ):
            continue
        cat = ev.get("cat")
        # The isinstance keeps a malformed (unhashable) category from failing the whole trace.
        if isinstance(cat, str):
            if cat in CPU_OP_CATS:
                cpu.append(ev)
            elif cat in GPU_OP_CATS:
                gpu.append(ev)
        if isinstance(name, str) and name.startswith(STEP_PREFIX):
            steps.append(ev)
    return EventGroups(steps, cpu, gpu, memory)


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
    def cpu_ops(self) -> Sequence[OpStat]:
        return cpu_op_stats(self.groups.cpu)

    @cached_property
    def gpu_ops(self) -> Sequence[OpStat]:
        return gpu_op_stats(self.groups.gpu)

    @cached_property
    def memory(self) -> Mapping[str, Sequence[Sample]]:
        return memory_series(self.groups.memory)
