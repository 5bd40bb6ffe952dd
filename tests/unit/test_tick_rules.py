"""Each incident kind's tick rule (``Kind.tick_rule``) fed synthetic job readings, as the
detectors feed it once a tick: what it finds, and what it reads."""

from __future__ import annotations

import random

from profd.watch.kinds import registry as kinds
from profd.watch.kinds.kind import Finding, JobReading, TickRank
from profd.watch.kinds.regression import RegressionTick
from profd.watch.kinds.slow_rank import SlowRankTick
from profd.watch.kinds.spike import SpikeTick
from profd.watch.slowdown_rules import WatchRules

RULES = WatchRules(window=20.0, baseline=60.0, hold=10.0)


def rank(r: int, ms: float | None, steps: int = 10, top_ms: float = 0.0, role: str = "w",
         step: int = 100) -> TickRank:  # fmt: skip
    """Rank ``r`` that made ``steps`` steps of ``ms`` in the tick, and as many in each of the
    window's ten seconds (None: none at all)."""
    if ms is None:
        return TickRank("h", 1000 + r, role, r, step, epoch=0)
    return TickRank("h", 1000 + r, role, r, step, ms, steps, 0, ms, 10 * steps, top_ms or ms)


def reading(now: float, ranks: list[TickRank], changed: bool = False,
            median: float | None = None, asked: list[int] | None = None) -> JobReading:  # fmt: skip
    def med(r: TickRank) -> tuple[float | None, int]:
        if asked is not None:
            asked.append(r.rank)
        return (median, 100) if median is not None else (None, 0)

    return JobReading("j", now, ranks, changed, med)


def test_the_kinds_found_on_the_ledger_are_those_with_a_tick_rule() -> None:
    ruled = {k.name for k in kinds.ALL if k.tick_rule is not None}
    assert ruled == {"regression", "slow_rank", "spike"}
    # Each rule is made per job from [watch]'s thresholds, and starts with nothing found.
    for k in kinds.ALL:
        if k.tick_rule is not None:
            assert k.tick_rule(RULES).observe(reading(0.0, [rank(0, 10.0)])) == []


def _run_regression(
    rule: RegressionTick, t0: float, seconds: int, ms: float, rng: random.Random,
    changed_at: int | None = None,
) -> list[Finding]:  # fmt: skip
    found: list[Finding] = []
    for i in range(seconds):
        ranks = [rank(r, ms * rng.uniform(0.95, 1.05)) for r in range(4)]
        found += rule.observe(reading(t0 + i, ranks, changed=i == changed_at))
    return found


def test_regression_finds_a_job_slower_than_its_baseline_and_names_no_rank() -> None:
    rule, rng = RegressionTick(RULES), random.Random(3)
    assert _run_regression(rule, 0.0, 90, 30.0, rng) == []
    found = _run_regression(rule, 90.0, 40, 45.0, rng)
    assert found, "a job 50 % slower on every rank for 40 s"
    f = found[0]
    assert f.role == "w" and list(f.suspects) == [] and f.step == 100
    assert 1.3 < f.evidence["ratio"] < 1.7 and f.evidence["ranks"] == 4


def test_regression_starts_its_baseline_again_when_the_ranks_change() -> None:
    rule, rng = RegressionTick(RULES), random.Random(4)
    _run_regression(rule, 0.0, 90, 30.0, rng)
    # The ranks changed as the job got slower: the slower steps are its new baseline.
    assert _run_regression(rule, 90.0, 40, 45.0, rng, changed_at=0) == []


def test_spike_reads_a_median_only_for_a_rank_whose_top_step_may_be_one() -> None:
    asked: list[int] = []
    steady = [rank(r, 100.0, top_ms=130.0) for r in range(8)]
    assert SpikeTick(RULES).observe(reading(1.0, steady, median=100.0, asked=asked)) == []
    assert asked == []
    ranks = [*steady[:5], rank(5, 100.0, top_ms=5100.0, step=321), *steady[6:]]
    (f,) = SpikeTick(RULES).observe(reading(2.0, ranks, median=100.0, asked=asked))
    assert asked == [5]
    assert [(s.role, s.rank) for s in f.suspects] == [("w", 5)] and f.step == 321
    assert f.evidence["step_ms"] == 5100.0 and f.evidence["median_ms"] == 100.0
    assert f.evidence["spiked"] == {"w:5": [5100.0, 100.0]}


def test_slow_rank_needs_a_hold_names_the_rank_and_leaves_out_ranks_without_a_window() -> None:
    rule = SlowRankTick(RULES)
    found: list[Finding] = []
    for t in range(15):
        ranks = [rank(r, 42.0 if r == 2 else 30.0) for r in range(4)]
        ranks.append(rank(9, None))  # no interval in the window yet: not in the role
        got = rule.observe(reading(float(t), ranks))
        if t < 10:
            assert got == [], t  # the hold (10 s) has not passed
        found += got
    assert {(s.role, s.rank) for f in found for s in f.suspects} == {("w", 2)}
    ev = found[0].evidence
    assert ev["step_ms"] == 42.0 and ev["peers_ms"] == 30.0 and ev["ranks"] == 5


def test_slow_rank_compares_ranks_only_within_their_role() -> None:
    rule = SlowRankTick(RULES)
    for t in range(20):
        # Two roles of different speeds, each steady; one actor alone in its role.
        ranks = [rank(r, 30.0, role="learner") for r in range(3)]
        ranks += [rank(r, 90.0, role="rollout") for r in range(3)]
        ranks.append(rank(0, 500.0, role="actor"))
        assert rule.observe(reading(float(t), ranks)) == []
    assert set(rule.roles) == {"learner", "rollout"}
