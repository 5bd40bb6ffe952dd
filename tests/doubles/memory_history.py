"""A test double for torch.cuda.memory's allocator history, which needs CUDA (not here).

:class:`MemoryHistoryDouble` stands where ``profd_client.capture.CUDA_MEMORY`` stands (a
``MemoryHistory``): ``start``/``stop`` are counted, ``snapshot()`` returns a picklable object
shaped like ``torch.cuda.memory._snapshot()``'s (``segments``, ``device_traces`` of
alloc/free entries whose ``frames`` lists are shared between entries, as torch shares them),
as large as asked (built once, up front). With ``gate`` the snapshot holds an object whose
pickling waits for that event, so a test can see what happens while the file is still being
written. It records no
allocation and has no allocator state; only the shape and the cost of pickling are real.
"""

from __future__ import annotations

import threading
from typing import Any


class _Gated:
    """Pickles only once ``event`` is set (on whichever thread pickles it)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        self.event.wait()
        return (str, ("gated",))


class _Unpicklable:
    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("this snapshot cannot be pickled (double)")


def fake_snapshot(entries: int, stacks: int = 64, depth: int = 24) -> dict[str, Any]:
    """A ``_snapshot()``-shaped dict with ``entries`` trace entries."""
    frames = [
        [
            {"filename": f"/site-packages/model/layer{s}.py", "name": f"fn_{s}_{d}", "line": d}
            for d in range(depth)
        ]
        for s in range(stacks)
    ]
    trace = [
        {
            "action": ("alloc", "free_requested", "free_completed")[i % 3],
            "addr": 0x7F0000000000 + 512 * i,
            "size": 512 * (1 + i % 97),
            "stream": 0,
            "time_us": 1_000_000 + i,
            "frames": frames[i % stacks],
        }
        for i in range(entries)
    ]
    segment = {"address": 0x7F0000000000, "total_size": 2 << 20, "stream": 0, "blocks": []}
    return {"segments": [segment], "device_traces": [trace]}


class MemoryHistoryDouble:
    """Test double for ``torch.cuda.memory``'s history (see the module docstring)."""

    def __init__(
        self,
        entries: int = 1000,
        stacks: int = 64,
        gate: threading.Event | None = None,
        fail: bool = False,
        unpicklable: bool = False,
    ) -> None:
        # Built here, not in snapshot(): what torch spends taking a snapshot is torch's; what
        # a benchmark of the client wants to see is what the client does with it.
        self.base = fake_snapshot(entries, stacks)
        self.gate = gate
        self.fail = fail
        self.unpicklable = unpicklable
        self.started = 0
        self.stopped = 0
        self.taken: list[dict[str, Any]] = []
        self.threads: list[str] = []  # the thread each snapshot was taken on

    def available(self) -> bool:
        return True

    def start(self) -> None:
        self.started += 1

    def stop(self) -> None:
        self.stopped += 1

    def snapshot(self) -> object:
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("snapshot failed (double)")
        snap = dict(self.base)
        if self.gate is not None:
            snap["gate"] = _Gated(self.gate)
        if self.unpicklable:
            snap["bad"] = _Unpicklable()
        self.taken.append(snap)
        return snap
