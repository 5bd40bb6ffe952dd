"""Step-time statistics shared by the daemon (one node) and profctl (``--cluster``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

#: A rank is marked in ``top`` when its p50 is this much slower than its role's other ranks
#: (the ``slow_rank`` default of ``[watch]``).
FAR = 0.25


def weighted_quantile(pairs: Iterable[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of values given as ``(value, weight)``; None when no weight.

    Used to combine per-heartbeat quantiles into a minute's: exact for steady data, and for
    unsteady data a quantile of the intervals' quantiles, weighted by their steps.
    """
    items = sorted((v, w) for v, w in pairs if w > 0)
    total = sum(w for _, w in items)
    if total <= 0:
        return None
    want = q * total
    acc = 0.0
    for v, w in items:
        acc += w
        if acc >= want:
            return v
    return items[-1][0]


def sorted_median(xs: Sequence[float]) -> float:
    """The median of values already sorted (no copy, no sort)."""
    n = len(xs)
    m = n // 2
    return xs[m] if n % 2 else (xs[m - 1] + xs[m]) / 2.0


def others_medians(values: Sequence[float]) -> list[float | None]:
    """For each value, the median of all the others (None when there are none).

    Leave-one-out, so at 2 ranks a rank is compared with its peer rather than with a median
    it pulls halfway towards itself (the straggler rule's lesson). O(n log n): once sorted,
    a value's others' median is one of three, by where the value sits (the detectors ask
    this of 1,024 ranks every tick).
    """
    n = len(values)
    if n < 2:
        return [None] * n
    order = sorted(range(n), key=values.__getitem__)
    s = [values[i] for i in order]
    m = n - 1  # how many others
    out: list[float | None] = [None] * n
    if m % 2:
        # The others' middle is their k-th: s[k] when the value sits above it, else s[k+1].
        k = m // 2
        low, high = s[k], s[k + 1]
        for j, i in enumerate(order):
            out[i] = low if j > k else high
    else:
        # The mean of the others' k1-th and k2-th (k2 = k1 + 1).
        k1, k2 = m // 2 - 1, m // 2
        below = (s[k1] + s[k2]) / 2.0  # the value sits above both
        above = (s[k1 + 1] + s[k2 + 1]) / 2.0  # below both
        middle = (s[k1] + s[k2 + 1]) / 2.0  # between: it is s[k2] itself
        for j, i in enumerate(order):
            out[i] = below if j > k2 else above if j <= k1 else middle
    return out


def vs_role(
    groups: Sequence[Hashable], p50s: Sequence[float | None]
) -> list[tuple[float | None, bool]]:
    """``top``'s ``vs_role`` and ``marked`` of each rank, given its group (its job and role)
    and its p50: the p50 over the median p50 of the group's other ranks (rounded as shown)
    and whether that is slower by more than :data:`FAR`; (None, False) for a rank without a
    p50, or without others in its group that have one (they are left out of its median)."""
    members: dict[Hashable, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for i, (g, p50) in enumerate(zip(groups, p50s, strict=True)):
        if p50 is not None and p50 > 0:
            ranks, values = members[g]
            ranks.append(i)
            values.append(float(p50))
    out: list[tuple[float | None, bool]] = [(None, False)] * len(p50s)
    for ranks, values in members.values():
        for i, value, med in zip(ranks, values, others_medians(values), strict=True):
            if med is not None and med > 0:
                ratio = value / med
                out[i] = (round(ratio, 3), ratio > 1.0 + FAR)
    return out


def mark_vs_role(rows: list[dict[str, Any]]) -> None:
    """Set ``vs_role`` and ``marked`` (:func:`vs_role`) on ``top`` rows, grouped by job and
    role (profctl ``--cluster``: a role spans nodes)."""
    marks = vs_role([(r["job"], r["role"]) for r in rows], [r.get("step_ms_p50") for r in rows])
    for r, (ratio, marked) in zip(rows, marks, strict=True):
        r["vs_role"], r["marked"] = ratio, marked


def top_order(
    vs_role: float | None, p50: float | None, host: str, job: str, role: str, rank: int
) -> tuple[float, float, str, str, int]:
    """``top``'s order: the slowest against its role first, then by p50, then by name."""
    return (
        -(vs_role if vs_role is not None else 0.0),
        -(p50 if p50 is not None else -1.0),
        host,
        job + "\0" + role,
        rank,
    )


def slowest_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``top`` rows in :func:`top_order`."""

    def key(r: dict[str, Any]) -> tuple[float, float, str, str, int]:
        return top_order(
            r.get("vs_role"),
            r.get("step_ms_p50"),
            str(r.get("host", "")),
            str(r["job"]),
            str(r["role"]),
            int(r["rank"]),
        )

    return sorted(rows, key=key)
