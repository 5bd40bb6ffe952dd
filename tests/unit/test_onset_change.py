"""Where a regression began, from one rank's black box (``onset.change_step``): the first
step from which step times stay higher, not the first burst of slow steps."""

from __future__ import annotations

import random
from typing import Any

import pytest

from profd.blackbox.onset import ROLLING, change_step, onset


def box(times: list[float], step0: int = 100) -> dict[str, Any]:
    ends = [0.0]
    for t in times:
        ends.append(ends[-1] + t)
    return {"step0": step0, "ends": ends}


def jittery(n: int, ms: float, rng: random.Random, jitter: float = 0.1) -> list[float]:
    return [ms / 1000 * (1 + rng.uniform(-jitter, jitter)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_a_burst_before_the_change_is_not_its_onset(seed: int) -> None:
    rng = random.Random(seed)
    # 300 steady steps of 40 ms with a burst of 10 steps at 70 ms at step 150 (a neighbour's
    # work), then from step 300 on every step 60 ms (1.5x): the onset is 300.
    times = jittery(300, 40, rng) + jittery(200, 60, rng)
    times[150:160] = jittery(10, 70, rng)
    c = change_step(box(times, step0=0), ratio=1.5)
    assert c is not None
    # Step s's time is times[s - 1] (the box's first end is the first step's start): the
    # first slow step is 301, and a rolling median of 8 crosses up to 4 steps before it.
    assert abs(c["step"] - 301) <= ROLLING, c
    assert c["after_ms"] > 1.3 * c["before_ms"], c


@pytest.mark.parametrize("seed", range(20))
def test_steady_jittery_steps_with_bursts_have_no_change(seed: int) -> None:
    rng = random.Random(seed)
    times = jittery(600, 40, rng, jitter=0.2)
    for at in (100, 300, 500):
        times[at : at + 10] = jittery(10, 80, rng)
    assert change_step(box(times), ratio=1.5) is None


def test_a_change_to_the_end_of_the_box_is_found() -> None:
    rng = random.Random(1)
    times = jittery(200, 40, rng) + jittery(40, 60, rng)
    c = change_step(box(times, step0=0), ratio=1.5)
    assert c is not None and abs(c["step"] - 201) <= ROLLING, c


# --- the job's onset over every rank's box (``onset``), from 2 to 8,192 ranks ---------------


def full_box(times: list[float]) -> dict[str, Any]:
    return {**box(times, step0=0), "records": [], "regions": [], "samples": [], "frames": [],
            "stacks": [], "collectives": []}  # fmt: skip


def noisy_rank(rng: random.Random, n: int, change_at: int | None = None) -> list[float]:
    """40 ms steps ±10 %, one step in 20 1.5-3x slower (a heavy tail), one burst of 10
    steps at 2x somewhere after the first quarter; from ``change_at`` on, 1.5x slower."""
    out = []
    for i in range(n):
        t = 0.040 * (1 + rng.uniform(-0.1, 0.1))
        if rng.random() < 0.05:
            t *= rng.uniform(1.5, 3.0)
        if change_at is not None and i >= change_at:
            t *= 1.5
        out.append(t)
    b = rng.randrange(n // 4, n - 10)
    out[b : b + 10] = [t * 2 for t in out[b : b + 10]]
    return out


#: (ranks, trials): the false-alarm rate is counted over the trials' boxes.
SCALES = [(2, 30), (8, 30), (64, 10), (1024, 2), (8192, 1)]


@pytest.mark.parametrize(("ranks", "trials"), SCALES, ids=[f"{r}-ranks" for r, _ in SCALES])
def test_steady_heavy_tailed_ranks_with_bursts_never_show_a_change(ranks: int, trials: int) -> None:
    rng = random.Random(ranks)
    seen = [onset([full_box(noisy_rank(rng, 256)) for _ in range(ranks)], 255, "regression", 1.5)
            for _ in range(trials)]  # fmt: skip
    alarms = sum("change" in doc for doc in seen)
    assert alarms == 0, f"{alarms} false changes in {trials} trials of {ranks} ranks"


@pytest.mark.parametrize(("ranks", "trials"), SCALES, ids=[f"{r}-ranks" for r, _ in SCALES])
def test_a_job_wide_change_is_found_within_the_rolling_window(ranks: int, trials: int) -> None:
    rng = random.Random(ranks + 1)
    for _ in range(trials):
        boxes = [full_box(noisy_rank(rng, 256, change_at=160)) for _ in range(ranks)]
        change = onset(boxes, 255, "regression", 1.5).get("change")
        # times[160] is step 161: the first slower one.
        assert change is not None and abs(change["step"] - 161) <= ROLLING, change
