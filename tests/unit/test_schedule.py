"""Schedules (``profd/scheduling/schedule.py``): every form a user can write, every error, and
the properties every resolved plan must have. Pure functions: no daemon, no sockets."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profd import control_schema as C
from profd.scheduling.schedule import (
    SESSION_STEPS,
    SESSION_WORK,
    Schedule,
    ScheduleError,
    check_work,
    describe,
    parse,
    resolve,
    steps_of,
)
from profd_client import protocol as P


def plan(earliest: int = 1, **spec: Any) -> list[tuple[int, int, int]]:
    return resolve(parse(spec), earliest)


# --- forms -------------------------------------------------------------------------------------
def test_default_is_next_one_step() -> None:
    s = parse({})
    assert s == Schedule("next", active=1, warmup=0, repeat=1, roundup=1)
    assert not s.explicit
    assert resolve(s, earliest=7) == [(7, 7, 8)]


def test_steps_range_is_half_open_and_one_indexed() -> None:
    s = parse({"steps": "3:5"})
    assert s == Schedule("range", start=3, stop=5)
    assert s.explicit
    assert resolve(s) == [(3, 3, 5)]
    assert steps_of(resolve(s)) == [3, 4]  # NeMo RL's rule: 3:5 is steps 3 and 4


def test_steps_range_ignores_earliest() -> None:
    # Explicit schedules name absolute steps; whether they passed is the caller's check.
    assert plan(earliest=100, steps="3:5") == [(3, 3, 5)]


def test_steps_range_tolerates_spaces() -> None:
    assert parse({"steps": " 3 : 5 "}) == Schedule("range", start=3, stop=5)


def test_steps_range_with_warmup_and_repeat() -> None:
    # Each repeat starts where the previous capture stopped, warm-up included.
    assert plan(steps="3:5", warmup=1, repeat=3) == [(2, 3, 5), (5, 6, 8), (8, 9, 11)]


def test_steps_list_is_sorted_deduplicated_one_cycle_per_step() -> None:
    s = parse({"steps": "5, 1,2,5"})
    assert s == Schedule("list", steps=(1, 2, 5))
    assert resolve(s) == [(1, 1, 2), (2, 2, 3), (5, 5, 6)]


def test_steps_single_number_is_a_list() -> None:
    assert parse({"steps": "7"}) == Schedule("list", steps=(7,))
    assert parse({"steps": 7}) == Schedule("list", steps=(7,))


def test_steps_list_skips_empty_items() -> None:
    assert parse({"steps": "1,,3,"}).steps == (1, 3)


def test_steps_list_with_warmup() -> None:
    assert plan(steps="3,6", warmup=2) == [(1, 3, 4), (4, 6, 7)]


def test_at_step() -> None:
    s = parse({"at_step": 10, "active": 3})
    assert s == Schedule("at", start=10, active=3)
    assert s.explicit
    assert resolve(s, earliest=50) == [(10, 10, 13)]


def test_at_step_accepts_numeric_strings() -> None:
    assert parse({"at_step": " 10 "}).start == 10


def test_at_step_with_warmup_repeat_roundup() -> None:
    assert plan(at_step=10, active=2, warmup=1, repeat=2, roundup=4) == [
        (11, 12, 14),
        (14, 15, 17),
    ]


def test_at_step_on_a_multiple_is_not_rounded() -> None:
    assert plan(at_step=12, roundup=4) == [(12, 12, 13)]


def test_next() -> None:
    assert parse({"next": True}) == parse({})
    assert plan(earliest=5, next=True, active=2) == [(5, 5, 7)]


def test_next_false_is_the_default_form() -> None:
    assert parse({"next": False, "at_step": 3}).kind == "at"


def test_next_warmup_starts_at_earliest() -> None:
    # The warm-up begins at the first step every target can make; capture follows it.
    assert plan(earliest=5, warmup=2, active=3) == [(5, 7, 10)]


def test_next_before_any_step() -> None:
    # A target that has not begun (earliest 1) or reports nonsense (earliest <= 0) still
    # gets a plan that starts at step 1 or later, warm-up included.
    assert plan(earliest=1, warmup=2) == [(1, 3, 4)]
    assert plan(earliest=0, warmup=2) == [(1, 3, 4)]
    assert plan(earliest=-5) == [(1, 1, 2)]


def test_next_roundup() -> None:
    assert plan(earliest=5, roundup=10, active=2) == [(10, 10, 12)]
    assert plan(earliest=10, roundup=10) == [(10, 10, 11)]
    # The captured start is rounded up, after the warm-up: it may begin after earliest.
    assert plan(earliest=9, roundup=10, warmup=3) == [(17, 20, 21)]


def test_next_repeat() -> None:
    assert plan(earliest=4, active=2, repeat=3) == [(4, 4, 6), (6, 6, 8), (8, 8, 10)]


def test_modifiers_accept_numeric_strings() -> None:
    s = parse({"next": True, "active": "2", "warmup": "1", "repeat": "3", "roundup": "4"})
    assert (s.active, s.warmup, s.repeat, s.roundup) == (2, 1, 3, 4)


# --- errors --------------------------------------------------------------------------------------
# Messages are matched on what names the mistake (the flag, the value, the rule), not on the
# exact wording.
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"steps": "3:5", "next": True}, "use one of --steps, --next, --at-step"),
        ({"steps": "3:5", "at_step": 3}, "got --steps and --at-step"),
        ({"at_step": 3, "next": True}, "got --at-step and --next"),
        ({"steps": "3:5", "at_step": 3, "next": True}, "got --steps and --at-step and --next"),
        ({"steps": "0:5"}, "--steps 0:5: .*start must be >= 1"),
        ({"steps": "-2:5"}, "--steps -2:5: .*start must be >= 1"),
        ({"steps": "5:5"}, "--steps 5:5: start must be less than stop"),
        ({"steps": "6:5"}, "--steps 6:5: start must be less than stop"),
        ({"steps": "a:5"}, "--steps a:5: start.* must be"),
        ({"steps": ":5"}, "--steps :5: start.* must be"),
        ({"steps": "3:"}, "--steps 3:: .*must be"),
        ({"steps": "3:5:7"}, "--steps 3:5:7: .*must be"),
        ({"steps": "3.5:7"}, "--steps 3.5:7: start.* must be"),
        ({"steps": ""}, "--steps is empty"),
        ({"steps": " , "}, "--steps is empty"),
        ({"steps": "1,x"}, "--steps item 'x' must be an integer"),
        ({"steps": "0,3"}, "--steps item '0' must be >= 1, got 0"),
        ({"steps": "1,-3"}, "--steps item '-3' must be >= 1"),
        ({"steps": "3:5", "active": 2}, "--active goes with --next or --at-step"),
        ({"steps": "3", "active": 1}, "--active goes with --next or --at-step"),
        ({"steps": "1,2", "repeat": 2}, "--repeat does not apply to a --steps list"),
        ({"steps": "3:5", "roundup": 4}, "--roundup goes with --next or --at-step"),
        ({"steps": "3", "roundup": 4}, "--roundup goes with --next or --at-step"),
        ({"at_step": 0}, "--at-step must be >= 1, got 0"),
        ({"at_step": "x"}, "--at-step must be an integer, got 'x'"),
        ({"at_step": 2.5}, "--at-step must be an integer"),
        ({"at_step": True}, "--at-step must be an integer"),
        ({"active": -1}, "--active must be >= 1, got -1"),
        ({"warmup": -1}, "--warmup must be >= 0, got -1"),
        ({"warmup": "x"}, "--warmup must be an integer"),
        ({"repeat": -2}, "--repeat must be >= 1, got -2"),
        ({"roundup": -3}, "--roundup must be >= 1, got -3"),
        ({"roundup": [4]}, "--roundup must be an integer"),
    ],
)
def test_parse_errors(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as exc:
        parse(spec)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("spec", "earliest", "message"),
    [
        ({"steps": "3:5", "warmup": 3}, 1, "--warmup 3 needs the first captured step to be > 3"),
        ({"steps": "2", "warmup": 2}, 1, "--warmup 2 needs the first captured step to be > 2"),
        ({"at_step": 3, "warmup": 5}, 1, "--warmup 5 needs the first captured step to be > 5"),
        # At step 5 with roundup 4 the capture would start at 4: too early for a warm-up of 5.
        ({"at_step": 3, "roundup": 4, "warmup": 5}, 1, "--warmup 5 needs"),
        ({"steps": "3,5", "warmup": 2}, 1, "--warmup 2 overlaps the capture before step 5"),
        ({"steps": "3,4", "warmup": 1}, 1, "--warmup 1 overlaps the capture before step 4"),
    ],
)
def test_resolve_errors(spec: dict[str, Any], earliest: int, message: str) -> None:
    s = parse(spec)
    with pytest.raises(ScheduleError, match=message):
        resolve(s, earliest)


@pytest.mark.parametrize("key", ["active", "warmup", "repeat", "roundup"])
def test_none_modifier_means_not_given(key: str) -> None:
    assert parse({key: None}) == parse({})


@pytest.mark.parametrize(
    "spec", [{"active": 0}, {"active": False}, {"repeat": 0}, {"roundup": 0}, {"warmup": True}]
)
def test_zero_or_bool_modifiers_are_refused_before_parse(spec: dict[str, Any]) -> None:
    # parse() takes a falsy modifier as "not given"; every start request is checked against
    # the protocol's start schema first, which refuses these with the field's name.
    with pytest.raises(P.ProtocolError, match=f"spec.{next(iter(spec))}"):
        C.start_spec(spec)


def test_list_warmup_that_just_fits_between_steps() -> None:
    # Step 3's capture stops at 4; step 6's warm-up of 2 starts at 4: touching, not overlapping.
    assert plan(steps="3,6", warmup=2) == [(1, 3, 4), (4, 6, 7)]


# --- describe / steps_of -----------------------------------------------------------------------
def test_describe() -> None:
    assert describe([(1, 3, 5)]) == "3:5"
    assert describe([(5, 5, 6)]) == "5"
    assert describe([(1, 1, 2), (2, 2, 3), (5, 5, 8)]) == "1, 2, 5:8"
    assert describe([]) == ""


def test_steps_of() -> None:
    assert steps_of([(1, 3, 5), (5, 6, 7)]) == [3, 4, 6]
    assert steps_of([]) == []


# --- properties ----------------------------------------------------------------------------------
# Values stay small: schedules may get upper bounds, and these properties are about shape.
# No deadline: the machines running the suite are shared and timing is not what is tested.
PROPERTY = settings(deadline=None, database=None)
STEP = st.integers(1, 5_000)
WARMUP = st.integers(0, 20)
ACTIVE = st.integers(1, 50)
REPEAT = st.integers(1, 10)
ROUNDUP = st.integers(1, 100)


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    form = draw(st.sampled_from(["range", "list", "at", "next"]))
    spec: dict[str, Any] = {}
    if draw(st.booleans()):
        spec["warmup"] = draw(WARMUP)
    if form == "range":
        a = draw(STEP)
        spec["steps"] = f"{a}:{a + draw(ACTIVE)}"
        if draw(st.booleans()):
            spec["repeat"] = draw(REPEAT)
    elif form == "list":
        nums = draw(st.lists(STEP, min_size=1, max_size=10))
        spec["steps"] = ",".join(map(str, nums))
    else:
        if form == "at":
            spec["at_step"] = draw(STEP)
        else:
            spec["next"] = True
        for key, strat in (("active", ACTIVE), ("repeat", REPEAT), ("roundup", ROUNDUP)):
            if draw(st.booleans()):
                spec[key] = draw(strat)
    return spec


def check_shape(cycles: list[tuple[int, int, int]], s: Schedule) -> None:
    assert cycles
    for w, a, b in cycles:
        assert 1 <= w <= a < b
        assert a - w == s.warmup
    for (_, _, prev_stop), (nxt_w, _, _) in itertools.pairwise(cycles):
        assert prev_stop <= nxt_w  # increasing, warm-ups included, never overlapping
    steps = steps_of(cycles)
    assert steps == sorted(set(steps))


@PROPERTY
@given(specs(), st.integers(-3, 5_000))
def test_resolved_cycles_are_increasing_and_disjoint(spec: dict[str, Any], earliest: int) -> None:
    s = parse(spec)
    try:
        cycles = resolve(s, earliest)
    except ScheduleError as exc:
        # Only a warm-up reaching before step 1, or list warm-ups overlapping, is refused.
        assert s.warmup > 0, exc
        return
    check_shape(cycles, s)
    if s.kind == "list":
        assert [a for _, a, _ in cycles] == list(s.steps)
        assert all(b == a + 1 for _, a, b in cycles)
        return
    assert len(cycles) == s.repeat
    length = s.stop - s.start if s.kind == "range" else s.active
    assert all(b - a == length for _, a, b in cycles)
    first = cycles[0][1]
    if s.kind == "range":
        assert first == s.start
    elif s.kind == "at":
        assert first == -(-s.start // s.roundup) * s.roundup
    else:
        assert first % s.roundup == 0
        assert cycles[0][0] >= max(earliest, 1)  # never before what every target can make
        assert first - s.roundup < max(earliest, 1) + s.warmup  # and no later than needed


@PROPERTY
@given(specs(), st.integers(1, 5_000))
def test_next_and_at_never_refuse_a_reachable_warmup(spec: dict[str, Any], earliest: int) -> None:
    s = parse(spec)
    if s.kind == "next":
        check_shape(resolve(s, earliest), s)  # --next always fits its warm-up
    elif s.kind == "at" and s.start > s.warmup:
        check_shape(resolve(s, earliest), s)


@PROPERTY
@given(STEP, ACTIVE, WARMUP, REPEAT)
def test_range_repeats_tile_without_gaps(a: int, n: int, w: int, r: int) -> None:
    s = parse({"steps": f"{a}:{a + n}", "warmup": w, "repeat": r})
    if a <= w:
        with pytest.raises(ScheduleError):
            resolve(s)
        return
    cycles = resolve(s)
    # Each repeat's warm-up starts exactly where the previous capture stopped.
    for (_, _, stop), (nxt_w, _, _) in itertools.pairwise(cycles):
        assert nxt_w == stop
    assert cycles[-1][2] == a + r * n + (r - 1) * w


@PROPERTY
@given(st.lists(STEP, min_size=1, max_size=10), WARMUP)
def test_list_warmup_refused_exactly_when_it_overlaps(nums: list[int], w: int) -> None:
    steps = sorted(set(nums))
    s = parse({"steps": ",".join(map(str, nums)), "warmup": w})
    fits = steps[0] > w and all(b - w >= a + 1 for a, b in itertools.pairwise(steps))
    if fits:
        assert steps_of(resolve(s)) == steps
    else:
        with pytest.raises(ScheduleError):
            resolve(s)


@PROPERTY
@given(specs())
def test_describe_names_every_captured_range(spec: dict[str, Any]) -> None:
    try:
        cycles = resolve(parse(spec), 1)
    except ScheduleError:
        return
    text = describe(cycles)
    assert len(text.split(", ")) == len(cycles)


# --- the total work of a session -----------------------------------------------------------------
# Each field within its own limit can still multiply into millions of steps: 1000 repeats of
# 10000 steps made a 50 MB reply and a 129 MB session.json, and stalled the daemon.
@pytest.mark.parametrize(
    ("spec", "flags"),
    [
        ({"next": True, "repeat": 1000, "active": 10000}, "--repeat 1000 x --active 10000"),
        ({"at_step": 50, "repeat": 11, "active": 1000}, "--repeat 11 x --active 1000"),
        ({"steps": "100:1100", "repeat": 11}, "--repeat 11 x --steps 100:1100"),
        (
            {"steps": ",".join(str(20_000 * i) for i in range(1, 101)), "warmup": 100},
            "100 --steps x (1 + --warmup 100)",
        ),
        (
            {"next": True, "repeat": 100, "active": 50, "warmup": 51},
            "--repeat 100 x (--active 50 + --warmup 51)",
        ),
    ],
)
def test_a_session_profiling_too_many_steps_is_refused_naming_the_flags(
    spec: dict[str, Any], flags: str
) -> None:
    with pytest.raises(ScheduleError) as exc:
        parse(spec)
    msg = str(exc.value)
    assert flags in msg and f"at most {SESSION_STEPS}" in msg and "\n" not in msg, msg


def test_the_largest_session_is_accepted() -> None:
    assert steps_of(plan(earliest=5, repeat=10, active=SESSION_STEPS // 10)) == list(
        range(5, 5 + SESSION_STEPS)
    )
    assert len(plan(steps=",".join(str(3 * i) for i in range(1, 1001)), warmup=1)) == 1000


def test_work_over_all_targets_is_bounded() -> None:
    cycles = plan(earliest=5, repeat=10, active=100)  # 1000 steps each
    check_work(cycles, SESSION_WORK // 1000)
    with pytest.raises(ScheduleError) as exc:
        check_work(cycles, SESSION_WORK // 1000 + 1)
    msg = str(exc.value)
    assert f"1000 steps on each of {SESSION_WORK // 1000 + 1} processes" in msg, msg
    assert f"at most {SESSION_WORK}" in msg, msg
    # Cycles a coordinator sends are bounded like a schedule's.
    with pytest.raises(ScheduleError, match=f"at most {SESSION_STEPS}"):
        check_work([(a, a, a + 5000) for a in range(1, 15001, 5000)], 1)
