"""What makes an incident kind (docs/design.md "Watch", "Incidents"): everything the daemon
and profctl need to know about one kind, together, so no other module lists kinds.

A kind found from the step ledger brings its rule too (:attr:`Kind.tick_rule`): the
detectors read every rank of a job once a tick (:class:`JobReading`) and hand that reading to
each such rule, which says what it found (:class:`Finding`). A new kind of that sort is one
module of ``kinds/`` and one line of the registry. The two kinds whose evidence comes from
elsewhere own their feeds: ``hang`` (``daemon/watch/stall_watch``: a stalled job's stacks)
and ``straggler`` (``daemon/sessions/samples``: a processed sample's statistics).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from profd.config import WatchConfig
from profd.watch.incident_record import Incident, Suspect
from profd.watch.slowdown_rules import WatchRules


@dataclass(frozen=True)
class RankSteps:
    """One rank's steps in one detector tick: the heartbeat intervals of its step ledger that
    ended since the previous tick. Each interval ends in exactly one tick, so adding ticks
    up counts every step once (a detector's window, read again every tick, would not)."""

    role: str
    rank: int
    #: The median of those intervals' step times (None: none ended in this tick).
    step_ms: float | None
    steps: int


@dataclass(frozen=True)
class JobTick:
    """What one detector tick read of a job's ranks on this node, at ``at`` (unix time). A
    tick with no ranks is the incident resolving: what is final then."""

    at: float
    ranks: Sequence[RankSteps] = ()


class TickRank(msgspec.Struct, frozen=True, gc=False):
    """One rank of a job in one detector tick: who it is, its step now, and what its step
    ledger read (``Ledgers.watch``, all times ms). Made for every rank every tick: a C-built
    struct (a fifth of a named tuple's cost to make), outside the cyclic collector (numbers
    and strings only)."""

    host: str
    pid: int
    role: str
    rank: int
    step: int
    #: The median p50 of the intervals since the last tick, and the steps they cover
    #: (None, 0: no interval ended since).
    tick_ms: float | None = None
    tick_steps: int = 0
    #: The ledger's epoch; None: no ledger yet.
    epoch: int | None = None
    #: The window's quantile (``slowdown_rules.WINDOW_Q``) of the intervals' p50s, and the
    #: steps they cover.
    window_ms: float | None = None
    window_steps: int = 0
    #: The longest step that ended in the intervals since the last tick (0: none).
    tick_top_ms: float = 0.0
    #: The collective wait per step over the window, and the steps it covers.
    wait_ms: float | None = None
    wait_steps: int = 0


class JobReading(msgspec.Struct, frozen=True):
    """Every rank of one job on this node (its owner's processes) as one detector tick read
    them, at monotonic ``now``: what each tick rule is fed (made for every job every tick: a
    C-built struct, not a frozen dataclass, whose fields each cost a ``__setattr__``)."""

    job: str
    now: float
    ranks: Sequence[TickRank]
    #: A rank came, left, set its step count or restarted since the last tick: the job's
    #: step time before is not its baseline any more.
    changed: bool
    #: A rank's median step (ms) over ``[watch] window`` and the steps it rests on ((None,
    #: 0): none): a second read of its ledger, made only for the ranks a rule asks about.
    median: Callable[[TickRank], tuple[float | None, int]]


@dataclass(frozen=True)
class Finding:
    """What a tick rule found: an incident of its kind to open (or to hold open) in the job
    of the reading."""

    role: str | None
    suspects: Sequence[Suspect]
    step: int | None
    evidence: dict[str, Any]


class TickRule(Protocol):
    """A kind's rule over one job, made once per job (it keeps its holds and baselines
    between ticks) and fed every tick; made again when ``[watch]`` changes."""

    def observe(self, job: JobReading) -> Sequence[Finding]: ...


def only_role(ranks: Sequence[TickRank]) -> str | None:
    """The role of every rank in ``ranks`` when they share one (None: several, or none)."""
    roles = {r.role for r in ranks}
    return next(iter(roles)) if len(roles) == 1 else None


#: The incident's ``lost_rank_s`` once ``tick`` is counted (``Incident.lost_rank_s`` holds
#: what was counted before): rank-seconds its condition cost the job's ranks here.
Loss = Callable[[Incident, JobTick], float]


def no_loss(inc: Incident, tick: JobTick) -> float:
    """The loss of a kind with no formula of its own: what was counted stays."""
    return inc.lost_rank_s


@dataclass(frozen=True)
class Kind:
    #: The incident's ``kind``, and what ``profctl incidents --kind`` accepts.
    name: str
    #: The ``kind`` label of ``profd_incidents_total``.
    label: str
    #: One open incident per job, whatever ranks it lists (else one per job and rank).
    job_wide: bool
    #: An incident of this kind arms an automatic capture (a stalled job makes no step a
    #: capture could start at: its stacks are its evidence instead).
    captures: bool
    #: The rule's hook after a restart: seconds an open incident restored from the index
    #: stays open for its rule, starting afresh, to report it again.
    grace: Callable[[WatchConfig], float]
    #: The human text: what was noticed, from the incident and its suspects named
    #: (``"worker rank 3 on n1, ..."``, empty when none); the log line and ``describe``.
    text: Callable[[Incident, str], str]
    #: Rank-seconds lost (``Incident.lost_rank_s``), from the kind's evidence and each tick
    #: of its job while the incident is open (:class:`JobTick`).
    loss: Loss = no_loss
    #: Its rule over the step ledger, made per job from ``[watch]``'s thresholds (None: the
    #: kind is found elsewhere, by a feed of its own).
    tick_rule: Callable[[WatchRules], TickRule] | None = None
    #: The whole job changed at once (every rank slowed): its black box looks for the step
    #: the job's step time changed at, and its capture is compared with the job's last
    #: sample before it, not only its suspects with their peers.
    job_changed: bool = False
    #: Its suspects are the ranks its rule saw; where its black box shows the others waiting
    #: for some of them (a lockstep job), those are its suspects instead.
    suspects_from_blackbox: bool = False


def rule_grace(cfg: WatchConfig) -> float:
    """Twice a window and a hold: the ranks attach again first (three missed heartbeats), and
    a window of their steps must come before any judgement."""
    return 2 * (cfg.window + cfg.hold)


def baseline_grace(cfg: WatchConfig) -> float:
    """:func:`rule_grace` and half a baseline: a job-wide rule compares against one."""
    return rule_grace(cfg) + cfg.baseline / 2


def plain_text(inc: Incident, who: str) -> str:
    """The text of a kind with no figures of its own to show (and of an unknown kind)."""
    return f"{inc.kind} in job {inc.job}" + (f": {who}" if who else "")


def pct(ratio: object) -> str:
    return f"{(float(ratio) - 1.0) * 100:+.0f}%" if isinstance(ratio, int | float) else "?"


def stepped(ranks: Sequence[RankSteps]) -> list[RankSteps]:
    """The ranks that made steps in a tick, with a step time."""
    return [r for r in ranks if r.steps > 0 and r.step_ms is not None and r.step_ms > 0]


def num(v: object, default: float = 0.0) -> float:
    """A figure of an incident's evidence (a record of another version may lack it)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default
