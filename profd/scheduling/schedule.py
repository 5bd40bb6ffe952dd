"""Schedules: every form the user can write, resolved to absolute step cycles.

Steps are 1-indexed: step k is the k-th step. ``--steps A:B`` captures A..B-1 (NeMo RL's
rule). A cycle is ``(warmup_start, start, stop)``; the daemon sends the same cycles to every
targeted rank, so all ranks capture the same steps without synchronised clocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from profd_client.protocol import MAX_CYCLE_STEPS, MAX_CYCLES, MAX_STEP

Cycle = tuple[int, int, int]

#: Steps one process profiles in one session, warm-ups included. Each field has its own
#: limit, but they multiply: ``--repeat 1000 --active 10000`` is ten million steps (GBs of
#: trace per rank), and expanding it stalled the daemon for seconds.
SESSION_STEPS = 10_000
#: The same, summed over a session's processes on one node (what its files, index rows and
#: ``session.json`` grow with).
SESSION_WORK = 100_000


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Schedule:
    kind: str  # range | list | next | at
    start: int = 0  # range/at: first captured step
    stop: int = 0  # range: first step not captured
    steps: tuple[int, ...] = ()  # list
    active: int = 1
    warmup: int = 0
    repeat: int = 1
    roundup: int = 1

    @property
    def explicit(self) -> bool:
        """Explicit schedules name steps; ``next`` is resolved against the targets."""
        return self.kind != "next"

    @property
    def profiled(self) -> int:
        """Steps each target profiles, warm-ups included."""
        if self.kind == "list":
            return len(self.steps) * (1 + self.warmup)
        length = self.stop - self.start if self.kind == "range" else self.active
        return self.repeat * (length + self.warmup)

    def flags(self) -> str:
        """The flags that multiply into :attr:`profiled`, for a refusal."""
        w = f"--warmup {self.warmup}"
        if self.kind == "list":
            return f"{len(self.steps)} --steps" + (f" x (1 + {w})" if self.warmup else "")
        one = (
            f"--steps {self.start}:{self.stop}"
            if self.kind == "range"
            else f"--active {self.active}"
        )
        if self.warmup:
            one = f"({one} + {w})"
        return f"--repeat {self.repeat} x {one}" if self.repeat > 1 else one


def _int(value: Any, what: str, minimum: int, maximum: int = MAX_STEP) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ScheduleError(f"{what} must be an integer, got {str(value)[:40]!r}")
    text = str(value).strip()
    if len(text) > 20:
        raise ScheduleError(f"{what} must be an integer up to {maximum}, got {text[:40]!r}")
    try:
        n = int(text)
    except ValueError:
        raise ScheduleError(f"{what} must be an integer, got {value!r}") from None
    if n < minimum:
        raise ScheduleError(f"{what} must be >= {minimum}, got {n}")
    if n > maximum:
        raise ScheduleError(f"{what} must be <= {maximum}, got {n}")
    return n


def parse(spec: Mapping[str, Any]) -> Schedule:
    """From a start spec: ``steps`` ("A:B" or "1,2,5"), ``at_step``, ``next`` and modifiers."""
    steps = spec.get("steps")
    at = spec.get("at_step")
    forms = [n for n, v in (("--steps", steps), ("--at-step", at)) if v is not None]
    if spec.get("next"):
        forms.append("--next")
    if len(forms) > 1:
        raise ScheduleError(f"use one of --steps, --next, --at-step (got {' and '.join(forms)})")
    warmup = _int(spec.get("warmup") or 0, "--warmup", 0, MAX_CYCLE_STEPS - 1)
    repeat = _int(spec.get("repeat") or 1, "--repeat", 1, MAX_CYCLES)
    roundup = _int(spec.get("roundup") or 1, "--roundup", 1)
    active_given = spec.get("active") is not None
    active = _int(spec.get("active") or 1, "--active", 1, MAX_CYCLE_STEPS - warmup)
    if steps is not None:
        if active_given:
            raise ScheduleError("--active goes with --next or --at-step; --steps names the steps")
        text = str(steps).strip()
        if ":" in text:
            a_txt, _, b_txt = text.partition(":")
            try:
                if max(len(a_txt), len(b_txt)) > 20:
                    raise ValueError
                a, b = int(a_txt), int(b_txt)
            except ValueError:
                raise ScheduleError(f"--steps {text}: start and stop must be integers") from None
            if b > MAX_STEP:
                raise ScheduleError(f"--steps {text}: steps go up to {MAX_STEP}")
            if a < 1:
                raise ScheduleError(f"--steps {text}: steps are 1-indexed, start must be >= 1")
            if a >= b:
                raise ScheduleError(f"--steps {text}: start must be less than stop")
            if b - a + warmup > MAX_CYCLE_STEPS:
                raise ScheduleError(
                    f"--steps {text}: {b - a} steps (with warm-up) is more than {MAX_CYCLE_STEPS}"
                    " in one cycle; use --repeat or a list"
                )
            sched = Schedule("range", start=a, stop=b, warmup=warmup, repeat=repeat)
        else:
            items = [s for s in text.split(",") if s.strip()]
            if not items:
                raise ScheduleError("--steps is empty")
            if len(items) > MAX_CYCLES:
                raise ScheduleError(f"--steps lists {len(items)} steps (at most {MAX_CYCLES})")
            nums = sorted({_int(s, f"--steps item {s.strip()!r}", 1) for s in items})
            if repeat != 1:
                raise ScheduleError("--repeat does not apply to a --steps list")
            sched = Schedule("list", steps=tuple(nums), warmup=warmup)
        if roundup != 1:
            raise ScheduleError("--roundup goes with --next or --at-step")
    elif at is not None:
        n = _int(at, "--at-step", 1)
        sched = Schedule(
            "at", start=n, active=active, warmup=warmup, repeat=repeat, roundup=roundup
        )
    else:
        sched = Schedule("next", active=active, warmup=warmup, repeat=repeat, roundup=roundup)
    if sched.profiled > SESSION_STEPS:
        raise ScheduleError(
            f"{sched.flags()} is {sched.profiled} steps per process; a session profiles at most"
            f" {SESSION_STEPS}"
        )
    return sched


def resolve(s: Schedule, earliest: int = 1) -> list[Cycle]:
    """Absolute cycles. ``earliest`` is the first step every target can still start (``next``)."""
    w = s.warmup
    if s.kind == "list":
        cycles = [(n - w, n, n + 1) for n in s.steps]
        for (_, _, prev_stop), (ws, n, _) in itertools.pairwise(cycles):
            if ws < prev_stop:
                raise ScheduleError(f"--warmup {w} overlaps the capture before step {n}")
        _check_warmup(cycles[0], w)
        return cycles
    if s.kind == "range":
        first, length = s.start, s.stop - s.start
    else:
        first = s.start if s.kind == "at" else earliest + w
        first = max(first, 1 + w) if s.kind == "next" else first
        if s.roundup > 1:
            first = -(-first // s.roundup) * s.roundup
        length = s.active
    cycles = []
    for i in range(s.repeat):
        a = first + i * (length + w)
        cycles.append((a - w, a, a + length))
    _check_warmup(cycles[0], w)
    return cycles


def _check_warmup(c: Cycle, w: int) -> None:
    if c[0] < 1:
        raise ScheduleError(f"--warmup {w} needs the first captured step to be > {w}")


def describe(cycles: list[Cycle]) -> str:
    return ", ".join(f"{a}:{b}" if b - a > 1 else str(a) for _, a, b in cycles)


def check_work(cycles: Sequence[Cycle], targets: int) -> None:
    """:class:`ScheduleError` unless ``targets`` processes may each profile ``cycles``."""
    each = sum(b - w for w, _, b in cycles)
    if each > SESSION_STEPS:
        raise ScheduleError(
            f"steps {describe(list(cycles))} are {each} steps per process; a session profiles"
            f" at most {SESSION_STEPS}"
        )
    if each * targets > SESSION_WORK:
        raise ScheduleError(
            f"{each} steps on each of {targets} processes is {each * targets}; a session"
            f" profiles at most {SESSION_WORK} steps on one node: select fewer ranks or steps"
        )


def steps_of(cycles: list[Cycle]) -> list[int]:
    return [n for _, a, b in cycles for n in range(a, b)]
