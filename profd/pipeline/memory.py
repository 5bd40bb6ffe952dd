"""Memory over time from a trace's ``[memory]`` events (``profctl start --profile-memory``).

torch.profiler with ``profile_memory=True`` writes one ``[memory]`` instant event per
allocation and free, carrying the device's running ``Total Allocated`` and ``Total Reserved``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MEMORY_EVENT = "[memory]"


@dataclass(frozen=True)
class Sample:
    ts_us: float
    allocated: int
    reserved: int


def device_name(args: Mapping[str, Any]) -> str:
    kind, idx = args.get("Device Type"), args.get("Device Id")
    if kind == 0:
        return "cpu"
    if kind == 1:
        return f"cuda:{idx}"
    return f"device type {kind}:{idx}"


def memory_series(events: Iterable[Mapping[str, Any]]) -> dict[str, list[Sample]]:
    """Per device, the running totals in time order (empty without ``profile_memory``).

    ``events`` are the trace's ``[memory]`` events (``EventGroups.memory``); one without the
    totals is skipped.
    """
    out: dict[str, list[Sample]] = {}
    for ev in events:
        args, ts = ev.get("args"), ev.get("ts")
        if not isinstance(args, dict) or not isinstance(ts, int | float):
            continue
        alloc, reserved = args.get("Total Allocated"), args.get("Total Reserved")
        if not isinstance(alloc, int) or not isinstance(reserved, int):
            continue
        out.setdefault(device_name(args), []).append(Sample(float(ts), alloc, reserved))
    for samples in out.values():
        samples.sort(key=lambda s: s.ts_us)
    return out
