"""``stacks``: every served rank's Python stacks, read by worker threads; answered later."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from profd import control_schema as C
from profd.daemon.clients.pyspy_reader import job_doc
from profd.daemon.clients.registry import Client
from profd.daemon.clients.stack_sources import Rows
from profd.daemon.control.requests.context import Context, Handler, Later
from profd.daemon.runtime.peers import Requester
from profd.scheduling.refusal import Refused
from profd_client.protocol import ErrorCode


def stacks(ctx: Context, m: dict[str, Any], by: Requester) -> Later:
    clients = stack_clients(ctx, m.get("job"), m.get("rank"), by)
    reader = ctx.stacks
    if reader is None:
        raise Refused(ErrorCode.UNSUPPORTED, "this daemon reads no stacks")
    node = ctx.facts.host
    jobs = [c.job for c in clients]

    def start(reply: Callable[[Any], None]) -> None:
        def finish(rows: Rows) -> None:
            per_job: dict[str, Rows] = {}
            for job, row in zip(jobs, rows, strict=True):
                per_job.setdefault(job, []).append(row)
            docs = [job_doc(j, per_job[j]) for j in sorted(per_job)]
            for d in docs:
                d["node"] = node
            reply(docs)

        reader.read(clients, finish, native=bool(m.get("native")))

    return Later(start)


def stack_clients(ctx: Context, job: str | None, rank: int | None, by: Requester) -> list[Client]:
    """The served ranks ``stacks`` reads: of ``job`` and ``rank`` when given, and only
    the requester's own processes unless it may act on everyone's."""
    return [
        c
        for c in ctx.registry.by_identity()
        if (job is None or c.job == job)
        and (rank is None or c.rank == rank)
        and by.may_act_on(c.uid)
    ]


HANDLERS: dict[str, Handler] = {C.C_STACKS: stacks}
