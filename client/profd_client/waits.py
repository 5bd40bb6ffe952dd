"""This rank's collective wait, for the ledger's ``wait``: the seconds its collectives took, as
torch's flight recorder timed them, and the steps that ended meanwhile. In a lockstep job a
collective lasts until the last rank reaches it, so the rank the others wait for is the one
that waits least; the daemon compares ranks.

Read on the agent thread at heartbeat time, never on the training thread. A read dumps the
recorder (without stack traces): about 1 ms for 200 entries, tens of ms for thousands
(docs/benchmarks.md), with the GIL held for much of it. So reads are spaced to cost at most
:data:`BUDGET` of the time: after a read of ``d`` seconds the next waits ``d / BUDGET``, and
covers the steps since the last one (``wait`` says how many).

Where torch records no timings nothing is sent: the recorder off (no ``TORCH_FR_BUFFER_SIZE``
or ``TORCH_NCCL_TRACE_BUFFER_SIZE``), or a backend that does not time its collectives (gloo:
its entries retire without a start or completion time; NCCL without
``TORCH_NCCL_ENABLE_TIMING=1``: no start time nor duration). The first such entry turns the
reads off for the life of the process. An interval whose entries the recorder's ring dropped
before they were read is not sent either (its figure would be short).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from . import flight
from . import protocol as P
from .steps import Stepper

log = logging.getLogger("profd_client")

#: The share of wall time the reads may take.
BUDGET: Final = 0.005

#: A process group's collectives or its point-to-point operations: each has its own sequence.
_Key = tuple[str, bool]


@dataclass
class Tally:
    """What one read found among the entries not read before."""

    seconds: float = 0.0
    timed: int = 0  # entries counted, each with its time
    lost: bool = False  # the ring dropped entries before they were read
    untimed: str | None = None  # why this backend gives no timings (the first such entry)
    marks: dict[_Key, int] = field(default_factory=dict)


def _key(e: dict[str, Any]) -> tuple[_Key, int]:
    pg = e.get("process_group") or ("", "")
    name = str(pg[0]) if isinstance(pg, list | tuple) and pg else str(pg)
    p2p = bool(e.get("is_p2p"))
    seq = e.get("p2p_seq_id" if p2p else "collective_seq_id")
    return (name, p2p), seq if isinstance(seq, int) else -1


def _ns(v: Any) -> int:
    return v if isinstance(v, int) and v > 0 else 0


def seconds_of(e: dict[str, Any]) -> float | str | None:
    """An entry's time in seconds; None: not known yet (still running, or its duration comes
    when it retires); a string: this backend does not time its collectives (why)."""
    retired = bool(e.get("retired"))
    if e.get("state") != "completed" and not retired:
        return None
    ms = e.get("duration_ms")
    if isinstance(ms, int | float) and math.isfinite(ms) and ms >= 0:
        return float(ms) / 1000.0
    started, completed = (
        _ns(e.get("time_discovered_started_ns")),
        _ns(e.get("time_discovered_completed_ns")),
    )
    if started and not retired:
        return None  # timed (start events are on): its duration is measured as it retires
    if started and completed >= started:
        return (completed - started) / 1e9  # as its watchdog saw them: coarser
    op = str(e.get("profiling_name") or "?")[: P.MAX_NAME]
    return f"{op} finished without a start time or a duration"


def marks_of(entries: Iterable[dict[str, Any]]) -> dict[_Key, int]:
    """The newest sequence number of each process group's entries: all of them count as read."""
    marks: dict[_Key, int] = {}
    for e in entries:
        k, seq = _key(e)
        if seq > marks.get(k, -1):
            marks[k] = seq
    return marks


def tally(entries: Iterable[dict[str, Any]], marks: dict[_Key, int]) -> Tally:
    """The time of the finished entries (oldest first) after ``marks`` (see :func:`marks_of`).
    In each sequence, an entry not finished yet holds back those after it: they count at the
    read that finds it finished, so none is counted twice or skipped."""
    out = Tally(marks=dict(marks))
    held: set[_Key] = set()
    first: set[_Key] = set()
    for e in entries:
        if not isinstance(e, dict):
            continue
        k, seq = _key(e)
        mark = out.marks.get(k)
        if k not in first:
            first.add(k)
            if mark is not None and seq > mark + 1:
                out.lost = True  # entries between the last read and this one were dropped
        if k in held or (mark is not None and seq <= mark):
            continue
        s = seconds_of(e)
        if s is None:
            held.add(k)
        elif isinstance(s, str):
            out.untimed = out.untimed or s
            out.marks[k] = seq
        else:
            out.seconds += s
            out.timed += 1
            out.marks[k] = seq
    return out


class Waits:
    """The agent thread's reader of this rank's collective wait (see the module docstring)."""

    def __init__(
        self,
        stepper: Stepper,
        dump: Callable[[], dict[str, Any]] = flight.timing_dump,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool | None = None,
    ) -> None:
        self.st = stepper
        self._dump = dump
        self._clock = clock
        #: Why no wait is sent by this process (None: it may be).
        self.off: str | None = (
            None
            if (flight.enabled() if enabled is None else enabled)
            else ("its flight recorder is off")
        )
        self._marks: dict[_Key, int] | None = None
        self._base: Any = None
        self._count = 0
        self._due = 0.0
        self._timed = False  # an entry was timed: a read that finds none is a wait of 0
        #: The last read's duration (seconds).
        self.cost = 0.0

    def restart(self) -> None:
        """Count only the collectives and steps from the next read on."""
        self._marks = None

    def take(self) -> list[Any] | None:
        """``[seconds, steps]`` since the last read, or None: not due yet, nothing known, or
        a read that only sets where the next one starts."""
        if self.off is not None:
            return None
        now = self._clock()
        if now < self._due:
            return None
        t0 = time.perf_counter()
        try:
            entries = self._dump().get("entries") or []
        except RuntimeError:
            self._due = now + 1.0  # no process group yet, mostly
            return None
        finally:
            self.cost = time.perf_counter() - t0
        self._due = now + self.cost / BUDGET
        st = self.st
        base, count = st.base, st.count
        if self._marks is None or base is not self._base or count < self._count:
            self._marks, self._base, self._count = marks_of(entries), base, count
            return None
        found = tally(entries, self._marks)
        steps = count - self._count
        self._marks, self._count = found.marks, count
        if found.untimed is not None:
            self.off = f"torch records no collective timings here ({found.untimed})"
            log.info("profd_client: no collective wait in heartbeats: %s", self.off)
            return None
        self._timed = self._timed or found.timed > 0
        if found.lost or not self._timed:
            return None
        return [min(found.seconds, P.MAX_SECONDS), min(steps, P.MAX_STEP)]
