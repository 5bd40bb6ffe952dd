"""Sorting compact event columns (``array('d')``) without a Python object per event.

The analyses keep the few fields they need of each event in typed arrays (8 bytes a float)
rather than as dicts or tuples, and several need those events in time order. Sorting them the
obvious way, ``sorted(range(n), key=lambda i: (ts[i], -dur[i]))``, builds a key tuple and an
int per event: about 150 bytes each, several times the columns themselves. Kineto writes each
thread's events as a few long runs that are each already in order (CPU ops, then the Python
functions of the same thread), so :func:`sorted_order` finds those runs and merges them,
holding one iterator per run; only input with very many runs (no real trace) pays for a full
sort, on one packed int per event.

:class:`Intervals` keeps time intervals the same way, for the analyses that measure unions.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from array import array
from collections.abc import Iterable, Iterator, Sequence

#: Up to this many ascending runs are merged lazily; beyond, the columns are sorted outright.
MAX_MERGE_RUNS = 1024

_SIGN = 1 << 63
_MASK64 = (1 << 64) - 1


def sorted_order(first: array[float], then_desc: array[float] | None = None) -> Sequence[int]:
    """Indices of the events by ``first`` ascending, then ``then_desc`` descending, then index.

    That is the order ``sorted(range(n), key=lambda i: (first[i], -then_desc[i]))`` gives
    (a stable sort), without its memory. The result is ``range(n)`` when the events are in
    order already, else an ``array('I')`` (4 bytes an event).
    """
    n = len(first)
    second = then_desc if then_desc is not None else array("d", bytes(8 * n))
    bounds = _run_bounds(first, second)
    if len(bounds) == 2:
        return range(n)
    if len(bounds) - 1 <= MAX_MERGE_RUNS:
        return _merged(first, second, bounds)
    return _packed_sort(first, second)


def _run_bounds(first: array[float], second: array[float]) -> list[int]:
    """Start indices of the ascending runs, and the length at the end."""
    bounds = [0]
    prev_a, prev_b = -float("inf"), float("inf")
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        if a < prev_a or (a == prev_a and b > prev_b):
            bounds.append(i)
        prev_a, prev_b = a, b
    bounds.append(len(first))
    return bounds


def _merged(first: array[float], second: array[float], bounds: Sequence[int]) -> array[int]:
    runs: list[Iterable[tuple[float, float, int]]] = [
        zip(
            itertools.islice(first, lo, hi),
            map(operator.neg, itertools.islice(second, lo, hi)),
            range(lo, hi),
            strict=True,
        )
        for lo, hi in itertools.pairwise(bounds)
    ]
    # heapq.merge is stable across its inputs, and the index makes every key distinct anyway.
    return array("I", map(operator.itemgetter(2), heapq.merge(*runs)))


def _ordered_bits(values: array[float], negate: bool) -> Iterator[int]:
    """Unsigned ints that compare like the floats (``-x`` with ``negate``); -0.0 == 0.0."""
    bits = array("Q")
    bits.frombytes(values.tobytes())
    flip = _SIGN if negate else 0
    for b in bits:
        b ^= flip
        if b == _SIGN:  # -0.0: equal to 0.0 as a float, so it gets 0.0's key
            b = 0
        yield _MASK64 ^ b if b & _SIGN else b | _SIGN


def _packed_sort(first: array[float], second: array[float]) -> array[int]:
    # One int of 160 bits per event (about 56 bytes with its list slot), sorted in C.
    keys = [
        (a << 96) | (b << 32) | i
        for i, (a, b) in enumerate(
            zip(_ordered_bits(first, False), _ordered_bits(second, True), strict=True)
        )
    ]
    keys.sort()
    return array("I", (k & 0xFFFFFFFF for k in keys))


class Intervals:
    """Disjoint intervals in time order, as two columns."""

    __slots__ = ("ends", "starts")

    def __init__(self) -> None:
        self.starts = array("d")
        self.ends = array("d")

    def __len__(self) -> int:
        return len(self.starts)

    def extend_sorted(self, start: float, end: float) -> None:
        """Add one interval that starts no earlier than every one before it."""
        if end <= start:
            return
        if self.ends and start <= self.ends[-1]:
            if end > self.ends[-1]:
                self.ends[-1] = end
            return
        self.starts.append(start)
        self.ends.append(end)

    @classmethod
    def of(cls, pairs: Iterable[tuple[float, float]]) -> Intervals:
        out = cls()
        for s, e in sorted(pairs):
            out.extend_sorted(s, e)
        return out

    def union(self, other: Intervals) -> Intervals:
        return Intervals.of(
            [*zip(self.starts, self.ends, strict=True), *zip(other.starts, other.ends, strict=True)]
        )

    def intersection(self, other: Intervals) -> Intervals:
        out = Intervals()
        i = j = 0
        a_s, a_e, b_s, b_e = self.starts, self.ends, other.starts, other.ends
        while i < len(a_s) and j < len(b_s):
            lo, hi = max(a_s[i], b_s[j]), min(a_e[i], b_e[j])
            if lo < hi:
                out.extend_sorted(lo, hi)
            if a_e[i] < b_e[j]:
                i += 1
            else:
                j += 1
        return out

    def measure(self, lo: float, hi: float) -> float:
        """Time covered inside ``[lo, hi)``."""
        total = 0.0
        i = bisect.bisect_right(self.ends, lo)
        while i < len(self.starts) and self.starts[i] < hi:
            total += min(self.ends[i], hi) - max(self.starts[i], lo)
            i += 1
        return total

    def longest_gap(self, lo: float, hi: float) -> float:
        """The longest stretch of ``[lo, hi)`` that no interval covers."""
        best, at = 0.0, lo
        i = bisect.bisect_right(self.ends, lo)
        while i < len(self.starts) and self.starts[i] < hi:
            best = max(best, self.starts[i] - at)
            at = max(at, self.ends[i])
            i += 1
        return max(best, hi - at)


def wall_us(pairs: Iterable[tuple[float, float]]) -> float:
    """The time covered by at least one of the intervals (start, end)."""
    u = Intervals.of(pairs)
    return sum(e - s for s, e in zip(u.starts, u.ends, strict=True))
