"""The detectors' rules (profd.watch.slowdown_rules) on synthetic step times, 2 to 8,192 ranks.

Every false-alarm figure here is measured on steady jobs with ±10 % uniform step jitter (the
docs/design.md target: no incident over 10,000 steps), every detection on a change of exactly the
threshold, and the time to detect is checked against docs/design.md's 60 s at the defaults.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from statistics import median
from typing import NamedTuple

import pytest

from profd.watch.slowdown_rules import (
    MIN_STEPS,
    RegressionRule,
    SlowRankRule,
    WaitRule,
    WatchRules,
    relative_spread,
)


class W(NamedTuple):
    """A rank's window figures as the rules read them (in the daemon, its ``TickRank``)."""

    window_ms: float | None
    window_steps: int
    wait_ms: float | None = None
    wait_steps: int = 0


RULES = WatchRules()  # the defaults: window 60 s, baseline 600 s, hold 30 s, 20 %, 25 %


def ticks(step_s: float, jitter: float, rng: random.Random, slower_at: float = -1.0,
          factor: float = 1.0, pause: tuple[float, float] | None = None,
          ) -> Iterator[tuple[float, float, int]]:  # fmt: skip
    """One lockstep job's ticks (1 s): (tick end, median step ms in it, steps in it)."""
    t = 0.0
    tick_end = 1.0
    ended: list[float] = []
    while True:
        d = step_s * (1 + rng.uniform(-jitter, jitter))
        if 0 <= slower_at <= t:
            d *= factor
        if pause is not None and pause[0] <= t < pause[0] + pause[1]:
            d += pause[1]  # one step holds a checkpoint of this many seconds
            pause = None
        t += d
        while t >= tick_end:
            yield tick_end, (median(ended) * 1000.0 if ended else 0.0), len(ended)
            ended = []
            tick_end += 1.0
        ended.append(d)


def run_regression(rule: RegressionRule, stream: Iterator[tuple[float, float, int]],
                   steps: int) -> list[float]:  # fmt: skip
    """Feed ``steps`` steps; when the rule fired (tick times)."""
    fired, total = [], 0
    for now, ms, n in stream:
        total += n
        if rule.observe(now, ms, n) is not None:
            fired.append(now)
        if total >= steps:
            return fired
    return fired  # pragma: no cover - the stream is endless


@pytest.mark.parametrize("step_s", [0.01, 0.1, 1.0, 10.0])
def test_regression_never_fires_on_a_steady_jittery_job(step_s: float) -> None:
    rng = random.Random(int(step_s * 1000))
    fired = run_regression(RegressionRule(RULES), ticks(step_s, 0.1, rng), 10_000)
    assert fired == []


@pytest.mark.parametrize("step_s", [0.03, 0.3])
@pytest.mark.parametrize("factor", [1.2, 1.5])
def test_a_regression_of_the_threshold_or_more_fires_within_60s(
    step_s: float, factor: float
) -> None:
    rng = random.Random(7)
    change = 700.0  # after a full baseline and window
    rule = RegressionRule(RULES)
    fired = []
    for now, ms, n in ticks(step_s, 0.1, rng, slower_at=change, factor=factor):
        found = rule.observe(now, ms, n)
        if found is not None:
            fired.append((now, found))
            break
        if now > change + 300:
            break
    assert fired, "no regression found"
    now, found = fired[0]
    assert change < now <= change + 60.0, now - change
    assert found.ratio > 1.15 and found.threshold == pytest.approx(0.2)


def test_regression_ignores_pauses_young_jobs_and_restarts() -> None:
    rng = random.Random(3)
    # A checkpoint: one step of 120 s, then the job goes on as before.
    fired = run_regression(RegressionRule(RULES), ticks(0.05, 0.1, rng, pause=(800.0, 120.0)),
                           40_000)  # fmt: skip
    assert fired == []
    # Twice as slow after 100 s: no baseline of half its length yet, so nothing is judged.
    rule = RegressionRule(RULES)
    for now, ms, n in ticks(0.05, 0.1, rng, slower_at=100.0, factor=2.0):
        assert rule.observe(now, ms, n) is None
        if now >= RULES.window + RULES.baseline / 2 - 10:
            break
    # A restart (step(n) jump): the baseline starts again.
    rule.reset()
    assert rule.observe(1e6, 100.0, 50) is None


def test_the_noise_floor_follows_a_noisy_job() -> None:
    # A job whose steps scatter ±40 %: the 20 % threshold would fire on its noise alone.
    rng = random.Random(5)
    fired = run_regression(RegressionRule(RULES), ticks(1.0, 0.4, rng), 10_000)
    assert fired == []


def rank_medians(n_ranks: int, steps_in_window: int, jitter: float, rng: random.Random,
                 slow: dict[int, float]) -> dict[int, W]:  # fmt: skip
    """Each rank's median step over a window of ``steps_in_window`` steps (odd): the median
    of k = 2m+1 uniform draws is Beta(m+1, m+1), drawn directly."""
    m = steps_in_window // 2
    out = {}
    for r in range(n_ranks):
        u = rng.betavariate(m + 1, m + 1)
        out[r] = W(30.0 * slow.get(r, 1.0) * (1 + jitter * (2 * u - 1)), steps_in_window)
    return out


@pytest.mark.parametrize("n_ranks", [2, 3, 8, 64, 1024, 8192])
@pytest.mark.parametrize("steps_in_window", [9, 2001])
def test_slow_rank_never_fires_on_steady_ranks(n_ranks: int, steps_in_window: int) -> None:
    rng = random.Random(n_ranks)
    rule = SlowRankRule(RULES)
    evaluations = max(40, 20_000 // n_ranks)  # 10,000s of rank-windows for every size
    for k in range(evaluations):
        assert rule.observe(float(k), rank_medians(n_ranks, steps_in_window, 0.1, rng, {})) == []


@pytest.mark.parametrize("n_ranks", [2, 3, 8, 64, 1024, 8192])
def test_a_rank_25_percent_slower_is_named_after_the_hold(n_ranks: int) -> None:
    rng = random.Random(n_ranks + 1)
    rule = SlowRankRule(RULES)
    slow = n_ranks // 2
    named: list[int] = []
    first = None
    for k in range(60):
        found = rule.observe(float(k), rank_medians(n_ranks, 61, 0.1, rng, {slow: 1.25}))
        if found and first is None:
            first = k
        named += [s.rank for s in found]
    assert RULES.hold <= first <= RULES.hold + 5, first  # held from (about) the first tick
    assert set(named) == {slow}
    assert found[0].ratio == pytest.approx(1.25, rel=0.1)


def test_slow_rank_leaves_out_late_and_idle_ranks_and_forgets_gone_ones() -> None:
    rule = SlowRankRule(RULES)
    for k in range(40):
        # Rank 2 attached late: too few steps in its window to compare.
        found = rule.observe(float(k), {0: W(30.0, 60), 1: W(30.5, 60), 2: W(60.0, MIN_STEPS - 1)})
        assert found == []
    # Lockstep ranks (DDP) all step at the slowest one's pace: nobody differs.
    assert rule.observe(100.0, {r: W(42.0, 60) for r in range(8)}) == []
    rule.observe(101.0, {0: W(30.0, 60), 1: W(50.0, 60)})
    rule.forget(1)
    assert rule.observe(102.0 + RULES.hold, {0: W(30.0, 60), 1: W(50.0, 60)}) == []


def test_relative_spread() -> None:
    assert relative_spread([1.0, 1.0]) == 0.0
    assert relative_spread([10.0, 11.0, 9.0]) == pytest.approx(0.1)
    assert relative_spread([0.0, 0.0, 0.0]) == 0.0


def lockstep_waits(n_ranks: int, rng: random.Random, waited_for: int = -1, share: float = 0.0,
                   wait_ms: float = 12.0, window: bool = False,
                   ) -> dict[int, W]:  # fmt: skip
    """A lockstep role's window figures: every rank steps in 30 ms (±1 %), each waits
    ``wait_ms`` a step in collectives ±10 % of the step (the whole ±10 % on each window's
    figure; with ``window``, as the mean over the window's 61 steps of waits that jitter so);
    the others wait ``share`` of a step more for ``waited_for``."""
    out: dict[int, W] = {}
    sd = 0.1 / math.sqrt(3 * 61)  # the mean of 61 draws of U(-0.1, 0.1)
    for r in range(n_ranks):
        jitter = rng.gauss(0.0, sd) if window else rng.uniform(-0.1, 0.1)
        wait = wait_ms + 30.0 * (share * (r != waited_for) + jitter)
        out[r] = W(30.0 * (1 + rng.uniform(-0.01, 0.01)), 61, max(0.0, wait), 61)
    return out


@pytest.mark.parametrize("n_ranks", [2, 3, 8, 64, 1024, 8192])
@pytest.mark.parametrize("wait_ms", [0.5, 12.0, 27.0])
def test_the_wait_rule_never_fires_on_steady_jittery_waits(n_ranks: int, wait_ms: float) -> None:
    rng = random.Random(n_ranks)
    rule = WaitRule(RULES)
    for k in range(max(40, 20_000 // n_ranks)):
        assert rule.observe(float(k), lockstep_waits(n_ranks, rng, wait_ms=wait_ms)) == []


@pytest.mark.parametrize("n_ranks", [2, 3, 8, 64, 1024, 8192])
def test_the_rank_a_lockstep_role_waits_for_is_named_after_the_hold(n_ranks: int) -> None:
    rng = random.Random(n_ranks + 1)
    rule = WaitRule(RULES)
    slow = n_ranks // 2
    named: list[int] = []
    first = None
    for k in range(60):
        # The others wait a quarter of a step more than it: the threshold exactly.
        found = rule.observe(float(k), lockstep_waits(n_ranks, rng, slow, 0.25, 2.0, window=True))
        if found and first is None:
            first = k
        named += [s.rank for s in found]
    assert first is not None and RULES.hold <= first <= RULES.hold + 5, first
    assert set(named) == {slow}
    assert found[0].share == pytest.approx(0.25, abs=0.1)
    assert found[0].wait_ms < found[0].peers_wait_ms


def test_the_wait_rule_needs_every_rank_s_wait_and_lockstep() -> None:
    rng = random.Random(9)
    steady = lockstep_waits(4, rng, 1, 0.5)
    rule = WaitRule(RULES)
    for k in range(40):
        # One rank without a wait (its recorder off, or a backend that does not time): nothing.
        rule.observe(float(k), {**steady, 3: W(30.0, 61, None, 0)})
    assert rule.observe(40.0, {**steady, 3: W(30.0, 61, None, 0)}) == []
    # Steps that differ (not lockstep): the step-time rule's business.
    assert rule.observe(41.0, {**steady, 2: W(40.0, 61, 12.0, 61)}) == []
    # Waits over too few steps are no figure.
    thin = {r: w._replace(wait_steps=MIN_STEPS - 1) for r, w in steady.items()}
    assert rule.observe(42.0, thin) == []
    # Holds started again after each of those: a full hold from now.
    for k in range(43, 43 + int(RULES.hold)):
        assert rule.observe(float(k), steady) == []
    assert [s.rank for s in rule.observe(43.0 + RULES.hold, steady)] == [1]
