"""The timed intervals of a kineto trace that the pipeline's reports are built on.

One parser for ``ProfilerStep#N`` spans, shared by the text summary (step times) and the
memory report (step windows), so both read steps the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

STEP_PREFIX = "ProfilerStep#"


@dataclass(frozen=True)
class StepSpan:
    step: int
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def complete_events(events: Iterable[Any]) -> Iterator[Mapping[str, Any]]:
    """Well-formed ``ph == "X"`` events; anything else in a trace is not a timed interval."""
    for ev in events:
        if (
            isinstance(ev, dict)
            and ev.get("ph") == "X"
            and isinstance(ev.get("ts"), int | float)
            and isinstance(ev.get("dur"), int | float)
        ):
            yield ev


def step_spans(events: Iterable[Any]) -> list[StepSpan]:
    """Every ``ProfilerStep#N`` span torch.profiler emitted, in time order."""
    out = []
    for ev in complete_events(events):
        name = ev.get("name")
        if not isinstance(name, str) or not name.startswith(STEP_PREFIX):
            continue
        try:
            step = int(name[len(STEP_PREFIX) :])
        except ValueError:
            continue
        out.append(StepSpan(step, float(ev["ts"]), float(ev["dur"])))
    return sorted(out, key=lambda s: s.start_us)
