"""``ps`` and ``top``: the processes attached to this daemon, as they are now."""

from __future__ import annotations

import time
from typing import Any

from profd import control_schema as C
from profd.control_rows import RowFault, TopRow, pack, pack_ps
from profd.daemon.clients.registry import step_now
from profd.daemon.control.requests.context import Context, Handler
from profd.daemon.runtime.peers import Requester
from profd.daemon.sessions.selector import Selector
from profd.watch.stats import top_order, vs_role
from profd_client.protocol.envelope import bad


def ps(ctx: Context, m: dict[str, Any], by: Requester) -> C.Packed:
    job: str | None = m.get("job")
    role: str | None = m.get("role")
    sel = Selector(job=job, roles=(role,) if role else ())
    served = ctx.registry.by_identity()
    # Processes that claim one identity are marked, whatever the filter shows of them.
    shared = ctx.registry.claimants()
    hellos: list[tuple[Any, ...]] = []
    lives: list[tuple[Any, ...]] = []
    now, hb, node = time.monotonic(), ctx.facts.heartbeat_interval, ctx.facts.host
    for c in served if job is None and role is None else filter(sel.matches, served):
        try:
            hellos.append(c.ps_hello(node))
        except RowFault as f:
            raise bad(f"ps.data[{len(lives)}].{f.field}", f.why) from None
        pids = shared.get((c.job, c.role, c.rank))
        step, extrapolated, age = step_now(c, now, hb)
        lives.append(c.ps_live(step, extrapolated, age, tuple(pids) if pids else ()))
    # Peers of another protocol version are listed so nobody wonders where a job went.
    peers = [p.ps_row(node) for p in ctx.registry.incompatible.values()]
    if job is not None:
        peers = [p for p in peers if p.job == job]
    return pack_ps(hellos, lives, peers, table=m.get("form") == C.FORM_TABLE)


def top(ctx: Context, m: dict[str, Any], by: Requester) -> C.Packed:
    """One row per served rank (:class:`TopRow`), slowest against its role first."""
    job: str | None = m.get("job")
    role: str | None = m.get("role")
    clients: Any = ctx.registry
    if job is not None or role is not None:
        clients = filter(Selector(job=job, roles=(role,) if role else ()).matches, clients)
    now, hb, node = time.monotonic(), ctx.facts.heartbeat_interval, ctx.facts.host
    figures = ctx.ledgers.figures
    ranks = [(c, figures(c, now)) for c in clients]
    p50s = [_ms(f.p50_ms) for _, f in ranks]
    # A role's ranks are all here whatever the filter (it selects whole jobs and roles),
    # so each is compared with its whole role on this node.
    marks = vs_role([(c.job, c.role) for c, _ in ranks], p50s)
    rows = []
    for (c, f), p50, (ratio, marked) in zip(ranks, p50s, marks, strict=True):
        step, extrapolated, age = step_now(c, now, hb)
        rows.append(
            TopRow(
                host=c.host,
                pid=c.pid,
                job=c.job,
                role=c.role,
                rank=c.rank,
                world_size=c.world_size,
                step=step,
                step_extrapolated=extrapolated,
                age_s=round(age, 3),
                sps=round(c.sps, 2),
                step_ms_p50=p50,
                step_ms_p99=_ms(f.p99_ms),
                window_s=None if f.window_s is None else round(f.window_s, 1),
                source=f.source,
                regions=f.regions,
                wait_ms=_ms(f.wait_ms),
                cpu_percent=c.cpu,
                rss_bytes=c.rss,
                gpu_util=c.gpu_util,
                gpu_mem_bytes=c.gpu_mem,
                vs_role=ratio,
                marked=marked,
                node=node,
            )
        )
    rows.sort(key=lambda r: top_order(r.vs_role, r.step_ms_p50, r.host, r.job, r.role, r.rank))
    return pack(C.C_TOP, rows, table=m.get("form") == C.FORM_TABLE)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


HANDLERS: dict[str, Handler] = {C.C_PS: ps, C.C_TOP: top}
