"""Requests from profctl on ``control.sock``: the only socket that can start sessions."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from profd_client import protocol as P

from .. import __version__
from ..config import ConfigError
from ..store.index import TraceFilter
from . import schedule as sch
from .registry import Client
from .selector import Selector, SelectorError, describe_attached
from .sessions import TARGET_TERMINAL, Session, Target, new_session_id

if TYPE_CHECKING:
    from .loop import Daemon

log = logging.getLogger("profd.control")

#: How far ahead ``--next`` looks, in seconds of each target's step rate, so the arm message
#: reaches every rank before its first step starts, even on a loaded node.
NEXT_LEAD_S = 1.0
#: How often one ``--next`` session may be moved to later steps because a rank got it late.
MAX_REPLANS = 3
#: Minimum steps of lead, also for a client that has not reported a step rate yet.
UNKNOWN_RATE_LEAD = 10
#: Extra lead for ``--backend nsys``: ranks are armed only after ``nsys start`` returned.
NSYS_START_LEAD_S = 5.0
START_KEYS = frozenset(
    {
        "job",
        "roles",
        "ranks",
        "host",
        "pids",
        "steps",
        "next",
        "at_step",
        "active",
        "warmup",
        "repeat",
        "roundup",
        "options",
        "region",
        "label",
        "backend",
    }
)


class Refused(Exception):
    """A request that cannot be served; the message is the one-line reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ControlHandler:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.auto_sessions: dict[tuple[int, str], str] = {}
        self.rejected = 0

    def handle(self, frames: list[bytes]) -> None:
        # REQ peers send [id, b"", payload]; anything else is answered in the same envelope.
        if len(frames) < 2:
            self.rejected += 1
            return
        envelope, frame = frames[:-1], frames[-1]
        try:
            msg = P.decode(frame, P.CONTROL_INBOUND)
            reply = P.ok(self.dispatch(msg))
        except P.ProtocolError as exc:
            self.rejected += 1
            reply = P.error(exc.code, str(exc))
        except Refused as exc:
            reply = P.error(exc.code, str(exc))
        except Exception as exc:
            log.exception("control request failed")
            reply = P.error("internal", f"{type(exc).__name__}: {exc}")
        try:
            self.d.control_sock.send_multipart([*envelope, reply], flags=1)  # NOBLOCK
        except Exception as exc:
            log.debug("control reply failed: %s", exc)

    def dispatch(self, m: dict[str, Any]) -> Any:
        t = m["t"]
        if t in (P.C_SESSIONS, P.C_SHOW, P.C_TRACES):
            self.d.flush()  # answer reads from an index that has every change so far
        if t == P.C_STATUS:
            return self.status()
        if t == P.C_PS:
            return self.ps(m.get("job"), m.get("role"))
        if t == P.C_START:
            return self.start(m["spec"])
        if t in (P.C_STOP, P.C_CANCEL):
            return self.stop(m["session"], keep=t == P.C_STOP)
        if t == P.C_SESSIONS:
            return self.d.index.sessions(m.get("state"), m.get("job"), m.get("limit") or 50)
        if t == P.C_SHOW:
            s = self.d.index.session(m["session"])
            if s is None:
                raise Refused("unknown_session", f"no session {m['session']!r}")
            s["steps"] = sch.steps_of([tuple(c) for c in s["cycles"]])  # type: ignore[misc]
            return s
        if t == P.C_TRACES:
            try:
                flt = TraceFilter.from_map(m["filters"])
            except (TypeError, ValueError) as exc:
                raise Refused("bad_filter", str(exc)) from None
            return self.d.index.traces(flt)
        if t == P.C_RETRY:
            n = self.d.index.requeue(m.get("session"))
            if self.d.uploads is not None:
                self.d.uploads.kick()
            return {"requeued": n}
        raise Refused("type", f"unhandled request {t}")

    # --- status and ps ------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        d = self.d
        total, unsafe = d.index.spool_usage()
        live = d.sessions.live()
        out: dict[str, Any] = {
            "version": __version__,
            "pid": os.getpid(),
            "host": d.host,
            "uptime_s": round(time.time() - d.started, 1),
            "runtime_dir": str(d.cfg.runtime_dir),
            "state_dir": str(d.cfg.state_dir),
            "spool_dir": str(d.spool),
            "clients": len(d.registry),
            "sessions": {
                "live": len(live),
                "by_state": {
                    st: sum(s.state == st for s in live) for st in {s.state for s in live}
                },
            },
            "pipeline": {"in_flight": d.captures.in_flight},
            "spool": {
                "bytes": total,
                "bytes_not_uploaded": unsafe,
                "max_bytes": d.cfg.max_spool_bytes,
            },
            "queue": d.index.queue_stats(),
            "rejected_messages": self.rejected + d.agents.rejected,
            "s3": {"configured": False},
        }
        if d.uploads is not None:
            out["s3"] = d.uploads.status()
        return out

    def ps(self, job: str | None, role: str | None) -> list[dict[str, Any]]:
        sel = Selector(job=job, roles=(role,) if role else ())
        rows = [c.row() for c in d_sorted(self.d.registry) if sel.matches(c)]
        return rows

    # --- sessions ------------------------------------------------------------------------------
    def start(self, spec: Mapping[str, Any], auto_rule: int | None = None) -> dict[str, Any]:
        unknown = set(spec) - START_KEYS
        if unknown:
            raise Refused("bad_request", f"unknown start fields {sorted(unknown)}")
        try:
            sel = Selector.from_spec(spec)
            sched = sch.parse(spec)
            options = P.options(spec.get("options") or {})
        except (SelectorError, sch.ScheduleError, P.ProtocolError) as exc:
            raise Refused("bad_request", str(exc)) from None
        backend = spec.get("backend") or "torch"
        if backend not in P.BACKENDS:
            raise Refused("bad_request", f"unknown backend {backend!r}: use torch or nsys")
        region = spec.get("region") or None
        label = spec.get("label") or None
        self.check_quota()
        try:
            targets = sel.select(self.d.registry)
        except SelectorError as exc:
            raise Refused("no_match", str(exc)) from None
        if not targets:
            raise Refused(
                "no_match",
                f"no attached process matches {sel.describe()}; "
                + describe_attached(self.d.registry),
            )
        if options.get("memory_snapshot"):
            no_cuda = [c for c in targets if not (c.device or "").startswith("cuda")]
            if no_cuda:
                c = no_cuda[0]
                raise Refused(
                    "unsupported",
                    f"--memory-snapshot needs CUDA: {c.role} rank {c.rank} (pid {c.pid})"
                    f" runs on {c.device or 'cpu'}",
                )
        if backend == "nsys":
            self.d.nsys.check(dict(spec), options, targets)
        jobs = sorted({c.job for c in targets})
        if len(jobs) > 1:
            raise Refused(
                "no_match", f"selector matches several jobs ({', '.join(jobs)}): add --job"
            )
        cycles = self.resolve(sched, targets, backend)
        s = Session(
            id=new_session_id(),
            job=jobs[0],
            request=dict(spec),
            cycles=cycles,
            backend=backend,
            options=options,
            region=region,
            label=label,
            auto_rule=auto_rule,
        )
        for c in targets:
            s.targets[c.key] = Target.of(c)
        self.d.sessions.add(s)
        if backend == "nsys":
            # Armed once nsys listens: see NsysRuns.
            self.d.nsys.begin(s, targets, self.d.captures.incoming_dir(s.job, s.id))
        else:
            # Arm first: the index write happens in the loop's flush, after the reply.
            for c in targets:
                self.arm(s, c)
        log.info(
            "session %s: %s steps %s on %d target(s)",
            s.id,
            sel.describe(),
            sch.describe(cycles),
            len(targets),
        )
        return self.started(s)

    def started(self, s: Session) -> dict[str, Any]:
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
        }

    def resolve(
        self,
        sched: sch.Schedule,
        targets: list[Client],
        backend: str = "torch",
        lead_s: float = NEXT_LEAD_S,
    ) -> list[sch.Cycle]:
        now = time.monotonic()
        earliest = 1
        lead_s += NSYS_START_LEAD_S if backend == "nsys" else 0.0
        for c in targets:
            est = c.estimated_step(now)
            # At least UNKNOWN_RATE_LEAD steps: a rate of 0 may just not be reported yet.
            ahead = max(c.sps * lead_s, UNKNOWN_RATE_LEAD)
            lead = math.ceil(est + ahead) + 2
            earliest = max(earliest, lead, self.d.sessions.busy_until(c.key))
        try:
            cycles = sch.resolve(sched, earliest)
        except sch.ScheduleError as exc:
            raise Refused("bad_request", str(exc)) from None
        if sched.explicit:
            first = cycles[0][0]
            for c in targets:
                est = c.estimated_step(now)
                earliest_step = c.armable_from(int(est))
                if first < earliest_step:
                    what = "already passed" if first <= est else "starts before it can be armed"
                    warm = f" (with --warmup the first step is {first})" if sched.warmup else ""
                    hint = (
                        "; step 1 can be captured only by an [[auto]] rule on a process that"
                        " waits in attach() (PROFD_ATTACH_WAIT=SECONDS)"
                        if first == 1
                        else ""
                    )
                    raise Refused(
                        "steps_passed",
                        f"steps {sch.describe(cycles)} {what} for {c.role} rank {c.rank}"
                        f" (pid {c.pid}, at step {int(est)}; the earliest step is"
                        f" {earliest_step}){warm}{hint}",
                    )
                busy = self.d.sessions.busy_until(c.key)
                if busy > first:
                    raise Refused(
                        "busy",
                        f"{c.role} rank {c.rank} is busy until step {busy}; "
                        "use --next to queue after it",
                    )
        return cycles

    def arm(self, s: Session, c: Client) -> None:
        if s.arm_frame is None:
            incoming = self.d.captures.incoming_dir(s.job, s.id)
            extra: dict[str, Any] = {}
            if s.plan:
                # A stale capture of the old steps may still arrive: keep its files apart.
                incoming, extra = incoming / f"plan{s.plan}", {"plan": s.plan}
            s.arm_frame = P.encode(
                P.ARM,
                session=s.id,
                job=s.job,
                backend=s.backend,
                cycles=[list(x) for x in s.cycles],
                options=s.options,
                region=s.region,
                incoming=str(incoming),
                **extra,
            )
            s.armed_at = time.monotonic()
        self.d.send_agent(c.ident, s.arm_frame)

    def late(self, s: Session, t: Target, c: Client, step: int) -> None:
        """A rank got the session's first step after it had passed."""
        now = time.monotonic()
        if step > c.step and now > c.step_at:
            # The estimate that planned these steps was low: learn the rate the rank really
            # ran at since its last report, or the next plan would be just as early.
            c.sps = max(c.sps, (step - c.step) / (now - c.step_at))
        c.step, c.step_at = max(c.step, step), now
        why = f"steps already passed: at step {step}"
        if not self.replannable(s):
            t.error, t.client_final = why, "failed"
            t.settle()
            self.d.save(s, t)
            return
        # The arm took longer to reach the training thread than --next allowed for (a loaded
        # node, a long step). Every rank must capture the same steps, so all of them move:
        # with at least twice the delay just seen as lead (arm sent to ``late`` received; the
        # arm's own share of it can be nearly all), and twice the lead of the last plan.
        took = now - s.armed_at
        lead_s = max(NEXT_LEAD_S * 2 ** (s.plan + 1), 2 * took)
        clients = [x for x in map(self.d.registry.by_key.get, s.targets) if x is not None]
        old = sch.describe(s.cycles)
        s.cycles = self.resolve(sch.parse(s.request), clients, s.backend, lead_s)
        s.plan += 1
        s.arm_frame = None
        for tg in s.targets.values():
            if tg.state not in TARGET_TERMINAL and tg.client_final is None:
                tg.state, tg.error = "pending", None
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
        for x in clients:
            if s.targets[x.key].state == "pending":
                self.arm(s, x)
        self.d.save(s)

    def replannable(self, s: Session) -> bool:
        """Only ``--next`` steps are the daemon's to move, and only before any rank captured."""
        if s.backend != "torch" or s.auto_rule is not None or s.plan >= MAX_REPLANS:
            return False
        if sch.parse(s.request).explicit:
            return False
        return not any(
            t.traces or t.outstanding or t.state in ("capturing", "processing", "done")
            for t in s.targets.values()
        )

    def stop(self, session_id: str, keep: bool) -> dict[str, Any]:
        s = self.d.sessions.get(session_id)
        if s is None:
            row = self.d.index.session(session_id)
            if row is None:
                raise Refused("unknown_session", f"no session {session_id!r}")
            raise Refused("finished", f"session {row['id']} already ended: {row['state']}")
        for t in s.targets.values():
            if t.state in TARGET_TERMINAL or t.client_final is not None:
                continue
            c = self.d.registry.by_key.get(t.key)
            if c is None:
                t.gone = True
                t.settle()
                continue
            self.d.send_agent(c.ident, P.encode(P.DISARM, session=s.id, keep=keep))
        if not keep:
            s.error = "cancelled by operator"
        self.d.save(s)
        return {"session": s.id, "state": s.state}

    # --- standing rules ----------------------------------------------------------------------
    def check_auto_rules(self) -> None:
        """Bad ``[[auto]]`` rules stop the daemon at start, not silently at attach time."""
        for i, rule in enumerate(self.d.cfg.auto, 1):
            spec = dict(rule.spec)
            unknown = set(spec) - START_KEYS
            try:
                if unknown:
                    raise ValueError(f"unknown keys {sorted(unknown)}")
                Selector.from_spec(spec)
                sched = sch.parse(spec)
                if not sched.explicit:
                    raise ValueError("needs steps or at_step: --next would differ per rank")
                if spec.get("backend", "torch") != "torch":
                    # Ranks join a rule's session one by one as they attach; an nsys
                    # collection is started once per session, before arming.
                    raise ValueError("supports the torch backend only")
                sch.resolve(sched)
                P.options(spec.get("options") or {})
            except (ValueError, P.ProtocolError) as exc:
                raise ConfigError(f"[[auto]] rule {i}: {exc}") from None

    def apply_auto_rules(self, c: Client) -> None:
        for i, rule in enumerate(self.d.cfg.auto):
            spec = dict(rule.spec)
            try:
                sel = Selector.from_spec(spec)
            except SelectorError as exc:
                log.error("[[auto]] rule %d: %s", i, exc)
                continue
            if not (sel.matches(c) and c.allowed):
                continue
            sid = self.auto_sessions.get((i, c.job))
            s = self.d.sessions.get(sid) if sid else None
            if s is None:
                try:
                    spec["job"] = c.job
                    spec.setdefault("label", f"auto:{i}")
                    spec["pids"] = [c.pid]
                    res = self.start(spec, auto_rule=i)
                except Refused as exc:
                    log.warning("[[auto]] rule %d on pid %s: %s", i, c.pid, exc)
                    continue
                self.auto_sessions[(i, c.job)] = res["session"]
                continue
            # Later ranks of the same job join the rule's session: same steps on every rank.
            if c.key in s.targets:
                continue
            s.targets[c.key] = t = Target.of(c)
            if s.cycles[0][0] < c.armable_from(c.step):
                t.client_final = "failed"
                t.error = f"attached at step {c.step}, after the rule's first step"
                if s.cycles[0][0] == 1:
                    t.error += " (step 1 needs PROFD_ATTACH_WAIT on the job)"
                t.settle()
                self.d.save(s, t)
                continue
            self.d.save(s, t)
            self.arm(s, c)

    def check_quota(self) -> None:
        cap = self.d.cfg.max_spool_bytes
        if cap is None:
            return
        if self.d.uploads is not None:
            self.d.uploads.prune()
        _, unsafe = self.d.index.spool_usage()
        if unsafe >= cap:
            raise Refused(
                "spool_full",
                f"spool quota full: {unsafe} bytes not yet uploaded >= max_spool_bytes {cap};"
                " nothing will be deleted until it is uploaded (check S3 with profctl status)",
            )


def d_sorted(clients: Any) -> list[Client]:
    return sorted(clients, key=lambda c: (c.job, c.role, c.rank, c.host, c.pid))
