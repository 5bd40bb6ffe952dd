"""profctl stacks: where is every rank now? Every thread's stack, grouped as STAT does."""

from __future__ import annotations

from typing import Any

import click

from profd import control_schema as C
from profd.ctl.errors import BadUsage
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json, line_block, say
from profd.watch import flightrec, stackgroups
from profd_client import protocol as P

#: Seconds a node has to answer: its daemon reads stacks for up to 8 s (``REQUEST_BUDGET_S``
#: plus one read's time limit) before it replies.
NODE_TIMEOUT_S = 12.0


def gather(
    env: Env, job: str | None, rank: int | None, native: bool = False
) -> list[dict[str, Any]]:
    """Every node's ranks merged per job and grouped again across nodes (a node's own
    groups saw only its ranks); one document per job, in job order."""
    env.node_timeout = max(env.node_timeout, NODE_TIMEOUT_S)
    g = env.gather(C.C_STACKS, job=job, rank=rank, native=native)
    ranks: dict[str, list[dict[str, Any]]] = {}
    for a in g.answered():
        for doc in a.data:
            rows = ranks.setdefault(doc["job"], [])
            for r in doc["ranks"]:
                r["node"] = doc.get("node")
                rows.append(a.node.named(r))
    out = []
    for j in sorted(ranks):
        rows = sorted(ranks[j], key=lambda r: (r["role"], r["rank"], r["host"], r["pid"]))
        doc = {"job": j, "groups": stackgroups.group(rows), "ranks": rows}
        flight = flightrec.divergence(rows)  # across every node's ranks
        if flight is not None:
            doc["flight"] = flight
        out.append(doc)
    return out


def one_job(docs: list[dict[str, Any]], job: str | None) -> dict[str, Any]:
    """The one job shown: the one asked for, or the only one attached."""
    if not docs:
        raise BadUsage(f"no attached ranks{f' of job {job}' if job else ''}")
    if len(docs) > 1:
        names = ", ".join(d["job"] for d in docs)
        raise BadUsage(f"{len(docs)} jobs are attached ({names}): name one with --job")
    return docs[0]


def render(doc: dict[str, Any], full: bool, tree: bool = False) -> str:
    """The grouped view (suspect groups first, a line each), then with ``full`` every
    rank's threads, training thread first, frames innermost first."""
    ranks = doc["ranks"]
    read = sum(1 for r in ranks if r.get("source"))
    head = (
        f"job {doc['job']}: {len(ranks)} rank{'s' * (len(ranks) != 1)},"
        f" {len(doc['groups'])} group{'s' * (len(doc['groups']) != 1)}"
    )
    if read < len(ranks):
        head += f", {len(ranks) - read} without stacks"
    lines = [head, *("  " + s for s in stackgroups.summary(doc))]
    lines += ["  " + s for s in flightrec.text(doc.get("flight"))]
    if tree:
        hosts = len({r.get("host") for r in ranks}) > 1
        lines += ["", "call tree of the training threads (outermost first):"]
        lines += ["  " + s for s in stackgroups.render_tree(stackgroups.tree(ranks), hosts)]
    if full:
        for r in ranks:
            lines.append("")
            src = r.get("source") or "none"
            lines.append(f"{r['role']} rank {r['rank']} on {r['host']} pid {r['pid']} ({src})")
            if r.get("error"):
                lines.append(f"  {r['error']}")
            threads = sorted(r["threads"], key=lambda t: not t.get("training"))
            for t in threads:
                mark = "  [training]" if t.get("training") else ""
                mark += "  [holds the GIL]" if t.get("owns_gil") else ""
                lines.append(f"  thread {t['tid']} {t['name']}{mark}")
                for f in t["frames"]:
                    where = f"{f['file']}" if f.get("native") else f"{f['file']}:{f['line']}"
                    lines.append(f"    {f['function']} ({where})")
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
    With --cluster, ranks of every node are grouped together and rows carry their node.
    """
    doc = one_job(gather(env, job, rank, native), job)
    if env.json:
        emit_json(doc)
    else:
        say(render(doc, full, tree))
