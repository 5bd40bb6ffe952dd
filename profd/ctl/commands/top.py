"""profctl top: every rank's step times, slowest against its role first, refreshed in place."""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from profd import control_schema as C
from profd.ctl.main import Env, command
from profd.ctl.render import Column, age_cell, control, emit_json, opt, say, size, step_cell, table
from profd.watch.stats import mark_vs_role, slowest_first

#: Each frame redraws in place, like top(1): cursor home, every line cleared to its end,
#: the screen cleared below the last (no blank flash between frames, as a full clear has).
HOME, EOL, BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
#: Regions shown per row, largest share first (``--json`` has them all).
REGIONS_SHOWN = 2


def _vs_role(r: dict[str, Any]) -> str:
    vs = r.get("vs_role")
    if vs is None:
        return "-"
    # "!": slower than its role's other ranks by more than profd.watch.stats.FAR.
    return f"{vs:.2f}x" + ("!" if r.get("marked") else "")


def _regions(r: dict[str, Any]) -> str:
    shares = r.get("regions") or {}
    top = sorted(shares.items(), key=lambda kv: (-kv[1], kv[0]))[:REGIONS_SHOWN]
    return " ".join(f"{name} {share * 100:.0f}%" for name, share in top) or "-"


COLUMNS: list[Column] = [
    ("HOST", lambda r: r["host"]),
    ("JOB", lambda r: r["job"]),
    ("ROLE", lambda r: r["role"]),
    ("RANK", lambda r: r["rank"]),
    ("STEP", step_cell),
    ("AGE", age_cell),
    ("STEPS/S", lambda r: opt(r.get("sps"), "{:.1f}")),
    ("P50 MS", lambda r: opt(r.get("step_ms_p50"), "{:.1f}")),
    ("P99 MS", lambda r: opt(r.get("step_ms_p99"), "{:.1f}")),
    ("VS ROLE", _vs_role),
    ("REGIONS", _regions),
    ("WAIT MS", lambda r: opt(r.get("wait_ms"), "{:.1f}")),
    ("CPU%", lambda r: opt(r.get("cpu_percent"), "{:.0f}")),
    ("RSS", lambda r: size(r.get("rss_bytes"))),
    ("GPU%", lambda r: opt(r.get("gpu_util"), "{:.0f}")),
    ("GPU MEM", lambda r: size(r.get("gpu_mem_bytes"))),
    ("SRC", lambda r: r.get("source") or "-"),
]


def ranks(env: Env, job: str | None, role: str | None) -> list[dict[str, Any]]:
    """Every node's rows as one listing, slowest first: a role may span nodes, so with
    ``--cluster`` each rank is compared with its whole role again here (one node's daemon saw
    only its own ranks); the local daemon's rows come compared and in order."""
    env.gathered.clear()  # only this frame's missing nodes count
    rows = env.rows(C.C_TOP, job=job, role=role, form=C.FORM_TABLE)
    if not env.nodes.remote:
        return rows
    mark_vs_role(rows)
    return slowest_first(rows)


def frame(env: Env, rows: list[dict[str, Any]]) -> str:
    """One screen: a header line (time, nodes, ranks, marked, nodes that did not answer),
    then the table."""
    answered = sum(len(g.ok) for g in env.gathered)
    missing = [a.node.address for g in env.gathered for a in g.missing]
    marked = sum(1 for r in rows if r.get("marked"))
    head = (
        f"profd top  {time.strftime('%H:%M:%S')}  {answered} node{'s' * (answered != 1)}"
        f"  {len(rows)} rank{'s' * (len(rows) != 1)}  {marked} marked"
    )
    if missing:
        head += f"  no answer: {', '.join(missing)}"
    return head + "\n" + (table(rows, COLUMNS) if rows else "no attached processes")


@contextmanager
def keys(interactive: bool) -> Iterator[int | None]:
    """stdin in cbreak mode (keys arrive one by one, unechoed; Ctrl-C still interrupts) while
    live on a terminal; its settings restored however the command ends. Yields its fd, or
    None when there is no terminal to read ``q`` from."""
    if not interactive or not sys.stdin.isatty():
        yield None
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)

    def ended(signum: int, _frame: Any) -> None:
        # Leave through ``finally``, so the terminal is restored on a kill or hangup too.
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, ended) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        tty.setcbreak(fd)
        control("\x1b[?25l")  # no cursor blinking over the table
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        control("\x1b[?25h")
        for s, h in old.items():
            signal.signal(s, h)


def wait_key(fd: int | None, seconds: float) -> bool:
    """Wait ``seconds``; True when ``q`` was pressed meanwhile."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if fd is None:
            time.sleep(left)
            return False
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 64)
            if not data:  # stdin closed: nothing more to read, just wait
                fd = None
            elif b"q" in data or b"Q" in data:
                return True


@click.command()
@click.option("--job", help="Only this job.")
@click.option("--role", help="Only roles matching this glob.")
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between frames.",
)
@click.pass_obj
@command
def top(env: Env, job: str | None, role: str | None, once: bool, interval: float) -> None:
    """Every rank's step times, slowest against its role first, refreshed in place.

    One row per rank: host, job, role, rank, step (~N: as of now, moved on at the rank's
    rate), age of its last heartbeat, steps/s, step time p50/p99 over the last minute, VS ROLE
    (its p50 over the median of its role's other ranks, across every node; "!": far slower),
    the regions' shares of the step, cpu%, rss, gpu util and memory, and where the step
    times come from (SRC: ledger, the client's own timings; rate, an older client's rate).
    WAIT MS: the rank's wait in collectives per step, where its flight recorder times them
    ("-": not known); in a lockstep job the rank the others wait for waits least.

    On a terminal the frame redraws every --interval seconds until q or Ctrl-C; into a pipe,
    frames follow each other separated by a blank line. --once prints one frame. --json prints
    one frame as {"ranks": [rows]}, with or without --once.
    """
    if once or env.json:
        rows = ranks(env, job, role)
        if env.json:
            emit_json({"ranks": rows})
        else:
            say(frame(env, rows))
        return
    live = sys.stdout.isatty()
    try:
        with keys(live) as fd:
            first = True
            while True:
                started = time.monotonic()
                text = frame(env, ranks(env, job, role))
                if live:
                    control(HOME)
                    say(text, nl=False, eol=EOL)
                    control(EOL + BELOW)
                else:
                    say(("" if first else "\n") + text)
                first = False
                if wait_key(fd, interval - (time.monotonic() - started)):
                    break
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a live view is left: not a failure
    if live:
        say()
