"""Text for people: the one way profd writes a byte count."""

from __future__ import annotations

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
