"""Memory over time from a trace's ``[memory]`` events (``profctl start --profile-memory``).

torch.profiler with ``profile_memory=True`` writes one ``[memory]`` instant event per
allocation and free, carrying the device's running ``Total Allocated`` and ``Total Reserved``.
A long capture holds millions of them, so they are kept as three columns per device
(:class:`MemorySeries`, 24 bytes a reading), filled one event at a time (:class:`MemoryEvents`).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from profd.pipeline.columns import sorted_order
from profd.pipeline.spans import MAX_US

MEMORY_EVENT = "[memory]"
_INT64 = range(-(1 << 63), 1 << 63)


@dataclass(frozen=True)
class MemoryReading:
    """One ``[memory]`` event of the trace: a device's allocated and reserved bytes at a
    time (not a profiling "sample": those are the daemon's sample sessions)."""

    ts_us: float
    allocated: int
    reserved: int


class MemorySeries(Sequence[MemoryReading]):
    """One device's readings as columns; indexing makes :class:`MemoryReading` objects on the
    fly."""

    __slots__ = ("allocated", "reserved", "ts_us")

    def __init__(self) -> None:
        self.ts_us = array("d")
        self.allocated = array("q")
        self.reserved = array("q")

    def __len__(self) -> int:
        return len(self.ts_us)

    @overload
    def __getitem__(self, i: int) -> MemoryReading: ...

    @overload
    def __getitem__(self, i: slice) -> list[MemoryReading]: ...

    def __getitem__(self, i: int | slice) -> MemoryReading | list[MemoryReading]:
        if isinstance(i, slice):
            return [
                MemoryReading(*s)
                for s in zip(self.ts_us[i], self.allocated[i], self.reserved[i], strict=True)
            ]
        return MemoryReading(self.ts_us[i], self.allocated[i], self.reserved[i])

    def append(self, ts_us: float, allocated: int, reserved: int) -> None:
        self.ts_us.append(ts_us)
        self.allocated.append(allocated)
        self.reserved.append(reserved)

    def in_time_order(self) -> MemorySeries:
        """The readings sorted by time (stable); itself when they already are."""
        order = sorted_order(self.ts_us)
        if isinstance(order, range):
            return self
        out = MemorySeries()
        out.ts_us = array("d", (self.ts_us[i] for i in order))
        out.allocated = array("q", (self.allocated[i] for i in order))
        out.reserved = array("q", (self.reserved[i] for i in order))
        return out


def device_name(args: Mapping[str, Any]) -> str:
    kind, idx = args.get("Device Type"), args.get("Device Id")
    if kind == 0:
        return "cpu"
    if kind == 1:
        return f"cuda:{idx}"
    return f"device type {kind}:{idx}"


class MemoryEvents:
    """The trace's ``[memory]`` events (``EventGroups.memory``), one series per device."""

    def __init__(self) -> None:
        self._series: dict[str, MemorySeries] = {}

    def __len__(self) -> int:
        return sum(len(s) for s in self._series.values())

    def add(self, args: Any, ts: Any) -> None:
        """One event's ``args`` and ``ts``; one without the totals is skipped."""
        if not isinstance(args, dict) or not isinstance(ts, int | float):
            return
        alloc, reserved = args.get("Total Allocated"), args.get("Total Reserved")
        if not isinstance(alloc, int) or not isinstance(reserved, int):
            return
        if alloc not in _INT64 or reserved not in _INT64:
            return  # no device has 8 EiB: a corrupt event, and it would not fit the column
        try:
            ts_us = float(ts)
        except OverflowError:
            return
        if not -MAX_US <= ts_us <= MAX_US:  # NaN fails too
            return
        dev = device_name(args)
        series = self._series.get(dev)
        if series is None:
            series = self._series[dev] = MemorySeries()
        series.append(ts_us, alloc, reserved)

    def peaks(self) -> dict[str, tuple[int, int]]:
        """Per device, the highest allocated and reserved totals (no sort needed)."""
        return {
            dev: (max(s.allocated), max(s.reserved)) for dev, s in self._series.items() if len(s)
        }

    def series(self) -> dict[str, MemorySeries]:
        """Per device, the running totals in time order (empty without ``profile_memory``)."""
        return {dev: s.in_time_order() for dev, s in self._series.items()}
