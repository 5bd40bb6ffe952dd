"""The spike rule (profd.watch.spike_rule) on synthetic ranks, 2 to 8,192 of them: a single
long step is named on the tick it ends in; steady jittery steps never are."""

from __future__ import annotations

import numpy as np
import pytest

from profd.watch.spike_rule import MIN_EXCESS_MS, RankTick, is_candidate, spikes

WINDOW_TICKS = 60  # the daemon's default window: 60 one-second heartbeats


def _ticks(rng: np.random.Generator, ranks: int, ticks: int, per_tick: int, step_ms: float,
           jitter: float) -> np.ndarray:  # fmt: skip
    """Step times (ms), shape (ranks, ticks, steps a tick), uniform within ±``jitter``."""
    return step_ms * (1.0 + rng.uniform(-jitter, jitter, size=(ranks, ticks, per_tick)))


def _judge(steps: np.ndarray, threshold: float = 5.0) -> list[tuple[int, list[int]]]:
    """Feed the rule tick by tick as the detectors do: each rank's longest step of the tick
    against the median of its ticks' medians over the window before and including it."""
    p50 = np.median(steps, axis=2)
    top = steps.max(axis=2)
    per_tick = steps.shape[2]
    fired = []
    # A candidate's step is a second over its window's upper quantile, so at least a second
    # over the least median of all its ticks: only those ticks are fed (the rest cannot fire).
    maybe = (top - p50.min(axis=1, keepdims=True) >= MIN_EXCESS_MS).any(axis=0)
    for t in np.nonzero(maybe)[0]:
        if t < 8:
            continue
        lo = max(0, t - WINDOW_TICKS + 1)
        ref = np.quantile(p50[:, lo : t + 1], 0.7, axis=1)
        cand = np.nonzero(top[:, t] - ref >= MIN_EXCESS_MS)[0]
        if not len(cand):
            continue
        med = np.median(p50[cand, lo : t + 1], axis=1)
        ranks = {
            int(r): RankTick(float(top[r, t]), float(m), (t + 1 - lo) * per_tick)
            for r, m in zip(cand, med, strict=True)
        }
        found = spikes(ranks, threshold)
        if found is not None:
            fired.append((int(t), sorted(found.ranks)))
    return fired


@pytest.mark.parametrize("n_ranks", [2, 3, 8, 64, 1024, 8192])
# 1 ms steps need no case of their own: ±10 % of a millisecond is never a second over.
@pytest.mark.parametrize("step_ms", [100.0, 900.0])
def test_no_spike_over_10000_steady_steps_with_10_percent_jitter(
    n_ranks: int, step_ms: float
) -> None:
    rng = np.random.default_rng(n_ranks)
    per_tick = max(1, round(1000.0 / step_ms))
    # 10,000 steps a rank, in blocks so 8,192 ranks stay in memory (the rule is per rank).
    ticks = -(-10_000 // per_tick)
    block = max(1, 2_000_000 // (ticks * per_tick))
    alarms = 0
    for first in range(0, n_ranks, block):
        n = min(block, n_ranks - first)
        alarms += len(_judge(_ticks(rng, n, ticks, per_tick, step_ms, 0.10)))
    assert alarms == 0


@pytest.mark.parametrize("n_ranks", [2, 3, 8, 64, 1024, 8192])
def test_one_ranks_five_second_step_is_named_on_its_tick(n_ranks: int) -> None:
    rng = np.random.default_rng(1)
    steps = _ticks(rng, n_ranks, 40, 10, 100.0, 0.10)
    victim = n_ranks // 2
    steps[victim, 30, 3] = 5000.0
    assert _judge(steps) == [(30, [victim])]


def test_every_rank_of_a_lockstep_job_is_named_and_short_or_young_ones_are_not() -> None:
    rng = np.random.default_rng(2)
    steps = _ticks(rng, 8, 40, 10, 100.0, 0.10)
    steps[:, 30, 0] = 5000.0
    assert _judge(steps) == [(30, list(range(8)))]
    # 1 ms steps: a 900 ms step is 900x its median but less than a second over it.
    assert spikes({0: RankTick(900.0, 1.0, 1000)}, 5.0) is None
    assert spikes({0: RankTick(1002.0, 1.0, 1000)}, 5.0) is not None
    # Fewer steps than a median needs: no judgement.
    assert spikes({0: RankTick(5000.0, 100.0, 7)}, 5.0) is None
    # 4.9x its median and 3.9 s over: under the threshold.
    assert spikes({0: RankTick(4900.0, 1000.0, 100)}, 5.0) is None


def test_a_candidate_needs_a_second_over_the_reference() -> None:
    assert not is_candidate(1999.0, 1000.0)
    assert is_candidate(2000.0, 1000.0)
    assert not is_candidate(5000.0, None)
