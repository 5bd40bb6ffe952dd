"""Text for people: the one way profd writes a byte count, and the one way text from peers
is made safe to show on a terminal."""

from __future__ import annotations

import unicodedata

# Binary units, written the way config size strings are read (``max_spool_bytes = "20GiB"``),
# so a number profctl prints can be pasted into the config. TiB is the config's largest unit.
_UNITS = ("KiB", "MiB", "GiB", "TiB")


def human_bytes(n: float, digits: int = 1) -> str:
    """``512`` -> ``512B``, ``1536`` -> ``1.5KiB``, ``3 << 30`` -> ``3.0GiB``.

    ``digits`` is the number of decimals above 1 KiB (whole bytes below it).
    """
    if round(abs(n)) < 1024:
        return f"{n:.0f}B"
    v = float(n)
    for unit in _UNITS:
        v /= 1024
        # Compare the rounded value, so 1048575 bytes reads 1.0MiB rather than 1024.0KiB.
        if round(abs(v), digits) < 1024 or unit == _UNITS[-1]:
            break
    return f"{v:.{digits}f}{unit}"


def printable(text: str, newlines: bool = False) -> str:
    """``text`` as a terminal may show it: every character that is not printable written as
    a visible escape (``\\x1b``, ``\\u202e``, ``\\U000e0041``), so a name from a peer
    (a host, a region, a function) can neither send the terminal a sequence (an ESC, an OSC
    52 clipboard write), nor split a row (a newline, a carriage return), nor reorder or hide
    what follows it (bidi overrides and isolates, zero-width characters).

    Escaped: the C0 controls with tab and newline, DEL, the C1 controls, the Unicode format
    characters (bidi, zero width, BOM, tags), the line and paragraph separators, surrogates
    and unassigned or private-use code points (:meth:`str.isprintable`); kept: spaces of
    every kind. ``newlines``: ``\\n`` stays (a block of lines profctl made itself). A
    backslash is kept as it is: text that spells an escape reads as that text, harmlessly.
    """
    if text.isprintable():
        return text
    return "".join(
        c
        if c.isprintable() or (newlines and c == "\n") or unicodedata.category(c) == "Zs"
        else _escape(c)
        for c in text
    )


def _escape(c: str) -> str:
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    if n < 0x10000:
        return f"\\u{n:04x}"
    return f"\\U{n:08x}"
