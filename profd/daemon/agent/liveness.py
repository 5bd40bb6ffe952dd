"""Which attached processes are still there: heartbeats, process readings, restarts, lost arms."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import psutil

from profd.daemon.agent.pace import HeartbeatPace
from profd.daemon.clients.procstats import ProcReading
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.sessions.arming import Arms
from profd.daemon.sessions.state import Sessions

log = logging.getLogger("profd")

#: How long a local process that is alive may stay silent: stopping the profiler and
#: writing a large trace holds the GIL for many seconds (14-16 s were seen for a 444 MB
#: trace), and so does a training thread stuck in a C call; that is a stall, not a death.
STALL_GRACE_S = 600.0
#: Targets restored from a previous daemon must re-register within this many seconds.
RESTORE_GRACE_S = 10.0


class Liveness:
    def __init__(
        self, pace: HeartbeatPace, registry: Registry, sessions: Sessions, arms: Arms
    ) -> None:
        self.pace = pace
        self.registry = registry
        self.sessions = sessions
        self.arms = arms
        #: Targets of restored sessions, with the time they must be back by.
        self.orphans: dict[tuple[str, int], float] = {}
        #: Local pids for the process-statistics thread, republished by :meth:`tick` (it
        #: never reads the registry).
        self.read_pids: tuple[int, ...] = ()
        self._stall_logged: set[tuple[str, int]] = set()

    def drop(self, c: Client, why: str) -> None:
        log.info("client %s pid %s (%s rank %s) dropped: %s", c.host, c.pid, c.role, c.rank, why)
        self.registry.remove(c)
        self.sessions.gone(c.key, f"{why} at step {c.step}")

    def attached(self, c: Client) -> None:
        self.orphans.pop(c.key, None)
        self._stall_logged.discard(c.key)

    def restored(self, keys: Iterable[tuple[str, int]]) -> None:
        deadline = time.monotonic() + RESTORE_GRACE_S
        for key in keys:
            self.orphans[key] = deadline

    def tick(self, now: float) -> None:
        # Kernel pids: a process in a container claims its own namespace's pid.
        self.read_pids = tuple({c.node_pid for c in self.registry})
        timeout = self.pace.timeout(now)
        for c in self.registry.stale(now, timeout):
            if self._stalled(c, now):
                continue
            self.drop(c, f"missed heartbeats for {timeout:.0f}s")
        for key, deadline in list(self.orphans.items()):
            if now >= deadline:
                del self.orphans[key]
                if self.registry.lookup(key) is None:
                    self.sessions.gone(key, "process did not come back after a daemon restart")
        self.rearm_pending()

    def _stalled(self, c: Client, now: float) -> bool:
        """Silent but alive (on this node, where the pid can be checked): a capture writing
        its trace, or a training thread holding the GIL in a C call (a hang), stops the
        agent thread's heartbeats; the rank stays attached, so ``stacks`` and the hang rule
        still see it and py-spy reads it from outside."""
        if now - c.last_seen > STALL_GRACE_S or not psutil.pid_exists(c.node_pid):
            return False
        if c.key not in self._stall_logged:
            self._stall_logged.add(c.key)
            capturing = any(
                (t := s.targets.get(c.key)) is not None and t.reportable
                for s in self.sessions.live()
            )
            log.warning(
                "pid %s (%s rank %s) silent for %.0fs%s; alive, so waiting",
                c.pid,
                c.role,
                c.rank,
                now - c.last_seen,
                " while capturing" if capturing else "",
            )
        return True

    def rearm_pending(self) -> None:
        """Send ``arm`` again to targets that have not acked it after a heartbeat interval.

        Pushes are fire-and-forget to a routing id; a reconnect between the send and the
        delivery loses one. Clients ignore an arm for a session they already hold.
        """
        now = time.time()
        for s in self.sessions.live():
            if now - s.created_at < self.pace.base:
                continue
            for t in s.targets.values():
                if t.awaiting_arm:
                    c = self.registry.lookup(t.key)
                    if c is not None:
                        self.arms.arm(s, c)

    def on_readings(self, readings: list[ProcReading]) -> None:
        by_pid: dict[int, list[Client]] = {}
        for c in self.registry:
            by_pid.setdefault(c.node_pid, []).append(c)
        for s in readings:
            for c in by_pid.get(s.pid, ()):
                if not s.alive:
                    self.drop(c, "process exited")
                else:
                    self.registry.proc_read(c, s.cpu, s.rss, s.gpu_util, s.gpu_mem)
