"""profctl stacks: where is every rank now? Every thread's stack, grouped as STAT does."""

from __future__ import annotations

from typing import Any

import click

from profd import control_schema as C
from profd.ctl.errors import BadUsage
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json, line_block, say
from profd.watch import flightrec, stackgroups
from profd.watch.stackrows import StackRank, rank_order, ranks_of, to_maps
from profd_client import protocol as P

#: Seconds a node has to answer: its daemon reads stacks for up to 8 s (``REQUEST_BUDGET_S``
#: plus one read's time limit) before it replies.
NODE_TIMEOUT_S = 12.0


class Stacks:
    """One job's stacks as profctl shows them: every node's ranks, in rank order, grouped
    together, and where their flight recorders part (None: none is on). Each rank both as
    its node sent it (``maps``, named by node: what ``--json`` prints, a newer daemon's
    fields kept) and decoded (``ranks``: what the grouping reads). ``unread``: the nodes
    whose rows did not decode as rank rows (a lying peer), once per such row: left out of
    the grouping, and said."""

    def __init__(
        self, job: str, rows: list[tuple[dict[str, Any], StackRank]], unread: list[str]
    ) -> None:
        rows = sorted(rows, key=lambda mr: rank_order(mr[1]))
        self.job = job
        self.unread = sorted(unread)
        self.maps = [m for m, _ in rows]
        self.ranks = [r for _, r in rows]
        self.groups = stackgroups.group(self.ranks)
        self.flight = flightrec.divergence(self.ranks)  # across every node's ranks

    def doc(self) -> dict[str, Any]:
        """The ``--json`` document (the daemon's reply's shape)."""
        out: dict[str, Any] = {"job": self.job, "groups": to_maps(self.groups), "ranks": self.maps}
        if self.flight is not None:
            out["flight"] = to_maps(self.flight)
        if self.unread:
            out["ranks_unread"] = len(self.unread)
        return out


def gather(env: Env, job: str | None, rank: int | None, native: bool = False) -> list[Stacks]:
    """Every node's ranks merged per job and grouped again across nodes (a node's own
    groups saw only its ranks), in job order."""
    env.node_timeout = max(env.node_timeout, NODE_TIMEOUT_S)
    g = env.gather(C.C_STACKS, job=job, rank=rank, native=native)
    ranks: dict[str, list[tuple[dict[str, Any], StackRank]]] = {}
    unread: dict[str, list[str]] = {}
    for a in g.answered():
        for doc in a.data:
            named = [a.node.named({**r, "node": doc.get("node")}) for r in doc["ranks"]]
            rows = ranks.setdefault(doc["job"], [])
            bad = unread.setdefault(doc["job"], [])
            # The reply passed its schema, which leaves a row's other fields open.
            for m, r in zip(named, ranks_of(named), strict=True):
                if r is None:
                    bad.append(str(a.node.address))
                else:
                    rows.append((m, r))
    return [Stacks(j, ranks[j], unread[j]) for j in sorted(ranks)]


def one_job(jobs: list[Stacks], job: str | None) -> Stacks:
    """The one job shown: the one asked for, or the only one attached."""
    if not jobs:
        raise BadUsage(f"no attached ranks{f' of job {job}' if job else ''}")
    if len(jobs) > 1:
        names = ", ".join(d.job for d in jobs)
        raise BadUsage(f"{len(jobs)} jobs are attached ({names}): name one with --job")
    return jobs[0]


def render(doc: Stacks, full: bool, tree: bool = False) -> str:
    """The grouped view (suspect groups first, a line each), then with ``full`` every
    rank's threads, training thread first, frames innermost first."""
    ranks = doc.ranks
    read = sum(1 for r in ranks if r.source is not None)
    head = (
        f"job {doc.job}: {len(ranks)} rank{'s' * (len(ranks) != 1)},"
        f" {len(doc.groups)} group{'s' * (len(doc.groups) != 1)}"
    )
    if read < len(ranks):
        head += f", {len(ranks) - read} without stacks"
    if doc.unread:
        nodes = ", ".join(sorted(set(doc.unread)))
        head += f", {len(doc.unread)} unreadable rank row{'s' * (len(doc.unread) != 1)} ({nodes})"
    lines = [head, *("  " + s for s in stackgroups.summary(ranks, doc.groups))]
    lines += ["  " + s for s in flightrec.text(doc.flight)]
    if tree:
        hosts = len({r.host for r in ranks}) > 1
        lines += ["", "call tree of the training threads (outermost first):"]
        lines += ["  " + s for s in stackgroups.render_tree(stackgroups.tree(ranks), hosts)]
    if full:
        for r in ranks:
            lines.append("")
            src = "none" if r.source is None else r.source.value
            lines.append(f"{r.role} rank {r.rank} on {r.host} pid {r.pid} ({src})")
            if r.error:
                lines.append(f"  {r.error}")
            for t in sorted(r.threads, key=lambda t: not t.training):
                mark = "  [training]" if t.training else ""
                mark += "  [holds the GIL]" if t.owns_gil is True else ""
                lines.append(f"  thread {t.tid} {t.name}{mark}")
                for f in t.frames:
                    where = f.file if f.native else f"{f.file}:{f.line}"
                    lines.append(f"    {f.function} ({where})")
    return line_block(lines)


@click.command()
@click.option("--job", help="Only this job (needed when several are attached).")
@click.option("--rank", type=click.IntRange(0, P.MAX_RANK), help="Only this rank.")
@click.option("-v", "--full", is_flag=True, help="Every rank's threads and frames too.")
@click.option(
    "--tree",
    is_flag=True,
    help="The training threads' stacks merged into one call tree, ranks on each branch.",
)
@click.option(
    "--native",
    is_flag=True,
    help="C/C++ frames too (py-spy --native): pauses each process ~0.5 s instead of ms.",
)
@click.pass_obj
@command
def stacks(
    env: Env, job: str | None, rank: int | None, full: bool, tree: bool, native: bool
) -> None:
    """Where every rank is now: every thread's stack, read from outside the process
    (py-spy), grouped by the training thread's stack as LLNL's STAT does.

    One line per group, suspects first: the ranks whose training thread has that stack and
    its innermost frame in user code ("suspect  rank 1: in stuck_in_data_loading
    (train.py:40)"); the largest group is the majority. Ranks whose stacks could not be read
    are listed with the reason. -v adds every rank's threads, frames innermost first;
    --tree merges the training threads' stacks into one call tree (STAT's view) whose
    branches say which ranks took them.
    Reading pauses each process for a few milliseconds; --native adds C/C++ frames (where
    in a collective or a C call it is) at about half a second of pause each. Groups are by
    Python frames either way.

    One job at a time: with several attached, --job names it. --json prints that job's
    document: {"job", "groups": [{"ranks", "majority", "frames"}], "ranks": [{"host",
    "role", "rank", "pid", "source", "threads": [{"name", "tid", "training", "frames"}]}]}.
    With --cluster, ranks of every node are grouped together and rows carry their node; a
    node's row that does not read as a rank row is left out, counted in "ranks_unread" and
    named with its node on the first line.
    """
    doc = one_job(gather(env, job, rank, native), job)
    if env.json:
        emit_json(doc.doc())
    else:
        say(render(doc, full, tree))
