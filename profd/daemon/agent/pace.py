"""The heartbeat pace (docs/design.md "The wire", "Heartbeat pace"): how often the attached
processes heartbeat, so that the daemon's load stays bounded however many attach.

Every heartbeat costs the daemon a wake-up of ZeroMQ's I/O thread and of its loop, whatever
it carries: at 1,024 processes on 1 s heartbeats that alone is ~5 % of a core on a small VM
(docs/benchmarks.md "The transport's floor"). A heartbeat's step ledger summarises every
step since the last one, so a longer interval loses no step; it only makes ``ps``, ``top``
and the rules see a rank a little later. Past ``[daemon] max_heartbeats_per_s`` heartbeats
a second (256 by default: far above a node's training ranks), the interval doubles (1 s, 2 s,
4 s, ..., at most :data:`MAX_PACED_S`); it halves again only once the processes would fit in
:data:`HYSTERESIS` of the lower pace's budget, so a node hovering at a threshold does not
re-tell every process each tick. A node with the processes of a few training jobs (tens)
never leaves its base interval.
"""

from __future__ import annotations

import math

#: A paced interval is never set above this (s): the rules and ``top`` would see a rank too
#: late, and a dead one is dropped after three intervals.
MAX_PACED_S = 8.0
#: The pace goes back down only when the processes fit in this share of the lower pace's
#: budget.
HYSTERESIS = 0.75
#: Heartbeats a process may miss before it counts as gone.
MISSED_HEARTBEATS = 3


class HeartbeatPace:
    """The interval every attached process is told, from how many are attached.

    ``base`` is ``[daemon] heartbeat_interval``; ``max_rate`` the heartbeats a second the
    daemon takes before it paces (0: never). ``answers`` is how many heartbeats of a quiet
    client go unanswered per answer at the base pace: paced, answers keep their period in
    seconds, so a client notices a wedged daemon as soon as at the base interval.
    """

    def __init__(self, base: float, max_rate: float, answers: int) -> None:
        self.base = base
        self.max_rate = max_rate
        self.answers = answers
        #: The interval is ``base * factor``; a power of two.
        self.factor = 1
        #: The interval before the last change, and until when (monotonic) a process may
        #: still heartbeat at it: until three of its intervals after the news went out.
        self._before = base
        self._before_until = 0.0

    @property
    def interval(self) -> float:
        return self.base * self.factor

    @property
    def acks(self) -> int:
        """A quiet client's heartbeats per answer at this pace."""
        return max(1, round(self.answers / self.factor))

    def timeout(self, now: float) -> float:
        """Seconds of silence after which a process counts as gone at monotonic ``now``:
        three intervals, of the pace before the last change while a process told the new,
        shorter one may not have heartbeated since."""
        interval = self.interval
        if now < self._before_until:
            interval = max(interval, self._before)
        return MISSED_HEARTBEATS * interval

    def _fits(self, clients: int, factor: int, share: float = 1.0) -> bool:
        return clients <= share * self.max_rate * self.base * factor

    def _most(self) -> int:
        if self.base >= MAX_PACED_S:
            return 1
        return 1 << max(0, math.floor(math.log2(MAX_PACED_S / self.base)))

    def update(self, clients: int, now: float) -> bool:
        """The pace for ``clients`` attached processes at monotonic ``now``; whether it
        changed (every attached process must then be told)."""
        if self.max_rate <= 0:
            return False
        factor, most = self.factor, self._most()
        while factor < most and not self._fits(clients, factor):
            factor *= 2
        while factor > 1 and self._fits(clients, factor // 2, HYSTERESIS):
            factor //= 2
        if factor == self.factor:
            return False
        before = self.interval
        if now < self._before_until:
            before = max(before, self._before)
        self._before, self._before_until = before, now + MISSED_HEARTBEATS * before
        self.factor = factor
        return True
