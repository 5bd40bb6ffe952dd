"""Samples aligned by the global step (docs/design.md "Watch", Samples): which steps, and what id.

Pure arithmetic on step numbers. Every node's daemon computes a job's next sample from its
own ranks' steps alone: sample ``k`` records steps ``N·k+1 … N·k+sample_steps`` and is called
``sample-{job}-{N·k+1}``, so the nodes of a multi-node job sample the same steps under one
session id (one S3 directory, one ``profctl --cluster report``) without talking.

Nodes agree on ``k`` because it is the first sample every rank can still make, a function of
the step: two nodes whose ranks are at the same step pick the same ``k``. They can only
disagree when one looks just as the job passes a sample's last armable step, and then that
node skips the sample (it could not have made it), which is what a node still busy with the
last sample does anyway. A sample is armed only shortly before its steps
(:data:`ARM_AHEAD_S`): an armed sample makes its ranks busy up to its steps, and an
operator's ``--next`` capture, or an incident's, must not queue behind a sample far ahead.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from profd.scheduling import planner
from profd.scheduling.schedule import Cycle
from profd_client import protocol as P

#: The label every sample session carries.
LABEL = "watch:sample"
#: Steps the profiler runs before a sample's first recorded step: torch.profiler's first
#: active step carries its start-up cost, which would read as a slow step of every rank.
WARMUP = 1
#: How long before its first step a sample is armed, in seconds of the job's step rate (and at
#: least :data:`MIN_AHEAD_STEPS`): longer than the planner's lead plus a few loop ticks, so
#: every node's daemon looks at least once while the sample can still be made.
ARM_AHEAD_S = 5.0
MIN_AHEAD_STEPS = 2 * planner.UNKNOWN_RATE_LEAD + 4
#: A sample is a glance, not a capture: its files are every rank's, every ``sample_every``.
MAX_SAMPLE_STEPS = 100
#: A sample not over within this many of the job's typical steps per recorded step (or
#: ``[watch] sample_timeout`` seconds, whichever is longer), counted from its warm-up step,
#: ends with what it got (:func:`time_limit`): a rank that stopped stepping must not hold
#: its job's sampling for good.
TIMEOUT_STEPS = 50
#: ``[watch] sample_timeout``'s default: the least time a sample is given.
MIN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SampleRules:
    """``[watch]``'s sample keys: ``sample_every`` steps (0: off), ``sample_steps`` recorded
    steps per sample, ``keep_samples`` seconds a sample's trace files are kept, ``timeout``
    the least seconds a sample is given (``sample_timeout``: :func:`time_limit`)."""

    sample_every: int = 0
    sample_steps: int = 2
    keep_samples: float = 86400.0
    timeout: float = MIN_TIMEOUT_S

    @property
    def on(self) -> bool:
        return self.sample_every > 0


def problem(every: int, steps: int) -> str | None:
    """Why ``sample_every``/``sample_steps`` cannot work together, or None."""
    if every and not 1 <= steps <= MAX_SAMPLE_STEPS:
        return f"sample_steps must be 1 to {MAX_SAMPLE_STEPS}, got {steps}"
    if every and steps + WARMUP > every:
        return (
            f"sample_steps ({steps}) plus its warm-up step must fit in sample_every ({every}):"
            " samples would overlap"
        )
    return None


def cycle_of(every: int, steps: int, k: int) -> Cycle:
    """Sample ``k``'s cycle: warm-up at ``N·k``, recording ``N·k+1 … N·k+steps``."""
    first = every * k + 1
    return (first - WARMUP, first, first + steps)


def first_k(every: int, earliest: int) -> int:
    """The first ``k >= 1`` whose sample starts (its warm-up step) at or after ``earliest``."""
    # every * k + 1 - WARMUP >= earliest
    return max(1, -(-(earliest - 1 + WARMUP) // every))


def sample_id(job: str, first: int) -> str:
    """The sample's session id on every node: ``sample-{job}-{first step}``; a job name too
    long for an id is replaced by a digest of it (the same on every node)."""
    sid = f"sample-{job}-{first}"
    try:
        P.SESSION_ID.check(sid, "session")
    except P.ProtocolError:
        digest = hashlib.sha256(job.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        sid = f"sample-{digest}-{first}"
    return sid


def _lead(t: planner.TargetState) -> int:
    """The planner's ``--next`` lead for ``t``, in steps: how far ahead an arm must be."""
    return math.ceil(max(t.sps * planner.NEXT_LEAD_S, planner.UNKNOWN_RATE_LEAD)) + 2


def _ahead(t: planner.TargetState) -> int:
    return max(math.ceil(t.sps * ARM_AHEAD_S), MIN_AHEAD_STEPS)


def holds_back(first: int, t: planner.TargetState, now: float) -> bool:
    """Whether a sample starting at step ``first`` would keep ``t`` armed, and busy for any
    other capture, longer than a ``--next`` plan may make a rank wait: a sample is a glance a
    few seconds ahead, never a reason to hold a rank."""
    wait = first - t.estimated_step(now)
    return wait > max(t.sps * planner.MAX_NEXT_WAIT_S, planner.MAX_NEXT_WAIT_STEPS)


def due(rules: SampleRules, targets: Sequence[planner.TargetState], now: float) -> Cycle | None:
    """The sample to arm on ``targets`` (one job's ranks on this node) now, or None: the
    first sample every rank can still make, once it is less than :data:`ARM_AHEAD_S` of the
    fastest rank's steps ahead; None too when a rank would wait for it longer than
    :func:`holds_back` allows (ranks far apart: the job is not sampled until they agree)."""
    if not rules.on or not targets:
        return None
    earliest = 1
    horizon = 0.0
    for t in targets:
        est = t.estimated_step(now)
        earliest = max(earliest, math.ceil(est) + _lead(t), t.busy_until)
        horizon = max(horizon, est + _ahead(t))
    cycle = cycle_of(rules.sample_every, rules.sample_steps, first_k(rules.sample_every, earliest))
    if cycle[2] > P.MAX_STEP or cycle[0] > horizon:
        return None
    if any(holds_back(cycle[0], t, now) for t in targets):
        return None
    return cycle


def typical_step_s(rates: Sequence[float]) -> float | None:
    """A job's typical step (seconds) from its ranks' rates (steps/s; 0: unknown), or None.
    The lower median: a rank that stopped (rate 0) does not count, and fewer than half of
    the ranks claiming slow steps cannot lengthen what the job is given."""
    steps = [1.0 / r for r in rates if r > 0]
    return statistics.median_low(steps) if steps else None


def time_limit(rules: SampleRules, step_s: float | None) -> float:
    """Seconds a sample is given from its warm-up step: ``sample_steps`` x
    :data:`TIMEOUT_STEPS` typical steps, at least ``rules.timeout``."""
    return max(rules.timeout, TIMEOUT_STEPS * rules.sample_steps * (step_s or 0.0))


#: A rank's step may run ahead of its last plausible one by this many times what its rate
#: allows for the time between them...
JUMP_FACTOR = 4.0
#: ...plus this many steps (a rate measured over a slower stretch, a report sent late).
JUMP_SLACK = 100
#: The shortest stretch a rank's rate is measured over (seconds).
RATE_S = 1.0
#: The rate (steps/s) a rank is always allowed, whatever was measured: its first stretch may
#: include building its model and slow warm-up steps (a few steps a second) before it runs a
#: thousand a second, which is no jump; a claimed step 10^9 still is.
FLOOR_SPS = 1000.0
#: Seconds a rank that jumped must step on from there, never going back, before its new steps
#: count (``step(n)`` in a resumed run that had been stepping already, or a job whose steps
#: became far faster than its warm-up's); its rate is then measured afresh from the jump.
SETTLE_S = 30.0


@dataclass
class _Trusted:
    step: int  # its last plausible step, reported at ``at``
    at: float
    base: tuple[int, float]  # where its rate is measured from
    sps: float | None = None  # its fastest rate over RATE_S or more; None: not measured yet
    jumped: tuple[int, float] | None = None  # since its last jump: (step, when first seen)


class StepTrust:
    """Which ranks' steps may decide where a sample lands: a rank's step that jumps beyond
    what its rate allows since its last plausible report (a process claiming step 10^9) is
    ignored and counted, and the rank sits samples out until it has stepped on from its new
    step, never going back, for :data:`SETTLE_S`. A rank whose rate is not measured yet may
    start from any step (a resumed run attaches, then sets its step count); one whose count
    goes back (a new run in the same process) starts again from there."""

    def __init__(self) -> None:
        self.ranks: dict[Hashable, _Trusted] = {}
        #: Jumps ignored since the daemon started (``status``).
        self.implausible = 0

    def observe(self, key: Hashable, step: int, at: float) -> bool:
        """The rank ``key`` reported ``step`` at ``at`` (when the report arrived, in a
        monotonic clock): whether its step may be planned with now."""
        r = self.ranks.get(key)
        if r is None or step < r.step:
            self.ranks[key] = _Trusted(step, at, (step, at))
            return True
        if r.jumped is None or step < r.jumped[0]:
            if r.sps is None or _plausible(r.sps, r.step, r.at, step, at):
                r.step, r.at, r.jumped = step, at, None
                b_step, b_at = r.base
                if at - b_at >= RATE_S:
                    # Its fastest stretch: a pause (a checkpoint) must not make its next
                    # steps look like a jump.
                    r.sps = max(r.sps or 0.0, (step - b_step) / (at - b_at))
                    r.base = (step, at)
                return True
        elif at - r.jumped[1] < SETTLE_S:
            return False
        else:
            j_step, j_at = r.jumped
            sps = (step - j_step) / (at - j_at)
            self.ranks[key] = _Trusted(step, at, (step, at), sps or None)
            return True
        r.jumped = (step, at)
        self.implausible += 1
        return False

    def forget(self, keep: Iterable[Hashable]) -> None:
        """Only the ranks in ``keep`` are still attached."""
        kept = set(keep)
        for key in [k for k in self.ranks if k not in kept]:
            del self.ranks[key]


def _plausible(sps: float, step0: int, at0: float, step: int, at: float) -> bool:
    rate = max(sps, FLOOR_SPS)
    return step - step0 <= JUMP_SLACK + JUMP_FACTOR * rate * max(0.0, at - at0)
