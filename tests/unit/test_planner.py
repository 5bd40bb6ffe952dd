"""The planner as a pure function: schedules plus reported steps and rates, time as an argument."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profd.scheduling import planner
from profd.scheduling import schedule as sch
from profd.scheduling.refusal import Refused
from profd_client.protocol import MAX_STEP


def T(step: int = 0, sps: float = 0.0, at: float = 100.0, **kw: object) -> planner.TargetState:
    return planner.TargetState(name=f"r{step}", step=step, sps=sps, step_at=at, **kw)  # type: ignore[arg-type]


def plan(spec: dict[str, object], *targets: planner.TargetState, now: float = 100.0, **kw: object):  # type: ignore[no-untyped-def]
    return planner.plan(sch.parse(spec), list(targets), now, **kw)  # type: ignore[arg-type]


def test_next_leads_by_one_second_of_the_fastest_target() -> None:
    # 50 steps/s: one second of lead is 50 steps, plus the 2-step boundary margin.
    cycles = plan({"next": True}, T(step=100, sps=50.0), T(step=90, sps=1.0))
    assert cycles == [(152, 152, 153)]


def test_next_extrapolates_the_reported_step_with_time() -> None:
    # Reported step 100 two seconds ago at 10 steps/s: now about step 120.
    assert plan({"next": True}, T(step=100, sps=10.0, at=98.0))[0][1] == 120 + 10 + 2


def test_unknown_rate_gets_minimum_lead() -> None:
    assert plan({"next": True}, T(step=5))[0][1] == 5 + planner.UNKNOWN_RATE_LEAD + 2


def test_next_queues_after_busy_targets_and_nsys_gets_more_lead() -> None:
    assert plan({"next": True}, T(step=5, busy_until=400))[0][1] == 400
    torch_first = plan({"next": True}, T(step=0, sps=10.0))[0][1]
    nsys_first = plan({"next": True}, T(step=0, sps=10.0), backend="nsys")[0][1]
    assert nsys_first - torch_first == 10 * planner.NSYS_START_LEAD_S


def test_explicit_steps_that_passed_are_refused_with_the_rank_and_step() -> None:
    with pytest.raises(Refused) as exc:
        plan({"steps": "10:12"}, T(step=10, sps=0.0))
    assert exc.value.code == "steps_passed"
    assert "already passed" in str(exc.value) and "r10" in str(exc.value)
    # The step running now cannot be armed either (plans take effect at a boundary).
    with pytest.raises(Refused, match="starts before it can be armed"):
        plan({"steps": "11:12"}, T(step=10))
    assert plan({"steps": "12:13"}, T(step=10)) == [(12, 12, 13)]


def test_step_one_only_while_waiting_in_attach() -> None:
    with pytest.raises(Refused, match="PROFD_ATTACH_WAIT"):
        plan({"steps": "1:2"}, T(step=0))
    assert plan({"steps": "1:2"}, T(step=0, attaching=True)) == [(1, 1, 2)]


def test_explicit_steps_on_a_busy_target_say_use_next() -> None:
    with pytest.raises(Refused, match="--next") as exc:
        plan({"steps": "20:22"}, T(step=1, busy_until=30))
    assert exc.value.code == "busy"


def test_steps_beyond_the_maximum_are_refused_not_overflowed() -> None:
    # A heartbeat at the largest step: --next must refuse, not build unencodable cycles.
    with pytest.raises(Refused, match="beyond"):
        plan({"next": True}, T(step=MAX_STEP, sps=1e9))
    with pytest.raises(Refused, match="beyond"):
        plan({"next": True, "repeat": 10, "active": 900}, T(step=MAX_STEP - 5000))


def test_can_join_and_replannable() -> None:
    assert planner.can_join([(5, 5, 6)], T(step=3)) is None
    assert "after the rule's first step" in str(planner.can_join([(5, 5, 6)], T(step=4)))
    assert "PROFD_ATTACH_WAIT" in str(planner.can_join([(1, 1, 2)], T(step=0)))
    nxt, fixed = sch.parse({"next": True}), sch.parse({"steps": "5:6"})
    assert planner.replannable(nxt, "torch", False, 0)
    assert not planner.replannable(fixed, "torch", False, 0)
    assert not planner.replannable(nxt, "nsys", False, 0)
    assert not planner.replannable(nxt, "torch", True, 0)
    assert not planner.replannable(nxt, "torch", False, planner.MAX_REPLANS)
    assert planner.replan_lead(0, 0.1) == 2 * planner.NEXT_LEAD_S
    assert planner.replan_lead(1, 10.0) == 20.0


# --- one target's influence on a job's plan -------------------------------------------------------
def test_one_target_far_ahead_cannot_park_the_others() -> None:
    # A peer reporting step 10^9 (or a rate that extrapolates there) beside a real rank at
    # step 100 and 20 steps/s: the real rank would wait 1.6 years. Refused, naming both.
    real, liar = T(step=100, sps=20.0), planner.TargetState("liar", 10**9, 0.0, 100.0)
    for targets in ([real, liar], [liar, real]):
        with pytest.raises(Refused) as exc:
            planner.plan(sch.parse({"next": True}), targets, 100.0)
        msg = str(exc.value)
        assert exc.value.code == "unreachable" and "\n" not in msg, msg
        assert "liar" in msg and "r100" in msg and "at step 100" in msg, msg
    fast = planner.TargetState("fast", 100, 1e9, 100.0)
    with pytest.raises(Refused, match="fast"):
        planner.plan(sch.parse({"next": True}), [real, fast], 100.0)


def test_ranks_apart_within_the_bound_still_plan() -> None:
    # 20 steps/s: 600 s of steps is 12000, so a rank 5000 steps ahead is waited for.
    assert plan({"next": True}, T(step=100, sps=20.0), T(step=5100, sps=20.0))[0][1] > 5100
    # A slow job (30 s per step): ranks a few steps apart always plan, whatever the seconds.
    slow = T(step=100, sps=1 / 30), T(step=90, sps=1 / 30)
    assert plan({"next": True}, *slow)[0][1] == 100 + planner.UNKNOWN_RATE_LEAD + 2
    # A lone target far ahead only waits for itself.
    assert plan({"next": True}, T(step=10**9, sps=1e6))[0][1] > 10**9
    # Queueing after a target's own live session is the daemon's own knowledge, not a claim.
    assert plan({"next": True}, T(step=100, sps=20.0), T(step=100, busy_until=10**6))[0][1] == (
        10**6
    )


def test_explicit_steps_are_not_bounded_by_the_wait() -> None:
    assert plan({"steps": "5000000:5000001"}, T(step=100, sps=20.0)) == [
        (5_000_000, 5_000_000, 5_000_001)
    ]


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.integers(0, 10**9), min_size=1, max_size=8),
    rates=st.lists(st.floats(0, 1e4), min_size=8, max_size=8),
    warmup=st.integers(0, 5),
    repeat=st.integers(1, 4),
    active=st.integers(1, 5),
)
def test_next_plans_are_reachable_by_every_target(
    steps: list[int], rates: list[float], warmup: int, repeat: int, active: int
) -> None:
    targets = [T(step=s, sps=r, at=99.0) for s, r in zip(steps, rates, strict=False)]
    spec = {"next": True, "warmup": warmup, "repeat": repeat, "active": active}
    try:
        cycles = plan(spec, *targets)
    except Refused as exc:
        # Only when one target is further ahead of another than that one may wait for.
        assert exc.code == "unreachable", exc
        ests = [t.estimated_step(100.0) for t in targets]
        lead = max(max(t.sps for t in targets), planner.UNKNOWN_RATE_LEAD) + 3
        assert any(
            max(ests) - e + lead > max(t.sps * planner.MAX_NEXT_WAIT_S, planner.MAX_NEXT_WAIT_STEPS)
            for t, e in zip(targets, ests, strict=True)
        ), exc
        return
    assert len(cycles) == repeat
    for t in targets:
        assert cycles[0][0] >= t.armable_from(int(t.estimated_step(100.0)))
    for (_, _, stop), (w, _, _) in itertools.pairwise(cycles):
        assert w >= stop
