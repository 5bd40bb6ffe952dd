"""The daemon's step ledger (profd.daemon.clients.ledger) on synthetic heartbeats."""

from __future__ import annotations

import random
from bisect import bisect_left
from typing import Any

import msgspec

from profd.daemon.clients.ledger import FULL, MINUTES, Ledgers
from profd.daemon.clients.registry import Client
from profd_client import protocol as P


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def client(rank: int = 0, pid: int = 100, role: str = "main") -> Client:
    return Client(
        ident=b"x%d" % pid, host="h", pid=pid, job="j", role=role, rank=rank, local_rank=rank,
        world_size=4, step_mode="optimizer", allowed=True, torch=None, device=None,
    )  # fmt: skip


def ledger(durations: list[float], at: int, regions: Any = (), epoch: int = 0) -> P.Ledger:
    s = sorted(durations)

    def q(x: float) -> float:
        return s[min(len(s) - 1, int(x * len(s)))]

    b = [0] * (len(P.STEP_BUCKETS) + 1)
    for d in durations:
        b[bisect_left(P.STEP_BUCKETS, d)] += 1
    msg = {"at": at, "n": len(durations), "sum": sum(durations), "b": b,
           "q": [q(0.5), q(0.9), q(0.99), s[-1]], "r": [list(r) for r in regions],
           "epoch": epoch}  # fmt: skip
    return msgspec.convert(msg, P.Ledger)  # what the daemon gets: validated, typed


def feed(led: Ledgers, c: Client, clock: Clock, seconds: int, step_s: float, jitter: float,
         rng: random.Random, start_step: int = 0, mono0: float = 1000.0) -> int:  # fmt: skip
    step = start_step
    per_hb = max(1, round(1.0 / step_s))
    for i in range(seconds):
        ds = [step_s * (1 + rng.uniform(-jitter, jitter)) for _ in range(per_hb)]
        step += per_hb
        clock.t += 1.0
        led.heartbeat(c, step, ledger(ds, step, [("data", 0.25 * sum(ds), per_hb)]), mono0 + i)
    return step


def test_figures_over_the_last_minute_match_the_steps() -> None:
    rng = random.Random(1)
    clock = Clock(1_800_000_000.0)
    led = Ledgers(clock)
    c = client()
    feed(led, c, clock, 90, 0.030, 0.1, rng)
    f = led.figures(c, 1000.0 + 89)
    assert f.source == "ledger"
    assert f.p50_ms is not None and abs(f.p50_ms - 30.0) < 3.0
    assert f.p99_ms is not None and 30.0 < f.p99_ms <= 33.0 + 1e-9
    assert f.window_s is not None and f.window_s <= 60.0
    assert abs(f.regions["data"] - 0.25) < 0.01


def test_a_protocol_2_client_is_timed_by_its_rate() -> None:
    led = Ledgers(Clock(0.0))
    c = client()
    c.sps = 50.0
    led.heartbeat(c, 100, None, 1.0)
    led.heartbeat(c, 150, None, 2.0)
    f = led.figures(c, 2.0)
    assert f.source == "rate" and f.p50_ms == 20.0 and f.p99_ms is None
    (series,) = led.series([c])
    assert series.steps == 150 and series.buckets == ()


def test_minutes_close_on_the_wall_clock_and_when_a_rank_leaves() -> None:
    rng = random.Random(2)
    clock = Clock(1_800_000_000.0)  # a minute boundary
    led = Ledgers(clock)
    c = client()
    feed(led, c, clock, 150, 0.1, 0.0, rng)
    led.tick([c])
    done = led.take_minutes()
    assert [m.minute % 60 for m in done] == [0, 0]
    assert done[0].steps == 590 and done[1].steps == 600  # the first heartbeat lands at +1 s
    assert abs((done[1].p50_ms or 0) - 100.0) < 1e-6
    assert abs(done[1].regions["data"] - 15.0) < 1e-6
    led.tick([])  # it left: the minute it was in is written too
    (last,) = led.take_minutes()
    assert last.steps == 310 and len(led) == 0  # +120 s .. +150 s


def test_memory_is_bounded_by_the_per_rank_budget() -> None:
    rng = random.Random(3)
    clock = Clock(1_800_000_000.0)
    led = Ledgers(clock)
    c = client()
    feed(led, c, clock, FULL * 3, 0.5, 0.05, rng)
    led.tick([c])
    r = led.by_key[c.key]
    assert r.size == FULL and len(r.ring) == 9 * FULL  # 9 floats an interval
    assert len(led.recent_minutes(c)) == min(MINUTES, (FULL * 3) // 60)
    assert len(r.window_regions) <= 61


def test_a_step_jump_counts_only_steps_run_and_a_new_identity_starts_a_new_ledger() -> None:
    clock = Clock(1_800_000_000.0)
    led = Ledgers(clock)
    c = client()
    led.heartbeat(c, 10, ledger([0.1] * 10, 10), 1.0)
    # step(4999) in between: the client times the step after the jump, and the 4,989 steps
    # jumped over are none it ran.
    led.heartbeat(c, 5000, ledger([0.1], 5000, epoch=1), 2.0)
    assert led.series([c])[0].steps == 11
    c.rank = 3  # re-registered as another rank
    led.heartbeat(c, 5010, ledger([0.1] * 10, 5010, epoch=1), 3.0)
    (first,) = led.take_minutes()
    assert first.rank == 0 and first.steps == 11
    assert led.series([c])[0].steps == 10


def test_histogram_counts_add_up_and_regions_accumulate() -> None:
    rng = random.Random(4)
    clock = Clock(1_800_000_000.0)
    led = Ledgers(clock)
    c = client()
    feed(led, c, clock, 30, 0.02, 0.3, rng)
    (s,) = led.series([c])
    assert sum(s.buckets) == s.steps == 30 * 50
    assert abs(s.sum_s - 30.0) < 1.0
    assert dict(s.regions)["data"] > 7.0


def test_region_names_past_the_cap_count_as_other() -> None:
    clock = Clock(1_800_000_000.0)
    led = Ledgers(clock, max_regions=4)
    c = client()
    for i in range(20):  # ten new names a heartbeat, 0.01 s each
        names = [(f"r{i}-{j}", 0.01, 1) for j in range(10)]
        led.heartbeat(c, i + 1, ledger([0.1], i + 1, names), 1000.0 + i)
    assert led.regions_folded == 20 * 10 - 4
    (s,) = led.series([c])
    regions = dict(s.regions)
    assert set(regions) == {"r0-0", "r0-1", "r0-2", "r0-3", "(other)"}
    assert abs(sum(regions.values()) - 2.0) < 1e-9  # no time lost, only names
    assert abs(regions["(other)"] - (2.0 - 0.04)) < 1e-9
    led.tick([])  # the rank left: its minute goes to the index with the same five names
    (minute,) = led.take_minutes()
    assert set(minute.regions) == set(regions)


def test_heartbeats_over_the_rate_are_coalesced_and_nothing_is_lost() -> None:
    clock = Clock(1_800_000_000.0)
    led = Ledgers(clock, rate=2.0)
    c = client()
    for i in range(100):  # a hundred heartbeats within half a second
        led.heartbeat(c, 10 * (i + 1), ledger([0.05] * 10, 10 * (i + 1), [("data", 0.1, 1)]),
                      1000.0 + i * 0.005)  # fmt: skip
    assert led.coalesced == 100 - 2  # the burst of 2, then nothing refilled a token
    r = led.by_key[c.key]
    assert r.size == 2 and r.held is not None
    led.tick([c], now=1001.0)  # the next tick applies what was held back, as one interval
    assert r.size == 3 and r.held is None
    (s,) = led.series([c])
    assert s.steps == sum(s.buckets) == 1000
    assert abs(s.sum_s - 50.0) < 1e-6 and abs(dict(s.regions)["data"] - 10.0) < 1e-6
    f = led.figures(c, 1001.0)
    assert f.p50_ms is not None and abs(f.p50_ms - 50.0) < 1e-6
    # Over the rate again after a pause of a second: two tokens are back.
    led.heartbeat(c, 1010, ledger([0.05] * 10, 1010), 1002.0)
    led.heartbeat(c, 1020, ledger([0.05] * 10, 1020), 1002.0)
    assert led.coalesced == 98 and r.size == 5


def test_minutes_in_memory_and_the_detectors_read_name_what_they_hold() -> None:
    rng = random.Random(5)
    clock = Clock(1_800_000_000.0)
    led = Ledgers(clock)
    c = client()
    feed(led, c, clock, 150, 0.1, 0.0, rng)  # heartbeats of 10 steps at monotonic 1000..1149
    led.tick([c])
    written = led.take_minutes()
    assert len(written) == 2
    kept = led.recent_minutes(c)
    assert [(r.start, r.steps, r.sum_s) for r in kept] == [
        (m.minute, m.steps, m.sum_s) for m in written
    ]
    assert all(
        abs(r.p50_s * 1000.0 - (m.p50_ms or 0)) < 1e-9 for r, m in zip(kept, written, strict=True)
    )
    w = led.watch(c, since=1148.0, window_from=1149.0 - 60.0, q=0.5)
    assert w.tick_steps == 10 and w.tick_ms is not None and abs(w.tick_ms - 100.0) < 1e-6
    assert w.window_steps == 600 and w.window_ms is not None and abs(w.window_ms - 100.0) < 1e-6
    assert w.epoch == 0
    # A shorter window than top's is read from the ring: the same figures.
    short = led.watch(c, since=1148.0, window_from=1149.0 - 10.0, q=0.5)
    assert short.window_steps == 100 and short.window_ms == w.window_ms
