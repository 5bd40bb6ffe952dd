"""profctl ps: attached training processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click

from profd import control_schema as C
from profd.ctl.main import Env, command
from profd.ctl.render import Column, age_cell, control, emit_json, opt, say, size, step_cell, table


def _state(r: dict[str, Any]) -> str:
    if r["state"] == "incompatible":
        # A client of a protocol version this daemon does not serve: listed, not profilable.
        return f"incompatible (protocol {r.get('protocol')})"
    state = str(r["state"]) + ("" if r.get("allowed", True) else " (excluded)")
    if r.get("duplicate"):
        # Another process claims its job, role and rank: both are profiled, named apart.
        state += f" (duplicate: pids {', '.join(map(str, r['claimed_by']))})"
    return state


COLUMNS: list[Column] = [
    ("HOST", lambda r: r["host"]),
    ("PID", lambda r: opt(r["pid"], "{}")),
    ("JOB", lambda r: r["job"]),
    ("ROLE", lambda r: r["role"]),
    ("RANK", lambda r: f"{opt(r['rank'], '{}')}/{opt(r.get('world_size'), '{}')}"),
    # ~N: moved on from the last heartbeat's step at the rank's rate; AGE: that heartbeat's.
    ("STEP", step_cell),
    ("AGE", age_cell),
    ("STEPS/S", lambda r: opt(r.get("steps_per_s"), "{:.1f}")),
    ("STATE", _state),
    # Which jobs `--backend nsys` can capture: those started with `profctl run --nsys`.
    ("NSYS", lambda r: "yes" if r.get("nsys_session") else "-"),
    ("CPU%", lambda r: opt(r.get("cpu_percent"), "{:.0f}")),
    ("RSS", lambda r: size(r.get("rss_bytes"))),
    ("GPU%", lambda r: opt(r.get("gpu_util"), "{:.0f}")),
    ("GPU MEM", lambda r: size(r.get("gpu_mem_bytes"))),
]


def _source(field: str) -> Callable[[dict[str, Any]], str]:
    def cell(r: dict[str, Any]) -> str:
        src = r.get("identity_source") or {}
        return str(src.get(field) or "-")

    return cell


def _rank_source(r: dict[str, Any]) -> str:
    src = r.get("identity_source") or {}
    rank, world = src.get("rank") or "-", src.get("world_size") or "-"
    return str(rank) if rank == world else f"{rank}/{world}"


# Where each identity field came from (the client's detection, see docs/configuration.md).
SOURCE_COLUMNS: list[Column] = [
    ("HOST", lambda r: r["host"]),
    ("PID", lambda r: opt(r["pid"], "{}")),
    ("JOB", lambda r: r["job"]),
    ("JOB FROM", _source("job")),
    ("ROLE", lambda r: r["role"]),
    ("ROLE FROM", _source("role")),
    ("RANK", lambda r: f"{opt(r['rank'], '{}')}/{opt(r.get('world_size'), '{}')}"),
    ("RANK/WORLD FROM", _rank_source),
    ("LOCAL", lambda r: opt(r.get("local_rank"), "{}")),
    ("LOCAL FROM", _source("local_rank")),
    ("CLIENT", lambda r: r.get("client_version") or "-"),
]


@click.command()
@click.option("--job", help="Only this job.")
@click.option("--role", help="Only roles matching this glob.")
@click.option(
    "--sources",
    is_flag=True,
    help="Show where each process's job, role and rank came from instead of its load.",
)
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C.")
@click.option("--interval", default=1.0, show_default=True, help="Refresh interval for --watch.")
@click.pass_obj
@command
def ps(
    env: Env, job: str | None, role: str | None, sources: bool, watch: bool, interval: float
) -> None:
    """Attached processes: host pid job role rank/world step age steps/s state cpu% rss gpu.

    STEP is the step as of now: ~N when moved on from the last heartbeat's at the rank's rate
    (while its heartbeats keep coming), else the last reported; AGE: seconds since that
    heartbeat.

    --sources: where each identity field came from (env:RANK, torch.distributed, ray, ...),
    and the profd-client release each process runs (CLIENT).
    """
    while True:
        env.gathered.clear()  # --watch: only the latest round's missing nodes count
        rows = env.rows(C.C_PS, job=job, role=role, form=C.FORM_TABLE)
        if env.json:
            emit_json(rows)
        else:
            columns = SOURCE_COLUMNS if sources else COLUMNS
            text = table(rows, columns) if rows else "no attached processes"
            if watch:
                # Clear and redraw in place, like top.
                control("\x1b[H\x1b[2J")
                say(time.strftime("%H:%M:%S ") + f"{len(rows)} attached")
            say(text)
        if not watch:
            return
        time.sleep(interval)
