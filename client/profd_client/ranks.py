"""Rank lists as users write them: ``0,2-5`` or ``all``. Shared by the client and profctl."""

from __future__ import annotations


class RankSpecError(ValueError):
    pass


def parse_ranks(spec: str) -> frozenset[int] | None:
    """``None`` means every rank; raises :class:`RankSpecError` on bad input."""
    text = spec.strip()
    if text.lower() in ("all", "*"):
        return None
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise RankSpecError(f"bad rank list {spec!r}: empty item")
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise RankSpecError(f"bad rank list {spec!r}: {part!r} is not N or N-M") from None
        if a < 0 or b < a:
            raise RankSpecError(f"bad rank list {spec!r}: {part!r} is not a valid range")
        ranks.update(range(a, b + 1))
    return frozenset(ranks)
