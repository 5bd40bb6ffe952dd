"""The steps of a kineto trace and the step times the pipeline reports from them.

One parser for ``ProfilerStep#N`` spans, shared by the text summary (step times), the memory
report (step windows) and :class:`~profd.pipeline.process.ProcessedTrace`, so all of them read
steps the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from profd_client import protocol as P

STEP_PREFIX = "ProfilerStep#"
#: Times and durations in a trace are µs; the protocol bounds them in seconds. Everything the
#: pipeline derives from an event's time (step lengths, sums, starts) stays finite with them.
MAX_US = P.MAX_SECONDS * 1e6


@dataclass(frozen=True)
class StepSpan:
    step: int
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class StepStats:
    durations_ms: tuple[tuple[int, float], ...]  # (step, ms), sorted by step
    p50_ms: float | None
    p90_ms: float | None
    max_ms: float | None

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(step for step, _ in self.durations_ms)


def parse_step(name: str) -> int | None:
    """The step a ``ProfilerStep#N`` name marks; None when N is no step the protocol can carry.

    A trace is the client's file: a step of 30 digits would be stored, and then every reply
    that holds it would fail to encode (msgpack has no integers beyond 64 bits).
    """
    try:
        step = int(name[len(STEP_PREFIX) :])
    except ValueError:
        return None
    return step if P.STEP.lo <= step <= P.STEP.hi else None


def no_step_note(count: int) -> str:
    """What a capture's result says about ``ProfilerStep#`` markers that were no step."""
    return (
        f"{count} ProfilerStep# marker(s) ignored: no step number in"
        f" {P.STEP.lo}..{P.STEP.hi} after the '#'"
    )


def step_spans(steps: Iterable[tuple[str, float, float]]) -> list[StepSpan]:
    """Every ``ProfilerStep#N`` span torch.profiler emitted, in time order.

    ``steps`` are the complete events named ``ProfilerStep#...`` as (name, start, duration)
    (``EventGroups.steps``); a name with no step number after the prefix is no step.
    """
    out = []
    for name, ts, dur in steps:
        step = parse_step(name)
        if step is not None:
            out.append(StepSpan(step, ts, dur))
    return sorted(out, key=lambda s: s.start_us)


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default), defined for n == 1 too,
    # unlike statistics.quantiles.
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def step_stats(spans: Iterable[StepSpan]) -> StepStats:
    by_step: dict[int, float] = {}
    for span in spans:
        # A step number appears once per profiled process; should a merged trace repeat one,
        # the longest occurrence is the one that bounded the step.
        by_step[span.step] = max(by_step.get(span.step, 0.0), span.dur_us / 1000.0)
    if not by_step:
        return StepStats((), None, None, None)
    ordered = tuple(sorted(by_step.items()))
    values = sorted(by_step.values())
    return StepStats(ordered, _percentile(values, 0.5), _percentile(values, 0.9), values[-1])
