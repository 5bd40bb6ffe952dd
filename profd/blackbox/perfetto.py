"""Black boxes as one Perfetto trace (Chrome trace-event JSON): a process per rank named
``node/role rank N``, a thread each for its steps, each region, and its stack samples, and
its collectives as async slices. Ranks are aligned by the global step: each rank's clock is
shifted so that the latest step it shares with the first rank ends when that rank's did
(wall clocks of different nodes need not agree; their step counts do).

Stack samples are instant events whose ``sf`` names a node in ``stackFrames`` (the trace's
frame tree, outermost at the root), with the whole stack in ``args`` too, so a flame graph
can be drawn from them; Perfetto shows each as a mark on the rank's "stack samples" track.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from profd.blackbox.box import label, steps_of
from profd.fsutil import atomic_path

STEPS_TID = 1
SAMPLES_TID = 2
REGION_TID0 = 10  # region i is thread REGION_TID0 + i


def offsets(boxes: Sequence[dict[str, Any]]) -> list[float]:
    """Seconds to add to each box's times to align it with the first box by step."""
    if not boxes:
        return []
    ref = boxes[0]
    ref_ends = {ref["step0"] + i: t for i, t in enumerate(ref["ends"])}
    out = []
    for b in boxes:
        ends = b["ends"]
        shift = 0.0
        for i in range(len(ends) - 1, -1, -1):
            t = ref_ends.get(b["step0"] + i)
            if t is not None:
                shift = t - ends[i]
                break
        out.append(shift)
    return out


def _origin(boxes: Sequence[dict[str, Any]], shifts: Sequence[float]) -> float:
    firsts = [b["ends"][0] + s for b, s in zip(boxes, shifts, strict=True) if b["ends"]]
    firsts += [b["samples"][0][0] + s for b, s in zip(boxes, shifts, strict=True) if b["samples"]]
    return min(firsts, default=0.0)


class _Frames:
    """``stackFrames``: one node per (parent, frame text), so equal stacks share a path."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self._ids: dict[tuple[str | None, str], str] = {}

    def leaf(self, texts_outermost_first: Sequence[str]) -> str | None:
        parent: str | None = None
        for text in texts_outermost_first:
            key = (parent, text)
            node = self._ids.get(key)
            if node is None:
                node = self._ids[key] = str(len(self._ids) + 1)
                entry: dict[str, Any] = {"name": text, "category": "python"}
                if parent is not None:
                    entry["parent"] = parent
                self.nodes[node] = entry
            parent = node
        return parent


def trace(boxes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The trace of ``boxes`` (in the order given: the first is the clock every other one
    is aligned to)."""
    shifts = offsets(boxes)
    t0 = _origin(boxes, shifts)
    frames = _Frames()
    events: list[dict[str, Any]] = []
    for pid, (b, shift) in enumerate(zip(boxes, shifts, strict=True), start=1):

        def us(t: float, shift: float = shift) -> float:
            return round((t + shift - t0) * 1e6, 3)

        events += _names(pid, b)
        events += _steps(pid, b, us)
        events += _regions(pid, b, us)
        events += _collectives(pid, b, us)
        events += _samples(pid, b, us, frames)
    return {
        "traceEvents": events,
        "stackFrames": frames.nodes,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "profd black box",
            "aligned_by": "step",
            "ranks": [label(b) for b in boxes],
        },
    }


Clock = Callable[[float], float]


def _names(pid: int, b: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label(b)}},
        {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}},
    ]
    threads = {STEPS_TID: "steps", SAMPLES_TID: "stack samples"}
    for i, r in enumerate(b["regions"]):
        threads[REGION_TID0 + i] = f"region {r}"
    for tid, tname in threads.items():
        out.append(
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": tname}}
        )
        out.append(
            {
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "name": "thread_sort_index",
                "args": {"sort_index": tid},
            }
        )
    return out


def _steps(pid: int, b: dict[str, Any], us: Clock) -> list[dict[str, Any]]:
    return [
        {
            "ph": "X",
            "pid": pid,
            "tid": STEPS_TID,
            "name": f"step {step}",
            "cat": "step",
            "ts": us(start),
            "dur": round(max(0.0, end - start) * 1e6, 3),
            "args": {"step": step},
        }
        for step, start, end in steps_of(b)
    ]


def _regions(pid: int, b: dict[str, Any], us: Clock) -> list[dict[str, Any]]:
    return [
        {
            "ph": "X",
            "pid": pid,
            "tid": REGION_TID0 + idx,
            "name": b["regions"][idx],
            "cat": "region",
            "ts": us(end - seconds),
            "dur": round(max(0.0, seconds) * 1e6, 3),
            "args": {"step": step},
        }
        for step, idx, end, seconds in b["records"]
    ]


def _collectives(pid: int, b: dict[str, Any], us: Clock) -> list[dict[str, Any]]:
    """Async slices (collectives may overlap), from start (else enqueue) to completion."""
    out: list[dict[str, Any]] = []
    for n, c in enumerate(b.get("collectives") or []):
        begin = c.get("started") or c.get("created")
        if begin is None:
            continue
        end = c.get("completed")
        if end is None and c.get("ms") is not None:
            end = begin + c["ms"] / 1e3
        common = {"pid": pid, "cat": "collective", "id": f"{pid}.{n}", "name": c["op"]}
        args = {"pg": c["pg"], "seq": c["seq"], "state": c["state"], "ms": c.get("ms")}
        out.append({**common, "ph": "b", "ts": us(begin), "args": args})
        out.append({**common, "ph": "e", "ts": us(max(end or begin, begin))})
    return out


def _samples(pid: int, b: dict[str, Any], us: Clock, frames: _Frames) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts = b["frames"]
    for t, step, sid in b["samples"]:
        ev: dict[str, Any] = {
            "ph": "i",
            "s": "t",
            "pid": pid,
            "tid": SAMPLES_TID,
            "cat": "sample",
            "ts": us(t),
        }
        if 0 <= sid < len(b["stacks"]):
            stack = [texts[f] for f in b["stacks"][sid]]
            ev["name"] = stack[0] if stack else "?"
            leaf = frames.leaf(list(reversed(stack)))
            if leaf is not None:
                ev["sf"] = leaf
            ev["args"] = {"step": step, "stack": "\n".join(stack)}
        else:
            ev["name"] = "(not recorded)"
            ev["args"] = {"step": step}
        out.append(ev)
    return out


def write(boxes: Sequence[dict[str, Any]], path: Path, mode: int | None = None) -> int:
    """Write the trace of ``boxes`` gzipped to ``path`` (whole or not at all: a process
    killed meanwhile leaves no file under that name); its size in bytes."""
    data = json.dumps(trace(boxes), separators=(",", ":")).encode()
    with atomic_path(path, mode) as tmp, gzip.open(tmp, "wb", compresslevel=6) as f:
        f.write(data)
    return path.stat().st_size
