"""The heartbeat pace's levels (pure): the interval every attached process is told, from how
many attach; tests/test_heartbeat_pace.py runs it on a real daemon and a real client."""

from __future__ import annotations

import pytest

from profd.daemon.agent.pace import MAX_PACED_S, HeartbeatPace


def paced(n: int, base: float = 1.0, rate: float = 256.0) -> HeartbeatPace:
    pace = HeartbeatPace(base, rate, 10)
    pace.update(n, 0.0)
    return pace


@pytest.mark.parametrize(
    ("clients", "interval"),
    [(0, 1.0), (8, 1.0), (256, 1.0), (257, 2.0), (512, 2.0), (513, 4.0), (1024, 4.0),
     (1025, 8.0), (100_000, 8.0)],
)  # fmt: skip
def test_the_interval_doubles_past_the_rate_up_to_its_cap(clients: int, interval: float) -> None:
    assert paced(clients).interval == interval


def test_every_count_up_to_the_cap_fits_the_rate() -> None:
    for n in range(1, 2048 + 1):  # 256 a second at 8 s
        pace = paced(n)
        assert n / pace.interval <= 256.0, n
        # ... and at the lowest pace that does: half of it would not.
        if pace.factor > 1:
            assert n / (pace.interval / 2) > 256.0, n
    assert paced(2049).interval == MAX_PACED_S  # past the cap the rate may be passed


def test_it_comes_down_only_well_below_the_lower_pace() -> None:
    pace = paced(600)
    assert pace.interval == 4.0
    assert not pace.update(500, 1.0)  # fits 2 s (512) but not three quarters of it (384)
    assert pace.update(384, 2.0) and pace.interval == 2.0
    assert pace.update(10, 3.0) and pace.interval == 1.0


def test_a_count_hovering_at_a_threshold_changes_the_pace_once() -> None:
    pace = paced(256)
    changes = sum(pace.update(256 + i % 2, float(i)) for i in range(1000))
    assert changes == 1 and pace.interval == 2.0


def test_a_zero_rate_never_paces() -> None:
    pace = paced(1_000_000, rate=0.0)
    assert pace.interval == 1.0 and pace.timeout(0.0) == 3.0


@pytest.mark.parametrize(("base", "most"), [(0.5, 8.0), (2.0, 8.0), (3.0, 6.0), (10.0, 10.0)])
def test_a_slower_base_is_paced_less_and_never_past_the_cap(base: float, most: float) -> None:
    assert paced(1_000_000, base=base).interval == most


def test_quiet_answers_keep_their_period_in_seconds() -> None:
    assert [paced(n).acks for n in (1, 300, 600, 2000)] == [10, 5, 2, 1]


def test_a_shorter_pace_keeps_the_longer_timeout_until_everyone_could_have_heard() -> None:
    pace = paced(1024)
    assert pace.timeout(0.0) == 12.0
    assert pace.update(1, 100.0) and pace.interval == 1.0
    # A process told 4 s heartbeated just before the news: it may stay silent ~4 s more.
    assert pace.timeout(100.0) == pace.timeout(111.9) == 12.0
    assert pace.timeout(112.0) == 3.0


def test_a_longer_pace_takes_its_timeout_at_once() -> None:
    pace = paced(1)
    assert pace.update(1024, 5.0)
    assert pace.timeout(5.0) == 12.0
