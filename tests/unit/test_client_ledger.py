"""The client's step ledger (``profd_client/ledger.py``, ``steps.py``): what a heartbeat's
``ledger`` says about the steps and regions since the previous one.

A real :class:`Stepper` and :class:`Reader` run on one thread; the Stepper's clock is a
:class:`Clock` the test moves by hand, so every duration is known exactly. Where the test
plays the training thread running while the agent reads (the ring overwritten, a jump), it
does so from the one place the Reader copies the ring (``_slots``).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from profd_client import api
from profd_client import protocol as P
from profd_client.ledger import REGION_NAME_BYTES, Reader, buckets, quantile, summarize
from profd_client.steps import NULL_REGION, RING, RegionTimer, Stepper

NB = len(P.STEP_BUCKETS) + 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stepper() -> tuple[Stepper, Clock]:
    clock = Clock()
    return Stepper("main-r0", notify=lambda: None, clock=clock), clock


def steps(st: Stepper, clock: Clock, n: int, dt: float) -> None:
    for _ in range(n):
        clock.now += dt
        st.tick()


def valid(ledger: dict[str, Any]) -> dict[str, Any]:
    """The ledger as a daemon receives it: checked against the wire schema."""
    frame = P.encode(P.HEARTBEAT, step=ledger["at"], sps=1.0, state="idle", ledger=ledger)
    ledger: dict[str, Any] = msgspec.to_builtins(P.decode(frame, P.AGENT_INBOUND)["ledger"])
    ledger["r"] = [list(region) for region in ledger["r"]]  # typed: each region a tuple
    return ledger


# --- pure summary --------------------------------------------------------------------------------
def test_quantiles_are_nearest_rank_and_the_last_is_the_maximum() -> None:
    ms = [i / 1000 for i in range(1, 101)]  # 1..100 ms, shuffled order must not matter
    lg = summarize(ms[::-1], n=100, total=sum(ms), at=100, epoch=0)
    assert lg["q"] == [0.050, 0.090, 0.099, 0.100]
    assert lg["n"] == 100 and lg["at"] == 100 and math.isclose(lg["sum"], sum(ms))
    assert quantile([7.0], 0.5) == quantile([7.0], 0.99) == 7.0
    assert quantile([1.0, 2.0], 0.5) == 1.0 and quantile([1.0, 2.0], 0.51) == 2.0


def test_buckets_count_each_step_once_at_its_upper_bound() -> None:
    d = sorted([0.0, 0.001, 0.0011, 0.0025, 0.026, 0.026, 599.0, 600.0, 600.5, 1e6])
    b = buckets(d)
    assert len(b) == NB and sum(b) == len(d)
    assert b[0] == 2  # 0 and exactly 1 ms: le 0.001, as Prometheus counts
    assert b[1] == 2  # 1.1 ms and exactly 2.5 ms
    assert b[P.STEP_BUCKETS.index(0.05)] == 2
    assert b[-2] == 2  # 599 and 600 s: le 600
    assert b[-1] == 2  # above the last bound
    assert buckets([]) == [0] * NB


def test_no_steps_is_a_ledger_of_zeros() -> None:
    lg = valid(summarize([], n=0, total=0.0, at=7, epoch=3))
    assert lg == {"at": 7, "n": 0, "sum": 0.0, "q": [0.0] * 4, "b": [0] * NB, "r": [], "epoch": 3,
                  "wait": None}  # fmt: skip


def test_values_the_wire_refuses_are_clamped_not_sent() -> None:
    lg = valid(
        summarize(
            [-1.0, math.nan, 2e12],
            n=P.MAX_STEP + 5,
            total=math.inf,
            at=-1,
            epoch=0,
            regions=[("a", -0.5, -1), ("b", 1e13, P.MAX_STEP + 1)],
        )
    )
    assert lg["q"][-1] == P.MAX_SECONDS and lg["q"][0] == 0.0
    assert lg["n"] == P.MAX_STEP and lg["at"] == 0 and lg["sum"] == 0.0
    assert lg["r"] == [["b", P.MAX_SECONDS, P.MAX_STEP], ["a", 0.0, 0]]


def test_regions_with_most_time_first_and_bounded() -> None:
    regions = [(f"r{i:03d}", float(i), i) for i in range(100)]
    r = summarize([], n=0, total=0.0, at=0, epoch=0, regions=regions)["r"]
    assert len(r) == P.MAX_LEDGER_REGIONS
    assert [x[0] for x in r[:3]] == ["r099", "r098", "r097"] and r[-1][0] == "r068"
    # Names of 4-byte characters: the name budget, not the count, decides; a short name with
    # less time still fits after the long ones stop fitting.
    long = [(chr(0x10000 + i) * P.MAX_NAME, 100.0 - i, 1) for i in range(40)]
    r = summarize([], n=0, total=0.0, at=0, epoch=0, regions=[*long, ("fwd", 1.0, 9)])["r"]
    assert sum(len(x[0].encode()) for x in r) <= REGION_NAME_BYTES
    assert r[-1] == ["fwd", 1.0, 9] and len(r) == REGION_NAME_BYTES // (4 * P.MAX_NAME) + 1


def test_a_heartbeat_stays_within_16_kib_at_any_rate_and_region_count() -> None:
    worst_names = [(chr(0x10000 + i) * P.MAX_NAME, P.MAX_SECONDS, P.MAX_STEP) for i in range(500)]
    lg = summarize(
        [P.MAX_SECONDS - i for i in range(P.LEDGER_RING)],
        n=P.MAX_STEP,
        total=P.MAX_SECONDS,
        at=P.MAX_STEP,
        epoch=(1 << 31) - 1,
        regions=worst_names,
    )
    lg["b"] = [P.MAX_STEP] * NB  # more than any ring holds: the widest integers
    frame = P.encode(P.HEARTBEAT, step=P.MAX_STEP, sps=P.MAX_RATE, state="region-wait", ledger=lg)
    assert len(frame) <= 16 * 1024, len(frame)
    # And through the real path: 100,000 steps and more names than are timed, all of the
    # longest, between two heartbeats.
    st, clock = stepper()
    rd = Reader(st)
    for i in range(P.MAX_LEDGER_REGIONS + 5):
        with api_region(st, chr(0x10000 + i) * P.MAX_NAME):
            clock.now += 1.0
    steps(st, clock, 100_000, 1e-4)
    lg = rd.take()
    assert lg is not None and lg["n"] == 100_000 - 1 and lg["r"]  # step 1 is not timed
    frame = P.encode(P.HEARTBEAT, step=st.count, sps=1e4, state="idle", ledger=lg)
    assert len(frame) <= 16 * 1024, len(frame)


# --- reading the ring ------------------------------------------------------------------------
def test_every_step_after_the_first_is_timed() -> None:
    st, clock = stepper()
    rd = Reader(st)
    clock.now += 30.0  # from attach() to step 1's end: loading, building: no step time
    steps(st, clock, 4, 0.020)
    clock.now += 0.5  # between heartbeats, no step ends: nothing is counted for it
    lg = valid(rd.take() or {})
    # Step 1's end began epoch 1: steps 2..4 are timed.
    assert lg["n"] == 3 and lg["at"] == 4 and lg["epoch"] == 1
    assert lg["q"] == pytest.approx([0.020] * 4) and lg["sum"] == pytest.approx(0.060)
    assert lg["b"][P.STEP_BUCKETS.index(0.025)] == 3
    steps(st, clock, 2, 0.010)
    lg = valid(rd.take() or {})
    # The first step after the gap took the gap too: it ended 0.51 s after the one before.
    assert lg["n"] == 2 and lg["at"] == 6 and lg["q"] == pytest.approx([0.01, 0.51, 0.51, 0.51])
    assert lg["sum"] == pytest.approx(0.52)
    lg = valid(rd.take() or {})
    assert lg["n"] == 0 and lg["at"] == 6 and lg["sum"] == 0.0


def test_more_steps_than_the_ring_holds_between_heartbeats() -> None:
    st, clock = stepper()
    rd = Reader(st)
    steps(st, clock, 6000, 0.001)
    steps(st, clock, 6000, 0.003)
    lg = valid(rd.take() or {})
    assert lg["n"] == 12_000 - 1 and lg["at"] == 12_000  # all but the untimed step 1
    assert lg["sum"] == pytest.approx(6.0 - 0.001 + 18.0)  # every step, from the last shipped
    # The statistics cover the steps still in the ring: the last ones, all 3 ms.
    assert P.LEDGER_RING - 2 <= sum(lg["b"]) <= P.LEDGER_RING
    assert lg["q"] == pytest.approx([0.003] * 4)


def test_slots_the_training_thread_overwrote_while_read_are_dropped() -> None:
    st, clock = stepper()

    class Racing(Reader):
        """The training thread runs nearly the whole ring's steps (of 5 ms) more while the
        agent copies."""

        def _slots(self, first: int, last: int) -> list[float]:
            if st.count == 100:
                steps(st, clock, RING - 6, 0.005)
            return super()._slots(first, last)

    rd = Racing(st)
    steps(st, clock, 100, 0.001)
    lg = valid(rd.take() or {})
    assert lg["n"] == 99 and lg["at"] == 100 and lg["sum"] == pytest.approx(0.099)
    assert 0 < sum(lg["b"]) < 99  # only the slots no step of the race can have written
    assert lg["q"] == pytest.approx([0.001] * 4)  # none of the 5 ms slots
    lg = valid(rd.take() or {})
    assert lg["n"] == RING - 6 and lg["q"] == pytest.approx([0.005] * 4)


def test_a_jump_starts_a_new_epoch_timed_from_the_jump() -> None:
    st, clock = stepper()
    rd = Reader(st)
    steps(st, clock, 5, 0.010)
    clock.now += 7.0
    st.set_step(1000)  # resumed: 1000 steps done
    steps(st, clock, 4, 0.030)
    lg = valid(rd.take() or {})
    # The 5 steps before the jump are not shipped and the 7 s around it are no step's.
    assert lg["epoch"] == 2 and lg["at"] == 1004 and lg["n"] == 4
    assert lg["q"] == pytest.approx([0.030] * 4) and lg["sum"] == pytest.approx(0.12)
    st.set_step(1005)  # the loop's own counter, one step on: a step, not a jump
    clock.now += 0.040
    st.set_step(1006)
    lg = valid(rd.take() or {})
    assert lg["epoch"] == 2 and lg["n"] == 2 and lg["q"][-1] == pytest.approx(0.040)
    st.set_step(3)  # backwards too
    steps(st, clock, 1, 0.050)
    lg = valid(rd.take() or {})
    assert lg["epoch"] == 3 and lg["at"] == 4 and lg["n"] == 1
    assert lg["q"] == pytest.approx([0.050] * 4)


def test_a_jump_while_the_agent_reads_waits_for_the_next_heartbeat() -> None:
    st, clock = stepper()

    class Racing(Reader):
        def _slots(self, first: int, last: int) -> list[float]:
            if st.count == 10:
                st.set_step(500)
            return super()._slots(first, last)

    rd = Racing(st)
    steps(st, clock, 10, 0.010)
    assert rd.take() is None
    steps(st, clock, 3, 0.020)
    lg = valid(rd.take() or {})
    assert lg["epoch"] == 2 and lg["at"] == 503 and lg["n"] == 3
    assert lg["q"] == pytest.approx([0.020] * 4)


def test_restart_ships_only_what_follows() -> None:
    st, clock = stepper()
    rd = Reader(st)
    steps(st, clock, 50, 0.010)
    with api_region(st, "fwd"):
        clock.now += 1.0
    rd.restart()  # a hello: the daemon learns of this process now
    steps(st, clock, 2, 0.020)
    lg = valid(rd.take() or {})
    # Step 51 ran from step 50's end, before the restart: its time is all there.
    assert lg["n"] == 2 and lg["at"] == 52 and lg["sum"] == pytest.approx(1.04)
    assert lg["q"] == pytest.approx([0.02, 1.02, 1.02, 1.02]) and lg["r"] == []


# --- regions --------------------------------------------------------------------------------------
def api_region(st: Stepper, name: Any) -> Any:
    """``profd_client.region(name)`` in a process attached with ``st``."""
    saved, api._stepper = api._stepper, st
    try:
        return api.region(name)
    finally:
        api._stepper = saved


def test_region_time_and_entries_per_heartbeat() -> None:
    st, clock = stepper()
    st.tick()  # step 1: not timed
    rd = Reader(st)
    for _ in range(3):
        with api_region(st, "fwd"):
            clock.now += 0.010
        with api_region(st, "opt"):
            clock.now += 0.002
        clock.now += 0.003
        st.tick()
    lg = valid(rd.take() or {})
    assert lg["r"] == [["fwd", pytest.approx(0.030), 3], ["opt", pytest.approx(0.006), 3]]
    assert lg["sum"] == pytest.approx(0.045)
    with api_region(st, "opt"):
        clock.now += 0.5
    lg = valid(rd.take() or {})
    assert lg["r"] == [["opt", pytest.approx(0.5), 1]]  # only what changed, as deltas
    assert valid(rd.take() or {})["r"] == []


def test_nested_entries_of_one_name_count_once() -> None:
    st, clock = stepper()
    outer = api_region(st, "gen")
    assert isinstance(outer, RegionTimer) and api_region(st, "gen") is outer  # reused
    with outer:
        clock.now += 1.0
        with api_region(st, "gen"):  # recursion
            clock.now += 2.0
            with api_region(st, "inner"):
                clock.now += 4.0
        clock.now += 8.0
    assert (outer.seconds, outer.entries) == (15.0, 1)
    assert (st.regions["inner"].seconds, st.regions["inner"].entries) == (4.0, 1)
    # An exception leaves the block: timed, and it propagates.
    with pytest.raises(KeyError), outer:
        clock.now += 16.0
        raise KeyError("x")
    assert (outer.seconds, outer.entries) == (31.0, 2)
    assert not outer._open


def test_the_first_names_are_timed_and_unsendable_names_are_not() -> None:
    st, _ = stepper()
    for i in range(P.MAX_LEDGER_REGIONS):
        assert isinstance(api_region(st, f"r{i}"), RegionTimer)
    assert api_region(st, "one-too-many") is NULL_REGION
    assert isinstance(api_region(st, "r0"), RegionTimer)  # the first seen keep theirs
    st, _ = stepper()
    for bad in ("", "x" * (P.MAX_NAME + 1), "\ud800", 7, None, ["a"]):
        assert api_region(st, bad) is NULL_REGION, bad
    assert st.regions == {}
    assert isinstance(api_region(st, "x" * P.MAX_NAME), RegionTimer)


def test_not_attached_regions_are_the_shared_no_op() -> None:
    assert api._stepper is None
    assert api.region("fwd") is NULL_REGION
