"""Protocol errors in the words of the command line.

The protocol names a bad value by its place in the request (``start.spec.at_step: 0 is out
of range 1..281474976710656``), whether profctl's own encoding found it or the daemon did. A
user typed ``--at-step 0``: :func:`user_text` says ``--at-step must be at least 1``. Every
message profctl prints passes through it once (``profd.ctl.main.command``), so a field gets
its flag here, in one table, and not at each place that could refuse it.
"""

from __future__ import annotations

import re
from typing import Final

#: Request field -> what the user typed for it. List items (``[3]``) map like their list.
FLAGS: Final = {
    **{
        f"start.spec.{field}": flag
        for field, flag in {
            "job": "--job",
            "roles": "--role",
            "ranks": "--ranks",
            "host": "--host",
            "pids": "--pid",
            "steps": "--steps",
            "next": "--next",
            "at_step": "--at-step",
            "active": "--active",
            "warmup": "--warmup",
            "repeat": "--repeat",
            "roundup": "--roundup",
            "options.activities": "--activities",
            "region": "--region",
            "label": "--label",
            "backend": "--backend",
        }.items()
    },
    **{f"sessions.{f}": f"--{f}" for f in ("state", "job", "limit")},
    **{f"ps.{f}": f"--{f}" for f in ("job", "role")},
    **{f"traces.filters.{f}": f"--{f}" for f in ("job", "session", "rank", "role", "host")},
    "traces.filters.limit": "--limit",
    **{f"history.{f}": f"--{f}" for f in ("job", "since", "until")},
    **{f"{t}.session": "SESSION" for t in ("show", "stop", "cancel", "retry")},
}

_PATH = re.compile(r"(?P<path>[a-z_]+(?:\.[a-z_]+)*)(?:\[\d+\])*: (?P<why>.*)", re.DOTALL)
_RANGE = re.compile(r"(?P<value>-?\d+) is out of range (?P<lo>-?\d+)\.\.(?P<hi>-?\d+)")
_LENGTH = re.compile(r"length (?P<n>\d+) is not (?P<lo>\d+)\.\.(?P<hi>\d+)")
_ITEMS = re.compile(r"(?P<n>\d+) items, not (?P<lo>\d+)\.\.(?P<hi>\d+)")
_CHOICE = re.compile(r"(?P<value>'.*') is not one of (?P<choices>.*)")


def user_text(message: str) -> str:
    """``message`` with a request field it starts with named as its flag, and a range
    refusal said as the one limit that was crossed; any other message as it was."""
    m = _PATH.fullmatch(message)
    flag = FLAGS.get(m["path"]) if m else None
    if m is None or flag is None:
        return message
    why = m["why"]
    if r := _RANGE.fullmatch(why):
        value, lo, hi = int(r["value"]), int(r["lo"]), int(r["hi"])
        if value < lo:
            return f"{flag} must be at least {human(lo)} (got {value})"
        return f"{flag} must be at most {human(hi)} (got {value})"
    if r := _LENGTH.fullmatch(why):
        return f"{flag} takes at most {human(int(r['hi']))} characters (got {r['n']})"
    if r := _ITEMS.fullmatch(why):
        return f"{flag} takes at most {human(int(r['hi']))} values (got {r['n']})"
    if r := _CHOICE.fullmatch(why):
        return f"{flag} {r['value']}: must be one of {r['choices']}"
    return f"{flag}: {why}"


def human(n: int) -> str:
    """A limit as a person reads it: ``2^48`` and ``2^24-1`` rather than 15 digits."""
    if n >= 1 << 20:
        for k, tail in ((n, ""), (n + 1, "-1")):
            if k & (k - 1) == 0:
                return f"2^{k.bit_length() - 1}{tail}"
    return str(n)
