"""The planner: a start's schedule plus what its targets last reported, to absolute cycles.

Pure: no sockets, no index, no clock of its own (``now`` is an argument, in the same clock as
each target's ``step_at``). The daemon plans for the targets in its registry; the cluster
coordinator in profctl plans once for targets reported by many nodes, with the same code, so
nothing here assumes where a target lives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from profd.scheduling import schedule as sch
from profd.scheduling.refusal import Refused
from profd_client.protocol import MAX_STEP, ErrorCode

#: How far ahead ``--next`` looks, in seconds of each target's step rate, so the arm message
#: reaches every rank before its first step starts, even on a loaded node.
NEXT_LEAD_S = 1.0
#: How often one ``--next`` session may be moved to later steps because a rank got it late.
MAX_REPLANS = 3
#: Minimum steps of lead, also for a client that has not reported a step rate yet.
UNKNOWN_RATE_LEAD = 10
#: Extra lead for ``--backend nsys``: ranks are armed only after ``nsys start`` returned.
NSYS_START_LEAD_S = 5.0
#: How long a ``--next`` plan may make one target wait for another's steps, at the waiting
#: target's rate... A target's step and rate are its own claims: one far ahead of the rest
#: (a peer reporting step 10^9, or a rate that extrapolates there) would otherwise hold every
#: other rank of its job armed for years, and busy for every explicit start.
MAX_NEXT_WAIT_S = 600.0
#: ...or how many steps, whichever is more: a slow or new target's rate is small or unknown.
MAX_NEXT_WAIT_STEPS = 1000


@dataclass(frozen=True)
class TargetState:
    """What the planner knows of one target: its last reported step and rate."""

    name: str  # for messages: "trainer rank 3 (pid 123)"
    step: int  # steps completed when last reported
    sps: float  # steps per second, 0 if unknown
    step_at: float  # when ``step`` was reported, in the caller's clock
    busy_until: int = 0  # first step free of the target's other live sessions
    #: Still inside attach(), before step 1 (``attach(wait=...)``).
    attaching: bool = False

    def estimated_step(self, now: float) -> float:
        """Steps done by ``now``, extrapolated from the last report."""
        return self.step + self.sps * max(0.0, now - self.step_at)

    def armable_from(self, done: int) -> int:
        """The first step a plan sent now can start at, with ``done`` steps completed.

        A plan takes effect at a step boundary, so the step running now (``done + 1``) is too
        late, except while the process still waits in attach(), before its first step.
        """
        return done + (1 if self.attaching else 2)


def plan(
    sched: sch.Schedule,
    targets: Sequence[TargetState],
    now: float,
    backend: str = "torch",
    lead_s: float = NEXT_LEAD_S,
) -> list[sch.Cycle]:
    """The same absolute cycles for every target, or :class:`Refused`."""
    earliest = 1
    lead_s += NSYS_START_LEAD_S if backend == "nsys" else 0.0
    # What each target's own report asks for: its step extrapolated, plus the lead.
    # At least UNKNOWN_RATE_LEAD steps: a rate of 0 may just not be reported yet.
    needs = [
        math.ceil(t.estimated_step(now) + max(t.sps * lead_s, UNKNOWN_RATE_LEAD)) + 2
        for t in targets
    ]
    for t, need in zip(targets, needs, strict=True):
        earliest = max(earliest, need, t.busy_until)
    if earliest > MAX_STEP:
        raise Refused(ErrorCode.BAD_REQUEST, f"targets report steps beyond {MAX_STEP}")
    if not sched.explicit:
        _check_waits(targets, needs, now)
    try:
        cycles = sch.resolve(sched, earliest)
    except sch.ScheduleError as exc:
        raise Refused(ErrorCode.BAD_REQUEST, str(exc)) from None
    if cycles[-1][2] > MAX_STEP:
        raise Refused(ErrorCode.BAD_REQUEST, f"steps {sch.describe(cycles)} go beyond {MAX_STEP}")
    if sched.explicit:
        check_reachable(cycles, targets, now, warmup=bool(sched.warmup))
    return cycles


def _check_waits(targets: Sequence[TargetState], needs: Sequence[int], now: float) -> None:
    """:class:`Refused` if one target's report would make another wait beyond the bound.

    Only reports count: queueing after a target's own live sessions (``busy_until``) is the
    daemon's own knowledge, and the operator's ``--roundup`` and ``--warmup`` are theirs.
    """
    if len(targets) < 2:
        return
    top, first = max(zip(targets, needs, strict=True), key=lambda x: x[1])
    for t, need in zip(targets, needs, strict=True):
        wait = first - need
        if wait <= max(t.sps * MAX_NEXT_WAIT_S, MAX_NEXT_WAIT_STEPS):
            continue
        raise Refused(
            ErrorCode.UNREACHABLE,
            f"--next: {t.name} ({_where(t, now)}) would wait {wait} steps for {top.name}"
            f" ({_where(top, now)}); a --next plan makes no rank wait more than"
            f" {MAX_NEXT_WAIT_STEPS} steps or {MAX_NEXT_WAIT_S:.0f} s: select them apart"
            " (--ranks, --pid)",
        )


def _where(t: TargetState, now: float) -> str:
    rate = f"{t.sps:.3g} steps/s" if t.sps else "no rate yet"
    return f"at step {int(t.estimated_step(now))}, {rate}"


def check_reachable(
    cycles: Sequence[sch.Cycle], targets: Sequence[TargetState], now: float, warmup: bool = False
) -> None:
    """:class:`Refused` unless every target can still be armed for ``cycles``: explicit
    steps, or steps a cluster coordinator resolved for targets on many nodes."""
    first = cycles[0][0]
    for t in targets:
        est = t.estimated_step(now)
        earliest_step = t.armable_from(int(est))
        if first < earliest_step:
            what = "already passed" if first <= est else "starts before it can be armed"
            warm = f" (with --warmup the first step is {first})" if warmup else ""
            hint = (
                "; step 1 can be captured only by an [[auto]] rule on a process that"
                " waits in attach() (PROFD_ATTACH_WAIT=SECONDS)"
                if first == 1
                else ""
            )
            raise Refused(
                ErrorCode.STEPS_PASSED,
                f"steps {sch.describe(list(cycles))} {what} for {t.name} (at step {int(est)}; the"
                f" earliest step is {earliest_step}){warm}{hint}",
            )
        if t.busy_until > first:
            raise Refused(
                ErrorCode.BUSY,
                f"{t.name} is busy until step {t.busy_until}; use --next to queue after it",
            )


def can_join(cycles: Sequence[sch.Cycle], t: TargetState) -> str | None:
    """Why a target attaching now cannot join a running plan, or None if it can."""
    if cycles[0][0] >= t.armable_from(t.step):
        return None
    why = f"attached at step {t.step}, after the rule's first step"
    if cycles[0][0] == 1:
        why += " (step 1 needs PROFD_ATTACH_WAIT on the job)"
    return why


def replannable(sched: sch.Schedule, backend: str, fixed: bool, revision: int) -> bool:
    """Only ``--next`` steps are the planner's to move, and only a bounded number of times.

    ``fixed``: the steps are promised elsewhere (an ``[[auto]]`` rule, a capture begun).
    """
    return backend == "torch" and not fixed and revision < MAX_REPLANS and not sched.explicit


def replan_lead(revision: int, took: float) -> float:
    """Lead for moving steps after an arm took ``took`` seconds to reach a rank.

    At least twice the delay just seen (the arm's own share of it can be nearly all), and
    twice the lead of the last plan.
    """
    return max(NEXT_LEAD_S * 2.0 ** (revision + 1), 2.0 * took)
