"""The spike rule (docs/design.md "Watch", "Black box"): one step far beyond its rank's
median. Pure: fed once a tick, it keeps nothing between ticks.

A spike is over by the time anyone could capture it (a data-loader stall, a garbage-collection
pause, a checkpoint write that blocked a step), so the rule needs no hold: one step is the
whole event, and its evidence is the black box, not a capture. Two guards keep steady jobs
quiet: the step must be ``spike`` times its rank's median (5x by default: jitter of ±10 % gives
at most 1.22x) *and* at least :data:`MIN_EXCESS_MS` longer, so a 1 ms job's 6 ms step is no
incident; and the median must rest on :data:`MIN_STEPS` steps at least, so a rank's first,
untypical steps are no baseline.

In a lockstep job (DDP) one rank's stall makes every rank's step long: the others wait for it
in a collective. The rule reports every rank whose step spiked in the tick, in one incident
per job; which of them sat outside a collective is the black box's to tell.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from profd.watch.slowdown_rules import MIN_STEPS

#: A spike is at least this much longer than its rank's median, whatever the ratio.
MIN_EXCESS_MS = 1000.0

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class RankTick:
    """One rank in one tick: its longest step that ended in the tick (ms), its median step
    over the window (ms), and the steps that median rests on."""

    top_ms: float
    median_ms: float
    median_steps: int


@dataclass(frozen=True)
class Spike(Generic[K]):
    """The ranks whose step spiked in one tick, each with its step and median (ms)."""

    ranks: dict[K, tuple[float, float]]
    threshold: float

    @property
    def excess_ms(self) -> float:
        """The longest spike's time beyond its rank's median."""
        return max(top - med for top, med in self.ranks.values())

    @property
    def ratio(self) -> float:
        return max(top / med for top, med in self.ranks.values())


def is_candidate(top_ms: float, reference_ms: float | None) -> bool:
    """Whether ``top_ms`` may be a spike at all, against any reference at or above the
    rank's median (the detectors pass the window's upper quantile they already read, so most
    ranks never cost a median): one comparison, false for every steady step."""
    return reference_ms is not None and top_ms - reference_ms >= MIN_EXCESS_MS


def spikes(ranks: Mapping[K, RankTick], threshold: float) -> Spike[K] | None:
    """The ranks of one job whose longest step this tick is ``threshold`` times their median
    and :data:`MIN_EXCESS_MS` beyond it; None when there are none."""
    found: dict[K, tuple[float, float]] = {}
    for key, r in ranks.items():
        if r.median_steps < MIN_STEPS or r.median_ms <= 0:
            continue
        if r.top_ms >= threshold * r.median_ms and r.top_ms - r.median_ms >= MIN_EXCESS_MS:
            found[key] = (r.top_ms, r.median_ms)
    return Spike(found, threshold) if found else None
