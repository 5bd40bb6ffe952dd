"""Every thread's stack of attached processes, read from outside with ``py-spy dump``.

A hung process may never run its own threads again, so its stacks are read by another
process: ``py-spy dump --json`` on worker threads (a bounded pool, a bounded time each),
never on the event loop. The result of one request goes back through the Reactor as one
call, so the loop (the registry's owner) is the only one that sees it.

Native frames (``--native``) only when asked: unwinding C/C++ stacks and resolving their
symbols keeps a process paused for about half a second with torch loaded (4-8 ms without),
too long for a look at a healthy job; the hang rule asks for them, its job is stalled
anyway. A native read that fails is tried again without.

Blocking mode, not ``--nonblocking``: py-spy pauses the process for the few milliseconds it
takes to copy the stacks, so every frame it reports belongs to one instant; unpaused, a
running thread's frames can be read half before and half after a call returns. Nothing here
signals the process: py-spy attaches with ptrace, and a py-spy killed at its time limit is
detached by the kernel, which lets the process run on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profd.daemon.clients.fanin import FanIn
from profd.watch import flightrec, stackgroups
from profd.watch.rankrow import RankRow, ReadStatus
from profd.watch.stackrows import Source, StackRank, Thread, rank_order, to_maps

log = logging.getLogger("profd.stacks")

#: Seconds one process's read may take before it is given up (py-spy is killed).
READ_TIMEOUT_S = 4.0
#: Seconds a native read (``--native``) may take before the Python stacks are read alone:
#: it pauses the process all along, and a process paused past three heartbeats reconnects.
NATIVE_TIMEOUT_S = 1.0
#: Processes read at once.
WORKERS = 16
#: A request's whole budget: processes not started by then are reported as not read, so a
#: profctl waiting for the reply gets one before its own timeout (10 s).
REQUEST_BUDGET_S = 4.0
#: Most of py-spy's error text kept in a rank's ``error``.
ERROR_CHARS = 300


@dataclass(frozen=True)
class StackTarget:
    """One process to read: who it is (for the reply) and where it is (for py-spy)."""

    host: str
    role: str
    rank: int
    pid: int  # as the process itself says (the reply's ``pid``)
    node_pid: int  # in the daemon's pid namespace: what py-spy attaches to
    training_tid: int | None  # the thread that counts steps (hello ``training_tid``)

    def unread(self, why: str, read_ms: float | None = None) -> RankRow:
        """Its row when py-spy gave no stacks (its agent thread may)."""
        return self.row(ReadStatus.UNREAD, error=why, read_ms=read_ms)

    def row(
        self,
        status: ReadStatus,
        source: Source | None = None,
        threads: tuple[Thread, ...] = (),
        error: str | None = None,
        read_ms: float | None = None,
    ) -> RankRow:
        return RankRow(
            status,
            StackRank(
                host=self.host,
                role=self.role,
                rank=self.rank,
                pid=self.pid,
                source=source,
                threads=threads,
                error=error,
                read_ms=read_ms,
            ),
        )


#: The py-spy the daemon runs, when set; set and empty: none, so stacks come only from the
#: clients' agent threads (a host where nothing may ptrace the jobs).
PYSPY_ENV = "PROFD_PYSPY"


def find_pyspy() -> str | None:
    """``$PROFD_PYSPY``, else py-spy beside this interpreter (its wheel puts the binary in
    the venv's bin), else on PATH."""
    if PYSPY_ENV in os.environ:
        return os.environ[PYSPY_ENV] or None
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def read_one(
    pyspy: str | None, t: StackTarget, timeout: float = READ_TIMEOUT_S, native: bool = False
) -> RankRow:
    """One process's stacks as a rank row, with ``error`` instead of threads when py-spy
    could not read them."""
    if pyspy is None:
        return t.unread("py-spy not found (or turned off: PROFD_PYSPY empty)")
    argv = [pyspy, "dump", "--pid", str(t.node_pid), "--json"]
    if native:
        argv.append("--native")
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            timeout=min(timeout, NATIVE_TIMEOUT_S) if native else timeout,
            check=False,
            env=_PYSPY_ENV,
        )
    except subprocess.TimeoutExpired:
        if native:
            # Unwinding native stacks is what took long (a loaded host, many threads):
            # the Python stacks alone still say where it is.
            return read_one(pyspy, t, timeout, native=False)
        return t.unread(f"py-spy gave no stacks in {timeout:g}s")
    except OSError as exc:
        return t.unread(f"py-spy did not run: {exc}")
    read_ms = round((time.monotonic() - started) * 1000, 1)
    if done.returncode != 0:
        alive = _alive(t.node_pid)
        if native and alive:
            return read_one(pyspy, t, timeout, native=False)
        if not alive:
            return t.row(ReadStatus.EXITED, error=EXITED, read_ms=read_ms)
        return t.unread(_why(done, t.node_pid), read_ms)
    try:
        threads = stackgroups.parse_pyspy(json.loads(done.stdout))
    except ValueError as exc:  # json.JSONDecodeError is one
        return t.unread(f"py-spy's output unreadable: {exc}"[:ERROR_CHARS], read_ms)
    marked = stackgroups.mark_training(threads, t.training_tid, t.node_pid)
    return t.row(ReadStatus.READ, source=Source.PYSPY, threads=marked, read_ms=read_ms)


#: py-spy's environment: RUST_BACKTRACE set in the daemon's would append py-spy's own Rust
#: backtrace to its error, whose last line ("10: main") then hid the reason.
_PYSPY_ENV = {**os.environ, "RUST_BACKTRACE": "0"}
#: Bit of CAP_SYS_PTRACE in /proc/PID/status's CapEff.
_CAP_SYS_PTRACE = 19
_YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")


#: A rank's ``error`` when its process was gone by the time py-spy read it.
EXITED = "the process exited while its stacks were read"


def _why(done: subprocess.CompletedProcess[bytes], pid: int) -> str:
    """What py-spy said, for a process that still lives."""
    text = (done.stderr or done.stdout).decode("utf-8", "replace").strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # py-spy's last line is its reason ("Permission denied", "No such process", ...).
    reason = lines[-1] if lines else f"exit status {done.returncode}"
    reason = re.sub(r"^\d+: ", "", reason)  # the innermost of its numbered causes
    if "os error 13" in reason or "os error 1)" in reason:
        reason += f" ({ptrace_denied(pid)})"
    return f"py-spy: {reason}"[:ERROR_CHARS]


def ptrace_denied(pid: int) -> str:
    """Why this daemon may not trace ``pid``, as far as /proc says: the operator's fix is
    one of these (or the agent thread's answer is what there is)."""
    why = []
    try:
        scope = int(_YAMA.read_text())
    except (OSError, ValueError):
        scope = 0
    if scope > 0:
        why.append(f"Yama's ptrace_scope is {scope}")
    me, caps = _status("self")
    uid, _ = _status(str(pid))
    if not caps >> _CAP_SYS_PTRACE & 1:
        if uid is not None and uid != me:
            why.append(f"it runs as uid {uid}, the daemon as uid {me} without CAP_SYS_PTRACE")
        elif not why:
            why.append("the daemon lacks CAP_SYS_PTRACE")
    return "the daemon may not trace it: " + ("; ".join(why) or "denied by the kernel")


def _status(pid: str) -> tuple[int | None, int]:
    """(effective uid, effective capabilities) of /proc/PID/status; (None, 0) unreadable."""
    uid, caps = None, 0
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("Uid:"):
                uid = int(ln.split()[2])
            elif ln.startswith("CapEff:"):
                caps = int(ln.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return uid, caps


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the pid exists, delivers nothing
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


Done = Callable[[list[RankRow]], None]
CallSoon = Callable[..., None]


class StackReader:
    """Reads processes' stacks on a pool of worker threads; each request's rank rows (in
    the order of its targets) go to the loop through ``call_soon``."""

    def __init__(
        self,
        call_soon: CallSoon,
        pyspy: str | None = None,
        workers: int = WORKERS,
        timeout: float = READ_TIMEOUT_S,
        budget: float = REQUEST_BUDGET_S,
    ) -> None:
        self.call_soon = call_soon
        self.pyspy = pyspy if pyspy is not None else find_pyspy()
        self.timeout = timeout
        self.budget = budget
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="profd-stacks")

    def read(self, targets: list[StackTarget], done: Done, native: bool = False) -> None:
        """Read every target's stacks (with native frames when ``native``); ``done(rows)``
        runs on the loop once all are read."""
        if not targets:
            self.call_soon(done, [])
            return
        rows: list[RankRow | None] = [None] * len(targets)
        deadline = time.monotonic() + self.budget
        all_read = FanIn(
            len(targets), lambda: self.call_soon(done, [r for r in rows if r is not None])
        )

        def one(i: int, t: StackTarget) -> None:
            try:
                # Without py-spy there is nothing to wait for: the row says so at once,
                # however late the pool got to it, rather than that the time ran out.
                if self.pyspy is not None and time.monotonic() > deadline:
                    row = t.unread("not read: the request's time ran out")
                else:
                    row = read_one(self.pyspy, t, self.timeout, native)
            except Exception as exc:  # one process's failure must not lose the others'
                log.exception("reading the stacks of pid %s", t.node_pid)
                row = t.unread(f"{type(exc).__name__}: {exc}")
            rows[i] = row
            all_read.arrived()

        for i, t in enumerate(targets):
            self._pool.submit(one, i, t)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def job_doc(job: str, rows: Sequence[RankRow]) -> dict[str, Any]:
    """One job's reply (``profd.control_schema.STACKS_DOC``): its ranks in rank order and
    their groups, and where their flight recorders part when they sent any."""
    ranks = sorted((r.stacks for r in rows), key=rank_order)
    doc: dict[str, Any] = {"job": job, "groups": stackgroups.group(ranks), "ranks": ranks}
    flight = flightrec.divergence(ranks)
    if flight is not None:
        doc["flight"] = flight
    maps: dict[str, Any] = to_maps(doc)
    return maps
