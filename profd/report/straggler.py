"""Which rank the others wait for: the straggler rule of ``profctl report``.

In a synchronous job every rank leaves a collective when the last one has arrived, so the
last to arrive waits least in it and has spent the time before it working. A straggler is a
rank that, on the same steps, has **less collective time and more time outside collectives**
than the median rank, by a margin that noise does not reach:

* per step, each rank's collective time is compared with the median rank's at that step
  (so a step that is slow for everyone moves nobody);
* the margin must exceed ``NOISE_K`` times the noise and ``REL_FLOOR`` of the median step (a
  rank a few per cent ahead is no straggler worth a name). The noise is how far ranks spread
  around the median rank at one step (a median absolute deviation, which up to half the ranks
  being stragglers do not inflate); two ranks have no such spread, and there it is how much a
  rank's collective time varies from step to step;
* it must hold on at least ``MIN_SHARE`` of the common steps, and on at least ``MIN_STEPS``;
* at most half the ranks can be stragglers: beyond that, they are the job.

Pure functions on plain numbers: the report, its tests and its benchmark call them directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

NOISE_K = 3.0
REL_FLOOR = 0.05
ABS_FLOOR_MS = 0.05
MIN_SHARE = 0.75
MIN_STEPS = 2
#: Scales a median absolute deviation to a standard deviation for normal noise.
MAD_SIGMA = 1.4826


@dataclass(frozen=True)
class RankSteps:
    """One rank's times on the common steps, in ms (index k: the k-th common step)."""

    collective: Sequence[float]
    work: Sequence[float]  # step time outside collectives: compute and idle


@dataclass(frozen=True)
class Verdict:
    stragglers: tuple[int, ...]  # indices into the ranks given, least collective time first
    wait_ms: tuple[float, ...]  # per straggler: median per step, the median rank's extra wait
    threshold_ms: float  # the margin a straggler had to exceed
    noise_ms: float
    reason: str  # why there is none, or empty


def _mad(values: Sequence[float]) -> float:
    m = median(values)
    return median(abs(v - m) for v in values)


def find_stragglers(ranks: Sequence[RankSteps], step_ms: float) -> Verdict:
    """Apply the rule to ranks' times on the same steps; ``step_ms``: the median step."""
    n_steps = min((len(r.collective) for r in ranks), default=0)
    if len(ranks) < 2:
        return Verdict((), (), 0.0, 0.0, "a single rank: nobody waits for anybody")
    if n_steps < MIN_STEPS:
        return Verdict((), (), 0.0, 0.0, f"fewer than {MIN_STEPS} steps common to every rank")
    steps = range(n_steps)
    med_c = [median(r.collective[k] for r in ranks) for k in steps]
    med_w = [median(r.work[k] for r in ranks) for k in steps]
    if len(ranks) > 2:
        noise = MAD_SIGMA * median(_mad([r.collective[k] for r in ranks]) for k in steps)
    else:
        noise = MAD_SIGMA * median(_mad(r.collective[:n_steps]) for r in ranks)
    threshold = max(NOISE_K * noise, REL_FLOOR * step_ms, ABS_FLOOR_MS)
    found: list[tuple[float, int]] = []
    for i, r in enumerate(ranks):
        ahead = [med_c[k] - r.collective[k] for k in steps]
        more = [r.work[k] - med_w[k] for k in steps]
        if median(ahead) <= threshold or median(more) <= 0:
            continue
        held = sum(a > threshold / 2 and m > 0 for a, m in zip(ahead, more, strict=True))
        if held >= MIN_SHARE * n_steps:
            found.append((median(ahead), i))
    if len(found) * 2 > len(ranks):
        return Verdict(
            (), (), threshold, noise, "most ranks wait less than the median: no single straggler"
        )
    found.sort(key=lambda f: (-f[0], f[1]))
    if not found:
        why = f"no rank waits {threshold:.2f} ms less than the median rank on most steps"
        return Verdict((), (), threshold, noise, why)
    return Verdict(
        tuple(i for _, i in found), tuple(round(w, 3) for w, _ in found), threshold, noise, ""
    )
