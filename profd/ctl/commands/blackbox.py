"""profctl blackbox: the last steps of a job's ranks, from every rank's black box, as one
Perfetto trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from profd import control_schema as C
from profd.blackbox import perfetto, summary
from profd.ctl.errors import BadUsage, CtlError
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json, line_block, say
from profd_client.ranks import RankSpecError, parse_ranks

#: Seconds a node has to answer: its daemon gives its ranks 5 s (``COLLECT_S``).
NODE_TIMEOUT_S = 10.0


def gather(env: Env, job: str, ranks: list[int] | None) -> dict[str, Any]:
    """Every node's boxes of ``job`` (``ranks`` only, when given), in rank order, and the
    ranks without one."""
    env.node_timeout = max(env.node_timeout, NODE_TIMEOUT_S)
    g = env.gather(C.C_BLACKBOX, job=job, ranks=ranks)
    boxes: list[dict[str, Any]] = []
    missing: list[dict[str, Any]] = []
    collect_s = 0.0  # the slowest node's: the nodes collect at once
    for a in g.answered():
        boxes += a.data["boxes"]
        missing += a.data["missing"]
        collect_s = max(collect_s, float(a.data.get("collect_s") or 0.0))

    def order(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["rank"], r["role"], r["node"], r["pid"])

    return {
        "boxes": sorted(boxes, key=order),
        "missing": sorted(missing, key=order),
        "collect_s": round(collect_s, 3),
    }


@click.command()
@click.option("--job", required=True, help="The job whose ranks' black boxes to collect.")
@click.option("--ranks", "ranks_text", help="Only these ranks: 0,1 or 0-7 (default: all).")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write the trace here (default: blackbox-JOB.json.gz; with --json only when given).",
)
@click.pass_obj
@command
def blackbox(env: Env, job: str, ranks_text: str | None, output: Path | None) -> None:
    """The last steps of every rank of JOB (each keeps its last [blackbox] keep_steps steps,
    and at least keep_seconds of them, always): one Perfetto trace (Chrome trace-event
    JSON, gzipped; open it at ui.perfetto.dev) with a process per rank, tracks for its
    steps, each region, its collectives (where torch's flight recorder is on) and its
    training thread's stack samples. Ranks are aligned by the global step, across nodes
    too with --cluster.

    Prints a line per rank: the steps held, the median step and the slowest step with
    where its time went. --json prints that as {"ranks": [{"name", "rank", "steps",
    "first_step", "last_step", "span_s", "median_s", "slowest": {"step", "seconds",
    "regions", "outside_regions_s", "collectives", "frames"}}], "common_steps", "missing",
    "collect_s", "trace"}. Ranks without a black box (an older client, one that did not
    answer in 5 s, or one that exited meanwhile) are named, not waited for.
    """
    try:
        wanted = parse_ranks(ranks_text) if ranks_text else None
    except RankSpecError as exc:
        raise BadUsage(str(exc)) from None
    got = gather(env, job, sorted(wanted) if wanted is not None else None)
    boxes, missing = got["boxes"], got["missing"]
    if not boxes:
        why = "; ".join(f"rank {m['rank']} on {m['node']}: {m['why']}" for m in missing)
        raise CtlError(f"no black box of job {job}" + (f" ({why})" if why else ": no ranks"))
    doc = summary.summarize(boxes, missing)
    doc["collect_s"] = got["collect_s"]
    path = output
    if path is None and not env.json:
        path = Path(f"blackbox-{job}.json.gz")
    if path is not None:
        doc["trace"] = str(path)
        doc["trace_bytes"] = perfetto.write(boxes, path)
    if env.json:
        emit_json(doc)
        return
    lines = summary.text(doc)
    lines.append(f"wrote {path} ({doc['trace_bytes']} bytes): open it at ui.perfetto.dev")
    say(line_block(lines))
