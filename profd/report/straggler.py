"""Which rank the others wait for: the straggler rule of ``profctl report``.

In a synchronous job every rank leaves a collective when the last one has arrived, so the
last to arrive waits least in it. The rule compares, **step by step**, each rank's wait (the
time it had a collective in flight, compute not subtracted: see
:mod:`profd.pipeline.rankstats`) with **its peers'**: the median of the *other* ranks at that
step (a leave-one-out median; with the median of all ranks the gap halves at two ranks).
Per-rank means carry little where DDP runs its all-reduces beside the backward pass; the
per-step order of arrival does.

Per rank and step, its **lead** is how much less it waits than its peers. A rank is named when

* its lead, averaged with the highest and lowest tenth of the steps dropped (one stalled step
  neither makes nor hides a straggler), is above ``REL_FLOOR`` of the median step, it is later
  than its peers on most steps and works more than they do;
* and the steps decide, by either of two tests at ``ALPHA`` / 2 each, spread over the ranks:
  the lead is above a noise floor (the step-to-step spread of one rank's lead over the square
  root of the steps averaged, times a normal quantile), or it arrived last at a count of the
  steps that chance, 1 in the rank count a step, reaches below that level (a sign test,
  robust to the heavy tails of a loaded machine);
* at most half the ranks can be stragglers: beyond that, they are the job.

When the data cannot decide, because the noise floor is above half of what is worth a name
and a rank leads by that much, the verdict leans to it and says about how many steps would
decide (:func:`steps_needed`) instead of "no straggler". Figures in docs/reports.md.

Pure functions on plain numbers: the report, its tests, its benchmark and anything watching a
live job call :func:`find_stragglers` directly. It costs a sort of the ranks per step and one
of all the leads: about a second at 8,192 ranks and 128 steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist, median

from profd.watch.stats import others_medians

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

    collective: Sequence[float]  # time with a collective in flight: what it waited for others
    work: Sequence[float]  # step time outside collectives: compute and idle


@dataclass(frozen=True)
class Verdict:
    stragglers: tuple[int, ...]  # indices into the ranks given, largest lead first
    lead_ms: tuple[float, ...]  # per straggler: its lead over its peers (trimmed mean per step)
    threshold_ms: float  # the lead a straggler had to exceed
    noise_ms: float  # the step-to-step spread of one rank's lead (a standard deviation)
    reason: str  # why there is none, or empty
    last: tuple[int, ...] = ()  # per straggler: the steps it arrived last at (waited least)
    steps: int = 0  # the common steps the rule had
    #: When the steps cannot decide: the rank the evidence leans to and about how many steps
    #: would decide at the lead it showed (0 otherwise).
    candidate: int | None = None
    need_steps: int = 0


def leave_one_out_medians(values: Sequence[float]) -> list[float]:
    """For each of two or more values, the median of all the others (the detectors' own
    leave-one-out, so a report and a live incident compare a rank with the same peers)."""
    out = [m for m in others_medians(values) if m is not None]
    if len(out) != len(values):
        raise ValueError("leave-one-out medians need two values or more")
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
    """How many standard errors a lead must exceed: half of ALPHA (the other half is the
    arrival count's) spread over the ranks."""
    return -NormalDist().inv_cdf(ALPHA / 2 / max(n_ranks, 1))


def noise_floor(noise: float, n_ranks: int, n_steps: int) -> float:
    """The lead that ``n_steps`` steps of this noise tell from none."""
    m = n_steps - 2 * trim_count(n_steps)
    return noise_k(n_ranks) * noise / math.sqrt(m) if m > 0 else math.inf


def tail(n: int, k: int, p: float) -> float:
    """P(at least ``k`` successes in ``n`` trials of chance ``p``)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    # Summed from k up in logs: at 8,192 ranks p is tiny and the terms underflow otherwise.
    lp, lq = math.log(p), math.log1p(-p)
    total = 0.0
    for j in range(k, n + 1):
        term = math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1)
        total += math.exp(term + j * lp + (n - j) * lq)
    return min(total, 1.0)


def arrivals_decide(n_ranks: int, n_steps: int, last: int) -> bool:
    """Whether arriving last at ``last`` of ``n_steps`` steps is beyond chance (1 in
    ``n_ranks`` a step when no rank is slower) for any of the ranks, at half of ALPHA."""
    return n_ranks * tail(n_steps, last, 1 / n_ranks) <= ALPHA / 2


#: The most steps "not enough steps to tell" ever asks for.
MAX_NEED = 100_000


def steps_needed(n_ranks: int, n_steps: int, lead: float, noise: float, last: int) -> int:
    """About how many steps would decide, were the rank to keep the lead and the share of
    last arrivals it showed over ``n_steps``: the fewer of what each test needs."""
    need = MAX_NEED
    if lead > 0:
        m = (noise_k(n_ranks) * noise / lead) ** 2  # steps averaged, after the trim
        need = next((n for n in range(n_steps + 1, MAX_NEED) if n - 2 * trim_count(n) >= m), need)
    share = last / n_steps
    if share > 1 / n_ranks:
        lo, hi = n_steps, min(need, MAX_NEED)
        if arrivals_decide(n_ranks, hi, math.ceil(share * hi)):
            while hi - lo > 1:  # the tail falls as the steps grow at a fixed share
                mid = (lo + hi) // 2
                lo, hi = (
                    (lo, mid)
                    if arrivals_decide(n_ranks, mid, math.ceil(share * mid))
                    else (mid, hi)
                )
            need = min(need, hi)
    return need


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
    last = [0] * n
    for k in range(n_steps):
        coll = [r.collective[k] for r in ranks]
        work = [r.work[k] for r in ranks]
        for i, (peers_c, peers_w) in enumerate(
            zip(leave_one_out_medians(coll), leave_one_out_medians(work), strict=True)
        ):
            leads[i].append(peers_c - coll[i])
            extra[i].append(work[i] - peers_w)
        least = min(coll)
        if coll.count(least) == 1:  # a tie says nothing about who arrived last
            last[coll.index(least)] += 1
    noise = step_noise(leads)
    cut = trim_count(n_steps)
    floor = noise_floor(noise, n, n_steps)
    worth = max(REL_FLOOR * step_ms, ABS_FLOOR_MS)
    threshold = max(floor, worth)
    found: list[tuple[float, int]] = []
    open_: list[tuple[float, int]] = []  # worth a name, but the steps do not decide
    for i in range(n):
        lead = _trimmed_mean(leads[i], cut)
        # Later than its peers on most steps, and working more: what a straggler does
        # whatever the noise; one stalled step can do neither.
        later = 2 * sum(a > 0 for a in leads[i]) - n_steps
        if _trimmed_mean(extra[i], cut) <= 0 or later < 0:
            continue
        arrivals = arrivals_decide(n, n_steps, last[i]) and last[i] > n_steps / 2
        if lead > worth and later > 0 and (lead > floor or arrivals):
            found.append((lead, i))
        elif lead > worth / 2 and floor > worth / 2:
            # Half the lead worth a name, where the noise hides as much: more steps could
            # show either. Steadier steps (a floor below that) have shown there is none.
            open_.append((lead, i))
    if len(found) * 2 > n:
        return Verdict(
            (),
            (),
            threshold,
            noise,
            "most ranks wait less than their peers: no single straggler",
            steps=n_steps,
        )
    found.sort(key=lambda f: (-f[0], f[1]))
    if found:
        return Verdict(
            tuple(i for _, i in found),
            tuple(round(w, 3) for w, _ in found),
            threshold,
            noise,
            "",
            tuple(last[i] for _, i in found),
            n_steps,
        )
    if open_:
        lead, i = max(open_, key=lambda f: (f[0], -f[1]))
        need = steps_needed(n, n_steps, lead, noise, last[i])
        why = (
            f"not enough steps to tell (need about {need}, have {n_steps}): the rank that waits"
            f" least arrived last at {last[i]} of {n_steps} steps and waits {lead:.2f} ms per"
            f" step less than its peers, against a spread of {noise:.2f} ms a step"
        )
        return Verdict((), (), threshold, noise, why, (), n_steps, i, need)
    why = f"no rank waits {worth:.2f} ms per step less than its peers on most steps"
    return Verdict((), (), threshold, noise, why, (), n_steps)
