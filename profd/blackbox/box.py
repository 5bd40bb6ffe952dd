"""One rank's black box as the daemon passes it on (control replies, incidents): a plain map,
times in wall-clock seconds.

``{"job", "node", "host", "role", "rank", "pid", "world_size", "settings", "step0", "ends",
"regions", "records", "frames", "stacks", "samples", "collectives", "collectives_error"}``:
``ends[i]`` is when step ``step0 + i`` ended (``ends[0]``: when step ``step0 + 1`` began);
``records`` are region exits ``[step, region index, end, seconds]``; ``samples`` are stack
samples ``[time, step, stack index or -1]``, each stack a list of indexes into ``frames``
("function (file:line)"), innermost first; ``collectives`` the flight recorder's entries with
their times (``{"pg", "seq", "op", "state", "created", "started", "completed", "ms"}``) or
None where it is off.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

from profd_client import protocol as P


def _array(kind: str, data: bytes) -> list[Any]:
    a = array(kind)
    a.frombytes(data[: len(data) - len(data) % a.itemsize])
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def from_result(m: P.BlackboxResult, who: dict[str, Any]) -> dict[str, Any]:
    """A client's ``blackbox_result`` as a box; ``who`` names the rank (job, node, host, role,
    rank, pid, world_size)."""
    clock = m.clock
    ends = [t + clock for t in _array("d", m.ends)]
    steps = _array("q", m.region_steps)
    ids = _array("h", m.region_ids)
    rends = _array("d", m.region_ends)
    seconds = _array("d", m.region_seconds)
    n = min(len(steps), len(ids), len(rends), len(seconds))
    names = list(m.regions)
    records = [
        [steps[i], ids[i], rends[i] + clock, seconds[i]]
        for i in range(n)
        if 0 <= ids[i] < len(names)
    ]
    st, ss, sk = _array("d", m.sample_t), _array("q", m.sample_steps), _array("i", m.sample_stacks)
    stacks = [list(s) for s in m.stacks]
    samples = [
        [st[i] + clock, ss[i], sk[i] if 0 <= sk[i] < len(stacks) else -1]
        for i in range(min(len(st), len(ss), len(sk)))
    ]
    return {
        **who,
        "settings": P.fields_of(m.settings),
        "step0": m.step0,
        "ends": ends,
        "regions": names,
        "records": records,
        "frames": list(m.frames),
        "stacks": stacks,
        "samples": samples,
        "collectives": (
            [P.fields_of(c) for c in m.collectives] if m.collectives is not None else None
        ),
        "collectives_error": m.collectives_error,
    }


def label(box: dict[str, Any]) -> str:
    """How a box's rank is named: ``node/role rank N``."""
    return f"{box.get('node') or box.get('host')}/{box.get('role')} rank {box.get('rank')}"


def steps_of(box: dict[str, Any]) -> list[tuple[int, float, float]]:
    """``(step, start, end)`` of every step held."""
    ends = box["ends"]
    s0 = box["step0"]
    return [(s0 + i, ends[i - 1], ends[i]) for i in range(1, len(ends))]
