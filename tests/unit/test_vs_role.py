"""``top``'s comparison of each rank with its role (``vs_role``, ``marked``) and its order, on
synthetic ranks from 2 to 8,192: exact against a brute-force median of the others, no rank
marked in steady ±10 % jitter, the one rank 1.5x slower marked at every size."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest

from profd.watch.stats import FAR, mark_vs_role, slowest_first, top_order, vs_role

SIZES = (2, 3, 8, 64, 1024, 8192)


def _brute(groups: list[str], p50s: list[float | None]) -> list[tuple[float | None, bool]]:
    out: list[tuple[float | None, bool]] = []
    for i, (g, p) in enumerate(zip(groups, p50s, strict=True)):
        others = [
            q for j, (h, q) in enumerate(zip(groups, p50s, strict=True))
            if j != i and h == g and q is not None and q > 0
        ]  # fmt: skip
        if p is None or p <= 0 or not others:
            out.append((None, False))
            continue
        ratio = p / statistics.median(others)
        out.append((round(ratio, 3), ratio > 1.0 + FAR))
    return out


@pytest.mark.parametrize("n", SIZES[:5])  # brute force is quadratic: 8,192 below, by rule
def test_vs_role_is_each_ranks_p50_over_the_median_of_its_roles_others(n: int) -> None:
    rnd = random.Random(n)
    groups = [rnd.choice("ab") for _ in range(n)]
    p50s: list[float | None] = [
        None if rnd.random() < 0.05 else rnd.uniform(5.0, 15.0) for _ in range(n)
    ]
    assert vs_role(groups, p50s) == _brute(groups, p50s)


@pytest.mark.parametrize("n", SIZES)
def test_steady_jittery_ranks_are_never_marked_and_one_slow_rank_always_is(n: int) -> None:
    rnd = random.Random(n)
    marked_steady = 0
    for _ in range(20):
        p50s: list[float | None] = [100.0 * rnd.uniform(0.9, 1.1) for _ in range(n)]
        marked_steady += sum(m for _, m in vs_role(["r"] * n, p50s))
        slow = rnd.randrange(n)
        p50s[slow] = 150.0 * rnd.uniform(0.9, 1.1)
        marks = vs_role(["r"] * n, p50s)
        assert [i for i, (_, m) in enumerate(marks) if m] == [slow]
    assert marked_steady == 0  # ±10 % can never be 25 % over the others' median


def test_ranks_without_a_p50_are_unmarked_and_left_out_of_the_others_median() -> None:
    marks = vs_role(["r", "r", "r", "s"], [10.0, None, 20.0, 30.0])
    assert marks == [(0.5, False), (None, False), (2.0, True), (None, False)]
    assert vs_role(["r", "r"], [0.0, 10.0]) == [(None, False), (None, False)]


def test_dict_rows_and_the_order_agree_with_vs_role() -> None:
    rnd = random.Random(7)
    rows: list[dict[str, Any]] = [
        {"host": "h", "job": "j", "role": rnd.choice(["a", "b"]), "rank": i,
         "step_ms_p50": rnd.uniform(5.0, 15.0)}
        for i in range(64)
    ]  # fmt: skip
    mark_vs_role(rows)
    expected = vs_role([(r["job"], r["role"]) for r in rows], [r["step_ms_p50"] for r in rows])
    assert [(r["vs_role"], r["marked"]) for r in rows] == expected
    ordered = slowest_first(rows)
    keys = [
        top_order(r["vs_role"], r["step_ms_p50"], r["host"], r["job"], r["role"], r["rank"])
        for r in ordered
    ]
    assert keys == sorted(keys) and ordered[0]["vs_role"] == max(v for v, _ in expected if v)
