"""Rank lists as users write them: ``0,2-5`` or ``all``. Shared by the client and profctl."""

from __future__ import annotations

from collections.abc import Iterable


class RankSpecError(ValueError):
    pass


#: Bounds that keep a typo (``0-20000000``) from building a set of millions of ranks.
MAX_RANK = (1 << 24) - 1
MAX_SELECTED = 1 << 17


def parse_ranks(spec: str) -> frozenset[int] | None:
    """``None`` means every rank; raises :class:`RankSpecError` on bad input."""
    text = spec.strip()
    if text.lower() in ("all", "*"):
        return None
    ranks: set[int] = set()
    count = 0
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
        if b > MAX_RANK:
            raise RankSpecError(f"bad rank list {spec[:60]!r}: ranks go up to {MAX_RANK}")
        count += b - a + 1
        if count > MAX_SELECTED:
            raise RankSpecError(
                f"bad rank list {spec[:60]!r}: more than {MAX_SELECTED} ranks; use all"
            )
        ranks.update(range(a, b + 1))
    return frozenset(ranks)


def unmatched(spec: str | int | None, found: Iterable[int]) -> list[int]:
    """The ranks a ``--ranks`` list names that are not in ``found``, in order; none for no
    list, ``all`` or a list that does not parse (whoever parses it refuses it)."""
    if spec is None:
        return []
    try:
        wanted = parse_ranks(str(spec))
    except RankSpecError:
        return []
    return sorted(wanted - set(found)) if wanted is not None else []
