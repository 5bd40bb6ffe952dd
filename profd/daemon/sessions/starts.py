"""Starting sessions: a validated start spec to targets, a plan, a session and its arms.

Also the one place that moves a ``--next`` session when a rank got its steps late.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from profd import claims
from profd import control_schema as C
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.runtime.peers import Requester
from profd.daemon.sessions.arming import Arms
from profd.daemon.sessions.nsysruns import NsysRuns
from profd.daemon.sessions.selector import Selector, SelectorError, describe_attached
from profd.daemon.sessions.state import Session, Sessions, Target
from profd.ids import new_session_id
from profd.scheduling import planner
from profd.scheduling import schedule as sch
from profd.scheduling.refusal import Refused
from profd_client import protocol as P

log = logging.getLogger("profd.starts")


@dataclass(frozen=True)
class StartRequest:
    """A start spec, checked and parsed once."""

    spec: dict[str, Any]
    selector: Selector
    schedule: sch.Schedule
    options: dict[str, Any]
    backend: str
    region: str | None
    label: str | None
    #: From a cluster coordinator: only report the matching targets (``probe``), or start
    #: with its session id and absolute cycles.
    probe: bool = False
    session: str | None = None
    cycles: list[sch.Cycle] | None = None

    @classmethod
    def parse(cls, raw: Mapping[str, Any], validated: bool = False) -> StartRequest:
        """``validated``: ``raw`` comes from a message the protocol already checked."""
        try:
            spec = dict(raw) if validated else C.start_spec(dict(raw))
            return cls(
                spec=spec,
                selector=Selector.from_spec(spec),
                schedule=sch.parse(spec),
                options=dict(spec.get("options") or {}),
                backend=spec.get("backend") or P.DEFAULT_BACKEND,
                region=spec.get("region") or None,
                label=spec.get("label") or None,
                probe=bool(spec.get("probe")),
                session=spec.get("session") or None,
                cycles=[(w, a, b) for w, a, b in spec["cycles"]] if spec.get("cycles") else None,
            )
        except (SelectorError, sch.ScheduleError, P.ProtocolError) as exc:
            raise Refused(P.ErrorCode.BAD_REQUEST, str(exc)) from None


def single(uids: set[int]) -> int | None:
    return next(iter(uids)) if len(uids) == 1 else None


def target_state(c: Client, busy_until: int = 0) -> planner.TargetState:
    return planner.TargetState(
        name=f"{c.role} rank {c.rank} (pid {c.pid})",
        step=c.step,
        sps=c.sps,
        step_at=c.step_at,
        busy_until=busy_until,
        attaching=c.attaching,
    )


class Starter:
    def __init__(
        self,
        registry: Registry,
        sessions: Sessions,
        arms: Arms,
        nsys: NsysRuns,
        check_quota: Callable[[], None],
    ) -> None:
        self.registry = registry
        self.sessions = sessions
        self.arms = arms
        self.nsys = nsys
        self.check_quota = check_quota

    def start(
        self, req: StartRequest, auto_rule: int | None = None, by: Requester | None = None
    ) -> Session:
        """``by``: the profctl asking (None: the daemon itself, for an ``[[auto]]`` rule)."""
        self.check_quota()
        targets = self._select(req, by)
        sel = req.selector
        if not targets:
            raise Refused(
                P.ErrorCode.NO_MATCH,
                f"no attached process matches {sel.describe()}; "
                + describe_attached(self.registry),
            )
        jobs = sorted({c.job for c in targets})
        if len(jobs) > 1:
            raise Refused(
                P.ErrorCode.NO_MATCH,
                f"selector matches several jobs ({', '.join(jobs)}): add --job",
            )
        if req.cycles is not None:
            # A coordinator planned them for every node: not ours to move, only to check.
            cycles = req.cycles
            states = [target_state(c, self.sessions.busy_until(c.key)) for c in targets]
            planner.check_reachable(cycles, states, time.monotonic(), bool(req.schedule.warmup))
        else:
            cycles = self.plan(req.schedule, targets, req.backend)
        try:
            sch.check_work(cycles, len(targets))
        except sch.ScheduleError as exc:
            raise Refused(P.ErrorCode.BAD_REQUEST, str(exc)) from None
        if req.session is not None and self.sessions.taken(req.session):
            raise Refused(P.ErrorCode.BAD_REQUEST, f"session {req.session} exists on this node")
        s = Session(
            id=req.session or new_session_id(),
            job=jobs[0],
            request=req.spec,
            cycles=cycles,
            backend=req.backend,
            options=req.options,
            region=req.region,
            label=req.label,
            auto_rule=auto_rule,
            owner=single({c.uid for c in targets}),
        )
        held = req.backend == "nsys"  # armed once nsys listens: see NsysRuns
        for c in targets:
            s.targets[c.key] = Target.of(c, hold=held)
        self.sessions.add(s)
        if held:
            self.nsys.begin(s, targets)
        else:
            # Arm first: the index write happens in the loop's flush, after the reply.
            self.arms.arm_all(s, targets)
        log.info(
            "session %s: %s steps %s on %d target(s)",
            s.id,
            sel.describe(),
            sch.describe(cycles),
            len(targets),
        )
        for note in s.notes:
            log.warning("session %s: job %s: %s", s.id, s.job, note)
        return s

    def candidates(self, req: StartRequest, by: Requester | None) -> list[dict[str, Any]]:
        """What a coordinator plans with: the targets ``req`` matches here, with their last
        step, rate and how long ago (``age_s``: clocks differ between nodes, ages do not)."""
        now = time.monotonic()
        return [
            {
                "host": c.host,
                "pid": c.pid,
                "job": c.job,
                "role": c.role,
                "rank": c.rank,
                "uid": c.uid,
                "step": c.step,
                "sps": c.sps,
                "age_s": max(0.0, now - c.step_at),
                "busy_until": self.sessions.busy_until(c.key),
                "attaching": c.attaching,
            }
            for c in self._select(req, by)
        ]

    def _select(self, req: StartRequest, by: Requester | None) -> list[Client]:
        """The processes ``req`` matches and may capture (:class:`Refused` if some may not)."""
        sel = req.selector
        try:
            targets = sel.select(self.registry)
        except SelectorError as exc:
            raise Refused(P.ErrorCode.NO_MATCH, str(exc)) from None
        if by is not None and not by.privileged:
            theirs = [c for c in targets if not by.may_act_on(c.uid)]
            if theirs:
                c = theirs[0]
                raise Refused(
                    P.ErrorCode.PERMISSION,
                    f"{sel.describe()} matches processes of other users ({c.role} rank"
                    f" {c.rank}, pid {c.pid}, uid {c.uid}); profctl as uid {by.uid} may act"
                    " only on its own processes",
                )
        if req.options.get("memory_snapshot"):
            no_cuda = [c for c in targets if not (c.device or "").startswith("cuda")]
            if no_cuda:
                c = no_cuda[0]
                raise Refused(
                    P.ErrorCode.UNSUPPORTED,
                    f"--memory-snapshot needs CUDA: {c.role} rank {c.rank} (pid {c.pid})"
                    f" runs on {c.device or 'cpu'}",
                )
        if targets and req.backend == "nsys":
            self.nsys.check(req.spec, req.options, targets)
        return targets

    def plan(
        self,
        sched: sch.Schedule,
        targets: list[Client],
        backend: str,
        lead_s: float = planner.NEXT_LEAD_S,
    ) -> list[sch.Cycle]:
        states = [target_state(c, self.sessions.busy_until(c.key)) for c in targets]
        return planner.plan(sched, states, time.monotonic(), backend, lead_s)

    def late(self, s: Session, t: Target, c: Client, step: int) -> None:
        """A rank got the session's first step after it had passed."""
        now = time.monotonic()
        self.registry.observed_step(c, step, now, s.armed_at)
        why = f"steps already passed: at step {step}"
        sched = sch.parse(s.request)
        # A coordinator's steps are every node's: moving them here would split the capture.
        fixed = (
            s.auto_rule is not None
            or "cycles" in s.request
            or any(x.begun for x in s.targets.values())
        )
        if not planner.replannable(sched, s.backend, fixed, s.revision):
            self.sessions.fail(s, t, why)
            return
        # The arm took longer to reach the training thread than --next allowed for (a loaded
        # node, a long step). Every rank must capture the same steps, so all of them move.
        took = now - s.armed_at
        clients = [x for x in map(self.registry.lookup, s.targets) if x is not None]
        old = sch.describe(s.cycles)
        try:
            cycles = self.plan(sched, clients, s.backend, planner.replan_lead(s.revision, took))
        except Refused as exc:
            self.sessions.fail(s, t, f"{why}; cannot move the steps: {exc}")
            return
        self.sessions.replan(s, cycles, now)
        log.warning(
            "session %s: %s rank %s was at step %d when steps %s reached it (%.1fs); moved to %s",
            s.id,
            c.role,
            c.rank,
            step,
            old,
            took,
            sch.describe(s.cycles),
        )
        self.arms.arm_all(s, [x for x in clients if s.targets[x.key].awaiting_arm])

    def stop(
        self,
        session_id: str,
        keep: bool,
        by: Requester | None = None,
        why: str = "cancelled by operator",
    ) -> Session | None:
        """Disarm every open target; None if no live session has that id. ``why``: the
        session's error when cancelled (``keep`` false)."""
        s = self.sessions.exact(session_id)
        if s is None:
            return None
        if by is not None and not by.may_act_on(s.owner):
            whose = f"uid {s.owner}" if s.owner is not None else "several users"
            raise Refused(
                P.ErrorCode.PERMISSION,
                f"session {s.id} captures processes of {whose}; profctl as uid {by.uid}"
                " may act only on its own",
            )
        for t in s.targets.values():
            if not t.open:
                continue
            c = self.registry.lookup(t.key)
            if c is None:
                self.sessions.gone_from(s, t, None)
                continue
            if keep:
                self.sessions.stopping(s, t)
            self.arms.disarm(s, c, keep)
        if not keep:
            self.sessions.cancel(s, why)
        return s


def started(s: Session) -> dict[str, Any]:
    """The ``start`` reply."""
    stems = {t.pid: t.stem for t in s.targets.values()}
    shared = claims.claimants((t.claim, t.pid) for t in s.targets.values())
    return {
        "session": s.id,
        "job": s.job,
        "steps": sch.steps_of(s.cycles),
        "cycles": [list(c) for c in s.cycles],
        "state": s.state,
        "targets": [
            {"host": t.host, "pid": t.pid, "role": t.role, "rank": t.rank}
            for t in s.targets.values()
        ],
        # Processes that claim one identity: each is captured, under a name of its own.
        "duplicates": [
            {"job": j, "role": r, "rank": k, "pids": pids, "stems": [stems[p] for p in pids]}
            for (j, r, k), pids in shared.items()
        ],
    }
