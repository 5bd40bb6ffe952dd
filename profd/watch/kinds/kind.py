"""What makes an incident kind (docs/design.md "Watch", "Incidents"): everything the daemon
and profctl need to know about one kind, together, so no other module lists kinds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from profd.config import WatchConfig
from profd.watch.incident_record import Incident


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
