"""Which rank the others wait for: the straggler rule of ``profctl report``.

In a synchronous job every rank leaves a collective when the last one has arrived, so the
last to arrive waits least in it and has spent the time before it working. A straggler is a
rank that, on the same steps, has **less collective time and more time outside collectives
than its peers**, by a margin that noise does not reach.

**Its peers are the other ranks, without it**: at each step a rank is compared with the
median of the *other* ranks (a leave-one-out median). Comparing it with the median of all
ranks, itself included, halves the gap at two ranks (the median sits between the two) and
shrinks it at any small count, so a rank 40 % slower than the other went unnamed. The
alternative, the least-waiting rank against the rest, finds only one straggler per step and
says nothing about the second of two slow ranks; the leave-one-out median is that comparison
for the least-waiting rank, and the same one for every other rank: at two ranks each is
compared with the other, at thousands it is the median rank.

Per rank and step, its **lead** is how much less it waits in collectives than its peers' median
at that step (a step slow for everyone moves nobody). Over the common steps:

* its lead is summarised by a trimmed mean (the highest and lowest tenth of the steps
  dropped, at least one each way from five steps on): a mean separates a 25 % straggler from
  ±10 % jitter in fewer steps than a median does, and the trim keeps one stalled step (a
  pause, a page fault storm) from making or hiding a straggler;
* the threshold is the larger of ``REL_FLOOR`` of the median step (a rank a few per cent
  behind is no straggler worth a name, and per-step jitter of ±10 % moves ranks that much) and
  a noise floor from the step-to-step spread: how far each rank's lead moves around its own
  median from one step to the next (pooled over the ranks, the largest tenth dropped so that a
  stalled step is no noise, scaled back to a normal's standard deviation), divided by the
  square root of the steps averaged, times the normal quantile that keeps the chance of
  naming anybody in a job without a straggler near ``ALPHA`` whatever the rank count (3.3 at
  2 ranks, 5.2 at 8,192);
* its time outside collectives must be above its peers' too, and both must hold (lead above
  half the threshold, more work) on at least ``MIN_SHARE`` of the common steps, and on at
  least ``MIN_STEPS``;
* at most half the ranks can be stragglers: beyond that, they are the job.

Measured on synthetic jobs (``tests/test_straggler.py``): a rank 25 % slower than its peers is
named at 2 to 8,192 ranks from 10 steps on, and even jobs with ±10 % jitter name nobody (the
figures are in docs/reports.md).

Pure functions on plain numbers: the report, its tests, its benchmark and anything watching a
live job call :func:`find_stragglers` directly. It costs a sort of the ranks per step and one
of all the leads: about a second at 8,192 ranks and 128 steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist, median

#: The chance, under normal noise, that a job without a straggler gets one named.
ALPHA = 1e-3
REL_FLOOR = 0.10
ABS_FLOOR_MS = 0.05
MIN_SHARE = 0.75
MIN_STEPS = 2
#: Scales a median absolute deviation to a standard deviation for normal noise.
MAD_SIGMA = 1.4826  # the operator table's outlier cut (model.py)
#: The share of squared residuals kept by :func:`step_noise`, and the variance a normal
#: keeps when its largest tenth of squares is dropped (1 - 2 z phi(z) / 0.9 at z = 1.645).
KEEP = 0.9
TRUNCATED_VAR = 0.6232


@dataclass(frozen=True)
class RankSteps:
    """One rank's times on the common steps, in ms (index k: the k-th common step)."""

    collective: Sequence[float]
    work: Sequence[float]  # step time outside collectives: compute and idle


@dataclass(frozen=True)
class Verdict:
    stragglers: tuple[int, ...]  # indices into the ranks given, largest lead first
    lead_ms: tuple[float, ...]  # per straggler: its lead over its peers (trimmed mean per step)
    threshold_ms: float  # the lead a straggler had to exceed
    noise_ms: float  # the step-to-step spread of one rank's lead (a standard deviation)
    reason: str  # why there is none, or empty


def leave_one_out_medians(values: Sequence[float]) -> list[float]:
    """For each value, the median of all the others (one sort for all of them)."""
    n = len(values)
    order = sorted(range(n), key=values.__getitem__)
    s = [values[i] for i in order]
    m = n - 1  # how many remain once one is left out
    h = m // 2
    out = [0.0] * n
    for p, i in enumerate(order):
        # Without s[p], the j-th remaining value is s[j] below p and s[j + 1] from p on.
        hi = s[h] if h < p else s[h + 1]
        if m % 2:
            out[i] = hi
        else:
            out[i] = ((s[h - 1] if h - 1 < p else s[h]) + hi) / 2
    return out


def trim_count(n_steps: int) -> int:
    """Steps dropped at each end before averaging a rank's leads."""
    return max(1, n_steps // 10) if n_steps >= 5 else 0


def _trimmed_mean(values: Sequence[float], cut: int) -> float:
    kept = sorted(values)[cut : len(values) - cut]
    return sum(kept) / len(kept)


def step_noise(leads: Sequence[Sequence[float]]) -> float:
    """The step-to-step spread of one rank's lead, as a standard deviation: each rank's leads
    around their own median (a stalled step moves no other), pooled over the ranks, the
    largest tenth dropped (a stalled step is no noise of the job) and scaled back to a
    normal's; with two ranks one series (the other is its mirror)."""
    series = leads[:1] if len(leads) == 2 else leads
    squares: list[float] = []
    dof = 0
    for xs in series:
        mid = median(xs)
        squares.extend((x - mid) ** 2 for x in xs)
        dof += len(xs) - 1
    squares.sort()
    kept = squares[: max(1, math.ceil(KEEP * len(squares)))]
    return math.sqrt(sum(kept) / max(dof * len(kept) / len(squares), 1e-9) / TRUNCATED_VAR)


def noise_k(n_ranks: int) -> float:
    """How many standard errors a lead must exceed: ALPHA spread over the ranks."""
    return -NormalDist().inv_cdf(ALPHA / max(n_ranks, 1))


def find_stragglers(ranks: Sequence[RankSteps], step_ms: float) -> Verdict:
    """Apply the rule to ranks' times on the same steps; ``step_ms``: the median step."""
    n = len(ranks)
    n_steps = min((len(r.collective) for r in ranks), default=0)
    if n < 2:
        return Verdict((), (), 0.0, 0.0, "a single rank: nobody waits for anybody")
    if n_steps < MIN_STEPS:
        return Verdict((), (), 0.0, 0.0, f"fewer than {MIN_STEPS} steps common to every rank")
    leads: list[list[float]] = [[] for _ in range(n)]
    extra: list[list[float]] = [[] for _ in range(n)]
    for k in range(n_steps):
        coll = [r.collective[k] for r in ranks]
        work = [r.work[k] for r in ranks]
        for i, (peers_c, peers_w) in enumerate(
            zip(leave_one_out_medians(coll), leave_one_out_medians(work), strict=True)
        ):
            leads[i].append(peers_c - coll[i])
            extra[i].append(work[i] - peers_w)
    noise = step_noise(leads)
    cut = trim_count(n_steps)
    noise_floor = noise_k(n) * noise / math.sqrt(n_steps - 2 * cut)
    threshold = max(noise_floor, REL_FLOOR * step_ms, ABS_FLOOR_MS)
    found: list[tuple[float, int]] = []
    for i in range(n):
        lead = _trimmed_mean(leads[i], cut)
        if lead <= threshold or _trimmed_mean(extra[i], cut) <= 0:
            continue
        held = sum(a > threshold / 2 and e > 0 for a, e in zip(leads[i], extra[i], strict=True))
        if held >= MIN_SHARE * n_steps:
            found.append((lead, i))
    if len(found) * 2 > n:
        return Verdict(
            (), (), threshold, noise, "most ranks wait less than their peers: no single straggler"
        )
    found.sort(key=lambda f: (-f[0], f[1]))
    if not found:
        why = f"no rank waits {threshold:.2f} ms per step less than its peers on most steps"
        return Verdict((), (), threshold, noise, why)
    return Verdict(
        tuple(i for _, i in found), tuple(round(w, 3) for w, _ in found), threshold, noise, ""
    )
