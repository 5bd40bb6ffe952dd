"""The one glob language of ``--role`` patterns (and anything else profd matches by pattern).

Patterns are :func:`fnmatch.fnmatchcase` patterns: ``*`` any run of characters, ``?`` one
character, ``[abc]``/``[a-z]``/``[!abc]`` one character of (not of) a set, everything else
literal and case-sensitive. A pattern without wildcards therefore matches exactly that name,
and a ``[`` with no closing ``]`` is an ordinary character. ``%`` and ``_`` mean nothing.

:func:`match` is the definition and what Python code calls (the daemon's selector, the S3
listing). The index asks SQLite instead, so that the filter runs inside the query:
:func:`sqlite_condition` turns a pattern into a ``WHERE`` term with the same meaning, built
from this module's own reading of the pattern and checked against :func:`match` by
``tests/unit/test_globs.py``.
"""

from __future__ import annotations

import fnmatch
import sqlite3
from dataclasses import dataclass
from typing import Final, TypeAlias

#: The SQL function :func:`register_sqlite` adds; only patterns SQLite's GLOB cannot express
#: use it, because a Python call per scanned row costs far more than GLOB.
SQLITE_FUNCTION: Final = "profd_glob"


def match(name: str, pattern: str) -> bool:
    """Whether ``name`` matches ``pattern``: the whole name, case-sensitively."""
    return fnmatch.fnmatchcase(name, pattern)


def escape(text: str) -> str:
    """A pattern that matches ``text`` and nothing else (``glob.escape`` without drives)."""
    return "".join(f"[{c}]" if c in _WILDCARDS else c for c in text)


def literal(pattern: str) -> str | None:
    """The one name ``pattern`` matches, or None when it matches any other number of names."""
    out = []
    for t in _tokens(pattern):
        if isinstance(t, str):
            out.append(t)
        elif isinstance(t, _Set) and not t.negated and len(t.ranges) == 1:
            lo, hi = t.ranges[0]
            if lo != hi:
                return None
            out.append(chr(lo))
        else:
            return None
    return "".join(out)


def register_sqlite(db: sqlite3.Connection) -> None:
    """Make ``db`` understand every term :func:`sqlite_condition` may return."""
    db.create_function(SQLITE_FUNCTION, 2, match, deterministic=True)


def sqlite_condition(column: str, pattern: str) -> tuple[str, tuple[str, ...]]:
    """A ``WHERE`` term (and its parameters) true where ``column`` matches ``pattern``.

    Exact names compare with ``=`` and the rest use ``GLOB``, so an index on ``column`` serves
    both (SQLite turns ``GLOB 'abc*'`` into a range scan). ``column`` is SQL text: pass a
    column name, never user input.
    """
    exact = literal(pattern)
    if exact is not None:
        return f"{column} = ?", (exact,)
    if "\0" in pattern:
        # SQLite's GLOB stops reading its pattern at a NUL character.
        return f"{SQLITE_FUNCTION}({column}, ?)", (pattern,)
    glob = sqlite_glob(pattern)
    if glob is None:
        return "0", ()
    return f"{column} GLOB ?", (glob,)


def sqlite_glob(pattern: str) -> str | None:
    """The SQLite ``GLOB`` pattern for ``pattern``, or None if it can match nothing.

    The two languages share ``*`` and ``?`` but not sets: SQLite negates with ``^`` (``!`` is
    an ordinary member), gives up on a ``[`` without ``]``, and reads ``]``, ``^`` and ``-``
    by position. So sets are rebuilt from what they contain rather than copied.
    """
    out = []
    for t in _tokens(pattern):
        if t is _STAR:
            out.append("*")
        elif t is _ONE:
            out.append("?")
        elif isinstance(t, str):
            out.append(_sqlite_char(t))
        elif isinstance(t, _Set):
            s = _sqlite_set(t)
            if s is None:
                return None
            out.append(s)
    return "".join(out)


# --- reading patterns --------------------------------------------------------------------------

_WILDCARDS = frozenset("*?[")


class _Wild:
    """``*`` or ``?``."""


_STAR: Final = _Wild()
_ONE: Final = _Wild()


@dataclass(frozen=True)
class _Set:
    negated: bool
    ranges: tuple[tuple[int, int], ...]  # code points, inclusive, sorted, disjoint


_Token: TypeAlias = str | _Wild | _Set  # a str token is one literal character


def _tokens(pattern: str) -> list[_Token]:
    out: list[_Token] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not out or out[-1] is not _STAR:
                out.append(_STAR)
        elif c == "?":
            out.append(_ONE)
        elif c == "[":
            found = _read_set(pattern, i)
            if found is None:
                out.append("[")
            else:
                tok, i = found
                out.append(tok)
        else:
            out.append(c)
    return out


def _read_set(pat: str, i: int) -> tuple[_Set, int] | None:
    """The set whose body starts at ``pat[i]`` and the index after its ``]``.

    Follows :func:`fnmatch.translate` step by step, since that is the definition: a leading
    ``!`` negates, a ``]`` right after ``[`` or ``[!`` is a member, a ``-`` is a range between
    its neighbours except first or last or right after a range, and a reversed range drops
    both its ends.
    """
    n = len(pat)
    j = i
    if j < n and pat[j] == "!":
        j += 1
    if j < n and pat[j] == "]":
        j += 1
    while j < n and pat[j] != "]":
        j += 1
    if j >= n:
        return None
    chunks: list[str] = []
    start = i
    k = i + 2 if pat[i] == "!" else i + 1
    while (k := pat.find("-", k, j)) >= 0:
        chunks.append(pat[start:k])
        start = k + 1
        k += 3
    last = pat[start:j]
    if last:
        chunks.append(last)
    else:
        chunks[-1] += "-"
    for k in range(len(chunks) - 1, 0, -1):
        if chunks[k - 1][-1] > chunks[k][0]:
            chunks[k - 1] = chunks[k - 1][:-1] + chunks[k][1:]
            del chunks[k]
    negated = chunks[0].startswith("!")
    if negated:
        chunks[0] = chunks[0][1:]
    # Consecutive chunks are joined by a range: last char of one to first char of the next.
    spans: list[tuple[int, int]] = []
    for idx, chunk in enumerate(chunks):
        rest = chunk
        if idx > 0 and spans and chunk:
            spans[-1] = (spans[-1][0], ord(chunk[0]))
            rest = chunk[1:]
        spans.extend((ord(c), ord(c)) for c in rest)
    return _Set(negated, _merge(spans)), j + 1


def _merge(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(s for s in spans if s[0] <= s[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


# --- writing SQLite GLOB --------------------------------------------------------------------------

_DASH, _RBRACKET, _CARET = ord("-"), ord("]"), ord("^")


def _sqlite_char(c: str) -> str:
    return f"[{c}]" if c in _WILDCARDS else c


def _sqlite_set(s: _Set) -> str | None:
    if not s.ranges:
        return "?" if s.negated else None
    if not s.negated and len(s.ranges) == 1 and s.ranges[0][0] == s.ranges[0][1]:
        return _sqlite_char(chr(s.ranges[0][0]))
    # In SQLite's sets "]" is a member only first, "-" only first or last, "^" anywhere but
    # first: take the three out of the ranges and put each where it means itself.
    plain: list[tuple[int, int]] = []
    special: set[int] = set()
    for lo, hi in s.ranges:
        for sp in (_DASH, _RBRACKET, _CARET):
            if lo <= sp <= hi:
                special.add(sp)
                if lo < sp:
                    plain.append((lo, sp - 1))
                lo = sp + 1
        if lo <= hi:
            plain.append((lo, hi))
    body = "]" if _RBRACKET in special else ""
    if _DASH in special:
        body += "-"
    body += "".join(chr(lo) if lo == hi else f"{chr(lo)}-{chr(hi)}" for lo, hi in plain)
    if _CARET in special:
        body += "^"  # never first when not negated: a lone "^" was returned as a character
    return f"[{'^' if s.negated else ''}{body}]"
