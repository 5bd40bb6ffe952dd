"""``top``'s figures and steps as of now, on synthetic heartbeats: the ring read by slices and
running sums gives what a walk over every interval gives, wrapped or not, fresh or silent."""

from __future__ import annotations

import random
from typing import Any

from test_daemon_ledger import Clock, client, ledger

from profd.daemon.clients.ledger import FULL, TOP_WINDOW_S, Ledgers
from profd.daemon.clients.registry import FRESH_HEARTBEATS, Registry, step_now
from profd_client import protocol as P


def reference(beats: list[tuple[float, list[float], dict[str, float]]], now: float) -> Any:
    """The figures by a walk over the intervals ``top`` covers (the last FULL heartbeats,
    ended at ``now - TOP_WINDOW_S`` or later)."""
    window = [b for b in beats[-FULL:] if b[0] >= now - TOP_WINDOW_S]
    if not window:
        return None
    meds = sorted(sorted(ds)[min(len(ds) - 1, len(ds) // 2)] for _, ds, _ in window)
    p99s = sorted(sorted(ds)[min(len(ds) - 1, int(0.99 * len(ds)))] for _, ds, _ in window)
    total = sum(sum(ds) for _, ds, _ in window)
    regions: dict[str, float] = {}
    for _, _, r in window:
        for k, v in r.items():
            regions[k] = regions.get(k, 0.0) + v
    return (
        meds[len(meds) // 2] * 1000,
        p99s[min(len(p99s) - 1, int(len(p99s) * 0.99))] * 1000,
        now - window[0][0],
        {k: min(round(v / total, 4), 1.0) for k, v in regions.items() if v > 0},
    )


def test_figures_match_a_walk_over_the_intervals_wrapped_and_silent() -> None:
    rng = random.Random(7)
    clock = Clock(1_800_000_000.0)
    led = Ledgers(clock)
    c = client()
    beats: list[tuple[float, list[float], dict[str, float]]] = []
    t, step = 500.0, 0
    # Uneven heartbeats, in phases of 10 a second (the minute's window outgrows the ring),
    # a region that comes and goes, intervals without regions: the ring wraps several times.
    for i in range(FULL * 3 + 17):
        t += 0.1 if (i // 200) % 2 == 0 else rng.choice((0.12, 0.2, 0.5, 1.0, 1.7))
        clock.t += 1.0
        ds = [rng.uniform(0.01, 0.2) for _ in range(rng.randint(1, 9))]
        step += len(ds)
        r = {"data": 0.3 * sum(ds)} if i % 7 else {}  # some intervals enter no region
        if i % 50 < 20:
            r["fwd"] = 0.5 * sum(ds)
        led.heartbeat(c, step, ledger(ds, step, list((k, v, 1) for k, v in r.items())), t)
        beats.append((t, ds, r))
        if i % 37 == 0 or i > FULL * 3:
            for later in (0.0, 0.4, 7.0, 33.0):  # fresh, then silent for a while
                f = led.figures(c, t + later)
                want = reference(beats, t + later)
                assert want is not None
                assert (f.p50_ms, f.p99_ms) == (want[0], want[1]), (i, later)
                assert abs((f.window_s or 0) - want[2]) < 1e-9
                assert f.regions.keys() == want[3].keys(), (i, later, f.regions, want[3])
                for k, v in want[3].items():
                    assert abs(f.regions[k] - v) <= 1e-4, (k, f.regions[k], v)
    # Silent for longer than the window: nothing to show, but still a ledger rank.
    gone = led.figures(c, t + TOP_WINDOW_S + 1)
    assert gone.source == "ledger" and gone.p50_ms is None and gone.regions == {}


def test_step_now_moves_on_at_the_rate_while_heartbeats_are_fresh() -> None:
    c = client()
    c.step, c.step_at, c.sps = 1000, 50.0, 100.0
    assert step_now(c, 50.0, 1.0) == (1000, True, 0.0)
    assert step_now(c, 50.5, 1.0) == (1050, True, 0.5)
    # Three heartbeat intervals without one: the rank may have stopped; its age says how old.
    step, moved, age = step_now(c, 50.0 + FRESH_HEARTBEATS * 1.0, 1.0)
    assert (step, moved) == (1000, False) and age == FRESH_HEARTBEATS
    assert step_now(c, 54.0, 2.0)[:2] == (1400, True)  # a longer interval waits longer
    c.sps = 0.0
    assert step_now(c, 50.5, 1.0)[:2] == (1000, False)  # no rate: nothing to move on by
    c.step, c.sps = P.MAX_STEP - 1, P.MAX_RATE
    assert step_now(c, 51.0, 1.0)[0] == P.MAX_STEP  # never past the protocol's bound
    assert step_now(c, 49.0, 1.0)[2] == 0.0  # a clock read before the heartbeat's


def test_registry_heartbeats_feed_step_now() -> None:
    reg = Registry()
    c = client()
    c.step_at = 9.0  # its hello
    reg.add(c)
    reg.heartbeat(c, 10.0, 100, 50.0, "idle")
    reg.heartbeat(c, 11.0, 150, 50.0, "idle")  # observed 50 steps/s over a second
    assert step_now(c, 11.5, 1.0) == (175, True, 0.5)
