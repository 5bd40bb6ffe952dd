"""The detectors' rules (docs/design.md "Watch"): pure functions of step times and a clock.

The daemon feeds them from the step ledger once a tick; they keep only what their hold times
need. Robust by construction: medians, never means; a noise floor from each job's own
spread; a condition must hold for ``hold`` seconds, evaluation after evaluation, before it
fires; and a rule that lacks the data it needs (a baseline too short, a rank alone in its
role, no steps in the window) says nothing rather than guess.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Protocol

from profd.watch.stats import others_medians, sorted_median

#: The noise floor is this many times the job's own relative spread (median absolute
#: deviation over the median): a threshold below the job's jitter would fire on jitter.
NOISE_K = 3.0
#: A change of exactly the threshold must fire, yet a changed job's ticks scatter around it:
#: a condition starts to hold at this much of the threshold (20 % from 15 %), which steady
#: jitter of ±10 % cannot reach (``tests/unit/test_slowdown_rules.py`` measures both).
MARGIN = 0.75
#: Once a condition holds, it keeps holding while the change stays above this much of the
#: threshold (hysteresis): medians of a job that really changed scatter around the threshold,
#: and one tick below it must not restart the hold.
KEEP = 0.5
#: The window is judged by this quantile of its ticks rather than their median: a change is
#: seen once it covers about a third of the window (20-25 s of 60) and fires after the hold
#: (30 s), inside docs/design.md's 60 s; a steady job's ticks stay far below the start threshold.
WINDOW_Q = 0.7
#: Fewest steps a window (or a baseline) must hold to be compared at all.
MIN_STEPS = 8


@dataclass(frozen=True)
class WatchRules:
    """``[watch]``'s thresholds (fractions) and durations (seconds), as docs/design.md says."""

    window: float = 60.0
    baseline: float = 600.0
    hold: float = 30.0
    regression: float = 0.2
    slow_rank: float = 0.25
    spike: float = 5.0


def relative_spread(values: Sequence[float]) -> float:
    """Median absolute deviation over the median (0 for fewer than 3 values)."""
    if len(values) < 3:
        return 0.0
    m = median(values)
    if m <= 0:
        return 0.0
    return float(median(abs(v - m) for v in values) / m)


@dataclass
class _Hold:
    """When a condition started to hold without a break (None: it does not hold now)."""

    since: float | None = None

    def update(self, start: bool, keep: bool, now: float, hold: float) -> bool:
        """``start``: the condition is met; ``keep``: it is still nearly met (hysteresis)."""
        if self.since is None:
            if start:
                self.since = now
        elif not keep:
            self.since = None
        return self.since is not None and now - self.since >= hold


@dataclass(frozen=True)
class Regression:
    """A job's step time rose: window median, baseline median, how long it has held."""

    window_ms: float
    baseline_ms: float
    threshold: float  # the fraction it had to exceed (``regression`` or the noise floor)

    @property
    def ratio(self) -> float:
        return self.window_ms / self.baseline_ms


@dataclass
class RegressionRule:
    """One job: is its median step time over the last ``window`` seconds more than
    ``regression`` (or its noise floor) above its own baseline, for ``hold`` seconds?

    Fed one observation per tick: the median step time over the job's ranks in that tick
    and how many steps it covers. A tick without steps (a pause: checkpointing, evaluation)
    adds nothing, so a pause neither fires nor moves the baseline; :meth:`reset` (the job
    set its step count, or restarted) starts the baseline again.

    Incremental: the window's and the baseline's step times are kept sorted as ticks come
    and go (a daemon judges every job on its node every tick), and the noise floor, a pass
    over the baseline, is computed only when the window is above the threshold it can
    only raise.
    """

    rules: WatchRules
    _win: deque[tuple[float, float, int]] = field(default_factory=deque)  # (t, ms, steps)
    _base: deque[tuple[float, float, int]] = field(default_factory=deque)
    _win_ms: list[float] = field(default_factory=list)  # sorted
    _base_ms: list[float] = field(default_factory=list)  # sorted
    _win_n: int = 0
    _base_n: int = 0
    _hold: _Hold = field(default_factory=_Hold)

    def reset(self) -> None:
        self._win.clear()
        self._base.clear()
        self._win_ms.clear()
        self._base_ms.clear()
        self._win_n = self._base_n = 0
        self._hold = _Hold()

    def observe(self, now: float, step_ms: float, steps: int) -> Regression | None:
        r = self.rules
        if steps > 0 and step_ms > 0:
            self._win.append((now, step_ms, steps))
            insort(self._win_ms, step_ms)
            self._win_n += steps
        start = now - r.window
        while self._win and self._win[0][0] < start:
            o = self._win.popleft()
            del self._win_ms[bisect_left(self._win_ms, o[1])]
            self._win_n -= o[2]
            self._base.append(o)
            insort(self._base_ms, o[1])
            self._base_n += o[2]
        horizon = start - r.baseline
        while self._base and self._base[0][0] < horizon:
            o = self._base.popleft()
            del self._base_ms[bisect_left(self._base_ms, o[1])]
            self._base_n -= o[2]
        found = self._judge(now)
        start_ok = found is not None and found.ratio >= 1.0 + MARGIN * found.threshold
        keep = found is not None and found.ratio >= 1.0 + KEEP * found.threshold
        return found if self._hold.update(start_ok, keep, now, r.hold) else None

    def _judge(self, now: float) -> Regression | None:
        r = self.rules
        if self._win_n < MIN_STEPS or self._base_n < MIN_STEPS:
            return None
        oldest = self._base[0][0]  # the base holds steps, so it is not empty
        if now - oldest < r.window + r.baseline / 2:
            return None  # a baseline of less than half its length: too young to judge
        base_ms = self._base_ms
        b = sorted_median(base_ms)
        ws = self._win_ms
        w = ws[min(len(ws) - 1, int(WINDOW_Q * len(ws)))]
        if b <= 0 or w < b * (1.0 + KEEP * r.regression):
            return None  # below the threshold at its lowest: the noise floor can only raise it
        threshold = max(r.regression, NOISE_K * relative_spread(base_ms))
        if w >= b * (1.0 + KEEP * threshold):
            return Regression(w, b, threshold)
        return None


class RankWindow(Protocol):
    """One rank's figures over the window, as :class:`SlowRankRule` and :class:`WaitRule`
    read them (a detector tick's ``TickRank`` is one: read in place, nothing made per rank)."""

    @property
    def window_ms(self) -> float | None: ...  # its step time's quantile (ms); None: none yet

    @property
    def window_steps(self) -> int: ...  # the steps that covers

    @property
    def wait_ms(self) -> float | None: ...  # its collective wait per step (ms); None: unsent

    @property
    def wait_steps(self) -> int: ...  # the steps the wait covers


@dataclass(frozen=True)
class SlowRank:
    """A rank slower than the other ranks of its role."""

    rank: int
    step_ms: float
    peers_ms: float  # the median of the role's other ranks
    threshold: float

    @property
    def ratio(self) -> float:
        return self.step_ms / self.peers_ms


@dataclass
class SlowRankRule:
    """One role of one job: which ranks have stayed more than ``slow_rank`` (or the role's
    noise floor) slower than the median of the role's other ranks for ``hold`` seconds?

    Fed once a tick with each rank's step time over the last ``window`` seconds (its
    :data:`WINDOW_Q` quantile, as for the regression rule) and the steps it covers.
    Leave-one-out, so it is right at 2 ranks; lockstep ranks (DDP) all step at the slowest
    one's pace and never differ, which is why a straggler in a synchronous job is
    :class:`WaitRule`'s business where collective waits are known, and the straggler rule's
    (samples) elsewhere. A rank with fewer than
    :data:`MIN_STEPS` steps in the window (attached late, paused) is left out of the role.
    """

    rules: WatchRules
    _holds: dict[int, _Hold] = field(default_factory=dict)

    def forget(self, rank: int) -> None:
        self._holds.pop(rank, None)

    def observe(self, now: float, ranks: Mapping[int, RankWindow]) -> list[SlowRank]:
        r = self.rules
        ready = sorted(
            (rank, w.window_ms)
            for rank, w in ranks.items()
            if w.window_ms is not None and w.window_steps >= MIN_STEPS and w.window_ms > 0
        )
        present = {rank for rank, _ in ready}
        for rank in [k for k in self._holds if k not in present]:
            del self._holds[rank]
        if len(ready) < 2:
            return []
        values = [ms for _, ms in ready]
        peers = others_medians(values)
        threshold = max(r.slow_rank, NOISE_K * relative_spread(values))
        out = []
        for (rank, ms), peer in zip(ready, peers, strict=True):
            if peer is None or peer <= 0:
                continue
            start = ms >= peer * (1.0 + MARGIN * threshold)
            keep = ms >= peer * (1.0 + KEEP * threshold)
            hold = self._holds.get(rank)
            if hold is None:
                if not start:
                    continue  # most ranks, most ticks: nothing to keep
                hold = self._holds[rank] = _Hold()
            if hold.update(start, keep, now, r.hold):
                out.append(SlowRank(rank, ms, peer, threshold))
            elif hold.since is None:
                del self._holds[rank]
        return out


#: Ranks step in lockstep when each one's step time is within this fraction of its role's
#: median: a collective every step makes each step as long as the slowest rank's.
LOCKSTEP = 0.05


@dataclass(frozen=True)
class WaitedFor:
    """A rank of a lockstep role that the role's other ranks wait for in collectives."""

    rank: int
    wait_ms: float  # its collective wait per step
    peers_wait_ms: float  # the median of the role's other ranks'
    step_ms: float  # the role's median step time
    threshold: float

    @property
    def share(self) -> float:
        """What the others wait for it, as a share of the step."""
        return (self.peers_wait_ms - self.wait_ms) / self.step_ms


@dataclass
class WaitRule:
    """One role of one job in lockstep: which ranks wait in collectives less than the median
    of the role's other ranks by more than ``slow_rank`` (or the role's noise floor) of a
    step, for ``hold`` seconds? A collective lasts until its last rank arrives, so the rank
    that arrives last waits least: the others wait for it, and every step is that much longer.

    Fed once a tick with each rank's step time over the window (as :class:`SlowRankRule`)
    and the steps it covers, and its collective wait per step (ms, None: unknown) and the
    steps that covers. Says nothing unless every rank of the role with :data:`MIN_STEPS`
    steps has a wait over as many, and their step times are within :data:`LOCKSTEP`
    (ranks that do not step together are :class:`SlowRankRule`'s). The noise floor is
    :data:`NOISE_K` times the waits' median absolute deviation (from 3 ranks), over the step.
    """

    rules: WatchRules
    _holds: dict[int, _Hold] = field(default_factory=dict)

    def observe(self, now: float, ranks: Mapping[int, RankWindow]) -> list[WaitedFor]:
        r = self.rules
        ready = sorted(
            (rank, w.window_ms, w.wait_ms, w.wait_steps)
            for rank, w in ranks.items()
            if w.window_ms is not None and w.window_steps >= MIN_STEPS and w.window_ms > 0
        )
        steps = [ms for _, ms, _, _ in ready]
        step_ms = median(steps) if steps else 0.0
        waits = [w for _, _, w, wn in ready if w is not None and wn >= MIN_STEPS]
        if (
            len(ready) < 2
            or len(waits) < len(ready)
            or step_ms <= 0
            or any(abs(ms - step_ms) > LOCKSTEP * step_ms for ms in steps)
        ):
            self._holds.clear()  # not comparable now: a hold starts again when it is
            return []
        present = {rank for rank, _, _, _ in ready}
        for rank in [k for k in self._holds if k not in present]:
            del self._holds[rank]
        mid = median(waits)
        # As relative_spread: two values' deviation is the very difference being judged.
        spread = median(abs(w - mid) for w in waits) if len(waits) >= 3 else 0.0
        floor = NOISE_K * spread / step_ms
        threshold = max(r.slow_rank, floor)
        out = []
        for (rank, _, wait, _), peer in zip(ready, others_medians(waits), strict=True):
            if peer is None or wait is None:
                continue
            share = (peer - wait) / step_ms
            start = share >= MARGIN * threshold
            keep = share >= KEEP * threshold
            hold = self._holds.get(rank)
            if hold is None:
                if not start:
                    continue
                hold = self._holds[rank] = _Hold()
            if hold.update(start, keep, now, r.hold):
                out.append(WaitedFor(rank, wait, peer, step_ms, threshold))
            elif hold.since is None:
                del self._holds[rank]
        return out
