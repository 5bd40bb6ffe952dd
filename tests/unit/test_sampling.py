"""Samples aligned by the global step (profd/watch/sampling.py): the steps and the id of the
next sample, from the step alone, so every node of a job arms the same ones."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from profd import config_file
from profd.config import ConfigError, load
from profd.daemon.sessions.samples import rules_of
from profd.scheduling.planner import TargetState, check_reachable
from profd.watch import sampling
from profd.watch.sampling import SampleRules, cycle_of, due, first_k, sample_id
from profd_client import protocol as P


def ts(step: int, sps: float = 10.0, at: float = 0.0, busy: int = 0) -> TargetState:
    return TargetState(f"r@{step}", step, sps, at, busy_until=busy)


def test_sample_k_records_steps_after_a_multiple_of_every_with_one_warmup_step() -> None:
    assert cycle_of(20, 2, 1) == (20, 21, 23)
    assert cycle_of(1000, 3, 7) == (7000, 7001, 7004)
    # The first k whose warm-up step is at or after the earliest step a rank can make.
    assert [first_k(20, e) for e in (1, 19, 20, 21, 40, 41)] == [1, 1, 1, 2, 2, 3]


def test_the_id_names_job_and_first_step_and_is_always_a_valid_session_id() -> None:
    assert sample_id("paced2", 21) == "sample-paced2-21"
    long = "j" * P.MAX_NAME
    sid = sample_id(long, 1_000_001)
    assert sid == sample_id(long, 1_000_001) and sid.startswith("sample-")
    assert sid != sample_id("k" * P.MAX_NAME, 1_000_001)
    for s in (sid, sample_id("a.b_c-d", 41)):
        P.SESSION_ID.check(s, "session")


def test_bad_rules_are_named() -> None:
    assert sampling.problem(0, 50) is None  # off
    assert sampling.problem(20, 2) is None
    assert "overlap" in str(sampling.problem(2, 2))
    assert "sample_steps" in str(sampling.problem(20, 0))


def test_a_sample_is_armed_only_shortly_before_its_steps_and_never_once_they_passed() -> None:
    rules = SampleRules(1000, 2)
    assert due(SampleRules(0, 2), [ts(5)], 0.0) is None  # off
    # At step 5 (10 steps/s) step 1000 is 100 s away: not yet (the ranks stay free).
    assert due(rules, [ts(5)], 0.0) is None
    # Five seconds of steps before it: armed, and a cluster coordinator's check agrees.
    got = due(rules, [ts(960)], 0.0)
    assert got == (1000, 1001, 1003)
    check_reachable([got], [ts(960)], 0.0)
    # Too close to make (the planner's lead): that sample is skipped, the next is far.
    assert due(rules, [ts(995)], 0.0) is None
    assert due(rules, [ts(1960)], 0.0) == (2000, 2001, 2003)
    # Extrapolated from the last report: 4 s after step 920 at 10 steps/s is step 960.
    assert due(rules, [ts(920, at=0.0)], 4.0) == (1000, 1001, 1003)


def test_every_rank_of_the_job_can_make_it_and_busy_ranks_are_waited_for() -> None:
    rules = SampleRules(20, 2)
    # The rank furthest on decides: step 12 + its lead (12) is past step 20.
    assert due(rules, [ts(2), ts(12)], 0.0) == (40, 41, 43)
    # A rank busy with another capture until step 45: the first sample after it.
    assert due(rules, [ts(2, busy=45), ts(3)], 0.0) is None  # step 60 is not close yet
    assert due(rules, [ts(30, busy=45), ts(30)], 0.0) == (60, 61, 63)


def test_a_node_still_processing_the_last_sample_skips_to_the_next_it_can_make() -> None:
    rules = SampleRules(20, 2)
    assert due(rules, [ts(5)], 0.0) == (20, 21, 23)
    # Done processing at step 30: the sample at 40 (lead 12 -> 42 > 40) cannot be made.
    assert due(rules, [ts(30)], 0.0) == (60, 61, 63)
    assert sample_id("j", 61) == "sample-j-61"


# --- nodes of one job, each with its own daemon, clock offsets and reports ------------------


@dataclass
class Node:
    """One node's daemon: its ranks' reports lag the job by a heartbeat, its loop ticks on
    its own phase, and it processes a sample for ``proc_s`` seconds after its last step."""

    ranks: int
    skew: list[float]  # per rank: steps behind the job (reports, step times)
    rate: list[float]  # per rank: the rate it reports
    phase: float  # its loop's tick offset
    proc_s: float
    armed: list[tuple[int, int, int]] = field(default_factory=list)
    free_at: float = 0.0

    def targets(self, job_rate: float, t: float, hb: float) -> list[TargetState]:
        out = []
        for k in range(self.ranks):
            at = math.floor(t / hb) * hb  # its last heartbeat
            step = max(0, int(job_rate * at - self.skew[k]))
            out.append(TargetState(f"r{k}", step, self.rate[k], at))
        return out


def simulate(
    nodes: list[Node], rules: SampleRules, job_rate: float, seconds: float, tick: float = 1.0
) -> None:
    hb = 0.5
    events = sorted(
        (n.phase + j * tick, i) for i, n in enumerate(nodes) for j in range(int(seconds / tick))
    )
    for t, i in events:
        n = nodes[i]
        if n.armed and job_rate * t < n.armed[-1][2]:
            continue  # its last sample is armed or capturing
        if t < n.free_at:
            continue  # still processing it
        c = due(rules, n.targets(job_rate, t, hb), t)
        if c is not None:
            n.armed.append(c)
            n.free_at = c[2] / job_rate + n.proc_s


@pytest.mark.parametrize("n_nodes", [2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_nodes_of_one_job_arm_the_same_samples_with_the_same_ids(n_nodes: int, seed: int) -> None:
    rng = random.Random(seed * 100 + n_nodes)
    rules = SampleRules(500, 2)
    job_rate = rng.uniform(5.0, 40.0)
    nodes = [
        Node(
            ranks=(r := rng.randint(1, 8)),
            skew=[rng.uniform(0.0, 3.0) for _ in range(r)],
            rate=[job_rate * rng.uniform(0.9, 1.1) for _ in range(r)],
            phase=rng.uniform(0.0, 1.0),
            # Processing, a loop tick and the lead end before the next sample's deadline.
            proc_s=rng.uniform(0.0, 0.3) * 500 / job_rate,
        )
        for _ in range(n_nodes)
    ]
    simulate(nodes, rules, job_rate, seconds=30 * 500 / job_rate)
    ids = [[sample_id("job", c[1]) for c in n.armed] for n in nodes]
    assert len(ids[0]) >= 25, ids[0]
    assert all(x == ids[0] for x in ids), ids
    # Every sample: the next multiple of sample_every, none skipped.
    firsts = [c[1] for c in nodes[0].armed]
    assert firsts == [500 * k + 1 for k in range(1, len(firsts) + 1)]


@pytest.mark.parametrize("n_nodes", [2, 8])
def test_a_node_that_processes_too_long_skips_one_and_the_nodes_agree_again(n_nodes: int) -> None:
    rules = SampleRules(100, 2)
    job_rate = 20.0  # a sample every 5 s
    nodes = [Node(2, [0.0, 1.0], [20.0, 19.5], 0.1 * i, 0.5) for i in range(n_nodes)]
    nodes[-1].proc_s = 5.5  # longer than the period: it misses the next sample each time
    simulate(nodes, rules, job_rate, seconds=60)
    fast, slow = [c[1] for c in nodes[0].armed], [c[1] for c in nodes[-1].armed]
    assert all([c[1] for c in n.armed] == fast for n in nodes[:-1])
    # The slow node samples every other one of the same samples: one id, the same steps.
    assert slow and set(slow) <= set(fast) and len(slow) < len(fast), (slow, fast)
    assert all(b - a == 200 for a, b in itertools.pairwise(slow)), slow


def toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "profd.toml"
    p.write_text(text)
    return p


def test_watch_sample_keys_are_read_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_file, "DEFAULT_CONFIG", tmp_path / "etc" / "profd.toml")
    cfg = load(toml(tmp_path, "[watch]\nsample_every = 500\nsample_steps = 3\n"), env={})
    assert rules_of(cfg.watch) == SampleRules(500, 3, 86400.0)
    assert rules_of(cfg.watch).timeout == 60.0
    cfg = load(toml(tmp_path, "[watch]\nsample_every = 500\nsample_timeout = 2.5\n"), env={})
    assert rules_of(cfg.watch) == SampleRules(500, 2, 86400.0, 2.5)
    assert not rules_of(load(env={}).watch).on  # off unless asked
    for text, why in (
        ("sample_every = 2\n", "overlap"),
        ("sample_every = 100\nsample_steps = 0\n", "sample_steps: must be an integer >= 1"),
        ("sample_every = -1\n", "sample_every: must be an integer >= 0"),
        ("keep_samples = 0\n", "keep_samples: must be a number > 0"),
        ("sample_timeout = 0\n", "sample_timeout: must be a number > 0"),
    ):
        with pytest.raises(ConfigError, match=why):
            load(toml(tmp_path, "[watch]\n" + text), env={})


def test_a_sample_is_given_50_typical_steps_per_recorded_step_and_at_least_60_s() -> None:
    assert (sampling.TIMEOUT_STEPS, sampling.MIN_TIMEOUT_S) == (50, 60.0)
    rules = SampleRules(1000, 2)
    assert sampling.time_limit(rules, None) == 60.0  # rate unknown: the least
    assert sampling.time_limit(rules, 0.1) == 60.0  # 2 x 50 x 0.1 s = 10 s
    assert sampling.time_limit(rules, 2.0) == 200.0  # 2 x 50 x 2 s
    assert sampling.time_limit(SampleRules(1000, 8), 2.0) == 800.0
    assert sampling.time_limit(SampleRules(1000, 2, timeout=3.0), 0.01) == 3.0


def test_a_jobs_typical_step_ignores_stopped_ranks_and_a_slow_minority() -> None:
    assert sampling.typical_step_s([]) is None
    assert sampling.typical_step_s([0.0, 0.0]) is None  # nobody measured stepping
    assert sampling.typical_step_s([10.0, 0.0]) == pytest.approx(0.1)  # one stopped
    assert sampling.typical_step_s([10.0, 10.0, 0.01]) == pytest.approx(0.1)
    # One honest and one claiming 100 s steps: the job is given the honest rank's.
    assert sampling.typical_step_s([10.0, 0.01]) == pytest.approx(0.1)
    assert sampling.typical_step_s([4.0, 5.0, 10.0, 20.0]) == pytest.approx(0.1)


def test_a_rank_far_ahead_of_another_gets_no_sample_rather_than_holding_it() -> None:
    # One rank at step 10^9 (a claim, or a run that set its count): a sample there would keep
    # the other armed, and busy for its owner's captures, for ever.
    rules = SampleRules(sample_every=100, sample_steps=2)
    assert due(rules, [ts(10**9, 50.0), ts(95, 50.0)], 0.0) is None
    assert sampling.holds_back(10**9, ts(95, 50.0), 0.0)
    # A few seconds apart is a sample as usual.
    assert due(rules, [ts(97, 50.0), ts(95, 50.0)], 0.0) is not None
    assert not sampling.holds_back(301, ts(95, 50.0), 0.0)


def test_a_step_that_jumps_beyond_the_ranks_rate_is_ignored_and_counted() -> None:
    trust = sampling.StepTrust()
    # Attached, then a resumed run sets its count: no rate measured yet, so trusted.
    assert trust.observe("r", 0, 0.0) and trust.observe("r", 50_000, 0.1)
    t = 0.1
    for _ in range(20):  # 50 steps/s, a report every 0.2 s
        t += 0.2
        assert trust.observe("r", 50_000 + round((t - 0.1) * 50), t)
    step = 50_000 + round((t - 0.1) * 50)
    # A minute's pause (a checkpoint), then its steps at its rate again, reported 3 s apart
    # (a loaded node): no jump, though its rate over the pause was 0.
    for _ in range(60):
        t += 1.0
        assert trust.observe("r", step, t)
    for _ in range(3):
        t += 3.0
        step += 150
        assert trust.observe("r", step, t)
    assert trust.implausible == 0
    # A jump to 10^9: not planned with, counted once however often it is reported.
    assert not trust.observe("r", 10**9, t + 0.2)
    assert not trust.observe("r", 10**9 + 10, t + 0.4)
    assert trust.implausible == 1
    # Back where its rate says it is (the jump was one bad report): trusted again.
    assert trust.observe("r", step + 30, t + 0.6)
    # Another jump, and it steps on from there at its rate: trusted once it has done so for
    # SETTLE_S (a resume inside a running process).
    assert not trust.observe("r", 10**9, t + 0.8)
    assert trust.implausible == 2
    at = t + 0.8
    while at < t + 0.8 + sampling.SETTLE_S - 1:
        at += 1.0
        assert not trust.observe("r", 10**9 + round((at - t - 0.8) * 50), at)
    at += 2.0
    assert trust.observe("r", 10**9 + round((at - t - 0.8) * 50), at)
    # A count that goes back is a new run in the same process: trusted from there.
    assert trust.observe("r", 3, at + 1.0)
    assert trust.implausible == 2
    trust.forget([])
    assert trust.ranks == {}


def test_a_job_that_speeds_up_after_its_warm_up_is_not_a_jump() -> None:
    trust = sampling.StepTrust()
    # Attached at step 0, a second building its model, then 50 slow warm-up steps: its first
    # measured rate is 50 steps/s, yet 1,400 steps a second after is no jump (FLOOR_SPS).
    assert trust.observe("r", 0, 0.0)
    assert trust.observe("r", 50, 1.0)
    for i in range(1, 6):
        assert trust.observe("r", 50 + 1400 * i, 1.0 + i)
    assert trust.implausible == 0
    # A job measured at 10 steps/s that becomes far faster than the floor allows (10,000
    # steps/s): a jump at first, trusted once it has stepped on from there for SETTLE_S,
    # with its new rate measured from the jump.
    trust = sampling.StepTrust()
    at, step = 0.0, 0
    for _ in range(10):
        at, step = at + 1.0, step + 10
        assert trust.observe("r", step, at)
    at, step = at + 1.0, step + 10_000
    assert not trust.observe("r", step, at)
    settled = at + sampling.SETTLE_S
    while at < settled:
        at, step = at + 1.0, step + 10_000
        assert trust.observe("r", step, at) == (at >= settled)
    at, step = at + 1.0, step + 10_000
    assert trust.observe("r", step, at)
    assert trust.implausible == 1
