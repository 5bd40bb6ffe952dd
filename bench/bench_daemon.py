"""Daemon cost with many attached clients: CPU%, RSS and ``profctl ps`` latency.

A real daemon (1 s heartbeats); first idle (0 clients), then with N simulated clients
(bench/simclients.py: real Agent + Stepper code, 1 Hz heartbeats, 10 steps/s) in a few
worker processes. The targets are stated at 1 Hz, so the daemon's heartbeat pace is off
(``max_heartbeats_per_s = 0``); ``--paced`` leaves it at its default, as a new user's daemon
runs (past 256 clients it tells them a longer interval), and the rows say the interval the
clients were told. An older tree ignores the key. CPU% of one core = (user+system CPU time
of the daemon process, children included) / wall time, over the whole window and per 1 s
slice; RSS sampled every second (daemon plus children). ``profctl ps`` latency: the full
``profctl --json ps`` command as a user runs it (a new Python process each time), and the
raw control request round trip on one connection. The simulated clients run on the same
machine and compete for its cores.

Targets at 1024 clients: <= 5% of one core, <= 150 MB RSS, ``profctl ps`` and ``profctl top
--once`` <= 100 ms.
Baselines: the CPU is compared with the transport's floor in the same run (a bare ZeroMQ
ROUTER receiving as many connections at the same rate, ``transport_floor.py``): what is
above it is profd's own work. dynolog cannot list attached processes at all, so ps is
compared with the same daemon idle (0 clients).
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B
from transport_floor import Floor


def proc_tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def cpu_s(procs: list[psutil.Process]) -> float:
    """CPU seconds of ``procs`` and of the children they reaped: a short-lived child (the
    warehouse's flush process) that ends between two readings is counted all the same (its
    time moves from its own entry to its parent's ``children_*`` when it is waited for)."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def rss(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def sample(pid: int, window: float, extra_pids: list[int] | None = None) -> dict[str, Any]:
    procs = proc_tree(pid)
    extra = [psutil.Process(p) for p in extra_pids or []]
    t0, c0, e0 = time.monotonic(), cpu_s(procs), cpu_s(extra)
    slices, rss_s = [], [rss(procs)]
    last_t, last_c = t0, c0
    while time.monotonic() - t0 < window:
        time.sleep(1.0)
        procs = proc_tree(pid)
        now, c = time.monotonic(), cpu_s(procs)
        slices.append((c - last_c) / (now - last_t) * 100)
        rss_s.append(rss(procs))
        last_t, last_c = now, c
    wall = time.monotonic() - t0
    return {
        "window_s": round(wall, 1),
        "cpu_percent_of_one_core": round((last_c - c0) / wall * 100, 3),
        "cpu_percent_per_1s": B.summary(slices, 2),
        "rss_mb": B.summary([r / 1e6 for r in rss_s], 1),
        "clients_cpu_percent": round((cpu_s(extra) - e0) / wall * 100, 1) if extra else None,
        "loadavg": [round(x, 2) for x in psutil.getloadavg()],
    }


def ps_latency(
    d: B.Daemon, cli_runs: int, raw_runs: int, command: str = "ps", args: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``profctl --json COMMAND`` as a user runs it, and the raw request on one connection
    (the reply unpacked: a table, or maps from a daemon before the table form)."""
    cli = []
    n_rows = None
    for _ in range(cli_runs):
        t0 = time.perf_counter()
        r = d.ctl("--json", command, *args)
        cli.append((time.perf_counter() - t0) * 1000)
        assert r.returncode == 0, r.stderr
        n_rows = r.stdout.count('"pid"')
    raw = []
    # As profctl asks: a daemon from before the table form ignores ``form`` and sends maps.
    form = {"form": "table"}
    d.request(command, **form)
    for _ in range(raw_runs):
        t0 = time.perf_counter()
        data = d.request(command, **form)
        raw.append((time.perf_counter() - t0) * 1000)
    rows = data["rows"] if isinstance(data, dict) else data
    return {
        "form": "table" if isinstance(data, dict) else "maps",
        "rows": len(rows),
        "cli_rows": n_rows,
        "cli_ms": B.summary(cli, 1),
        "raw_request_ms": B.summary(raw, 2),
    }


def top_latency(d: B.Daemon, cli_runs: int, raw_runs: int) -> dict[str, Any] | None:
    """``profctl --json top --once``; None against a daemon without ``top`` (the base of a
    paired run from before the step ledger)."""
    if d.ctl("--json", "top", "--once").returncode != 0:
        return None
    return ps_latency(d, cli_runs, raw_runs, "top", ("--once",))


def python_floor(runs: int, env: dict[str, str]) -> dict[str, Any]:
    """Interpreter start + profctl's imports: the floor under any Python CLI's latency
    (``env``: profctl's, and ``-P``: the current directory kept off ``sys.path``, so its
    modules come from where the ``profctl`` script's do)."""
    out = {}
    for name, code in (
        ("python -c pass", "pass"),
        ("import profctl modules", "import profd.ctl.main"),
    ):
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-P", "-c", code], check=True, env=env)
            ts.append((time.perf_counter() - t0) * 1000)
        out[name] = B.summary(ts, 1)
    return out


def host_speed(runs: int = 5) -> float:
    """Milliseconds (best of ``runs``) of a fixed pure-Python workload that never changes
    with profd's code: dict updates, float arithmetic and a sort, the daemon's kind of work.
    This VM's speed has been seen to vary 3x within one hour with the load
    average under 1, so a CPU figure from one run is compared with another's only beside
    this one."""
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        d: dict[int, float] = {}
        for i in range(200_000):
            k = i & 1023
            d[k] = d.get(k, 0.0) + i * 0.5
        sorted(d.values())
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000.0, 2)


#: Where the loop waits for work: its samples are idle time, not cost.
IDLE_FRAMES = ("Poller.poll",)


def _record(pid: int, seconds: float, raw: Path) -> list[str]:
    subprocess.run(
        [str(B.BIN / "py-spy"), "record", "--pid", str(pid), "--duration", str(int(seconds)),
         "--rate", "200", "--format", "raw", "--idle", "--nonblocking", "-o", str(raw)],
        check=True, capture_output=True,
    )  # fmt: skip
    return raw.read_text().splitlines()


def loop_profile(pid: int, seconds: float, top: int = 25) -> dict[str, Any]:
    """The daemon's main thread sampled by py-spy (the same tool ``profctl stacks`` uses):
    each function's share of the thread's busy samples, inclusive of what it calls."""
    with tempfile.TemporaryDirectory() as tmp:
        lines = _record(pid, seconds, Path(tmp) / "raw.txt")
    busy, idle, inclusive = 0, 0, Counter[str]()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")]
        if "Daemon._loop" not in frames:
            continue  # another thread (the sampler, a worker)
        if frames[-1] in IDLE_FRAMES:
            idle += int(count)
            continue
        busy += int(count)
        for name in set(frames[frames.index("Daemon._loop") + 1 :]):
            inclusive[name] += int(count)
    return {
        "busy_share_of_loop": round(busy / max(1, busy + idle), 4),
        "by_function": {k: round(v / max(1, busy), 3) for k, v in inclusive.most_common(top)},
    }


def gc_note(
    before: dict[str, Any] | None, busy: dict[str, Any] | None, after: dict[str, Any] | None
) -> str:
    """The collector's passes (young/middle/full) over the CPU window and over the ps and
    top requests, for the round trip's row (a daemon before 0.3 does not report them)."""
    if not before or not busy or not after:
        return ""

    def passes(a: dict[str, Any], b: dict[str, Any]) -> str:
        return "/".join(str(y - x) for x, y in zip(a["passes"], b["passes"], strict=True))

    return (
        f"; gc passes {passes(before, busy)} in the CPU window, {passes(busy, after)} over"
        f" the requests, longest full pass since start {after['longest_ms'][2]} ms"
    )


def main() -> None:
    ap = B.parser(__doc__)
    ap.add_argument("--clients", type=int, default=None)
    ap.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also sample the busy daemon's stacks with py-spy for SECONDS and report where "
        "its main loop's time goes (share of busy samples per function, inclusive)",
    )
    ap.add_argument(
        "--daemon-from",
        metavar="TREE",
        default=None,
        help="run profd and profctl from the source tree TREE (a worktree of the commit to "
        "compare with), the harness and the simulated clients from this one",
    )
    ap.add_argument(
        "--paced",
        action="store_true",
        help="leave the daemon's heartbeat pace at its default (a new user's daemon) instead "
        "of keeping every client at 1 Hz as the targets state",
    )
    args = ap.parse_args()
    daemon_env = B.daemon_from(args.daemon_from)
    started = time.monotonic()
    quick = args.quick
    n = args.clients or (16 if quick else 1024)
    # A minute at least: once a minute the daemon closes every rank's minute, writes them
    # and flushes the warehouse, and a shorter window catches that or not by chance.
    window = 2.0 if quick else 60.0
    cli_runs, raw_runs = (2, 20) if quick else (20, 200)
    speed_before = host_speed()
    pace = "" if args.paced else "max_heartbeats_per_s = 0\n"
    d = B.Daemon(heartbeat=1.0, extra_env=daemon_env, daemon_keys=pace).start()
    fleet = None
    try:
        time.sleep(1.0)
        idle = sample(d.pid, window / 2)
        idle_ps = ps_latency(d, cli_runs, raw_runs)
        idle_top = top_latency(d, cli_runs, raw_runs)
        fleet = B.SimFleet(d, n, 4, job="bench-daemon", hb=1.0, rate=10.0)
        fleet.wait_connected(300)
        B.wait_for(lambda: d.request("status")["clients"] >= n, 120, "daemon to see clients")
        time.sleep(1.0 if quick else 3.0)
        gc0 = d.request("status").get("gc")
        busy = sample(d.pid, window, extra_pids=[w.pid for w in fleet.workers])
        gc_busy = d.request("status").get("gc")
        # The interval the clients were told (an older daemon does not pace: its own).
        hb_s = float((d.request("status").get("heartbeat") or {}).get("interval_s", 1.0))
        assert d.request("status")["clients"] >= n
        busy_ps = ps_latency(d, cli_runs, raw_runs)
        busy_top = top_latency(d, cli_runs, raw_runs)
        gc1 = d.request("status").get("gc")
        floor = python_floor(cli_runs, d.env())
        speed_after = host_speed()
        profile = loop_profile(d.pid, args.profile) if args.profile > 0 else None
    except BaseException:
        print(d.log_tail(), file=sys.stderr)
        raise
    finally:
        if fleet is not None:
            fleet.close()
        d.stop()
    # The same number of connections at the same rate, received by a bare ROUTER that does
    # nothing else: what holding them costs any daemon on this machine, in this hour.
    floor_proc = Floor(n, hb=hb_s)
    try:
        time.sleep(1.0 if quick else 5.0)
        transport = sample(floor_proc.pid, window, extra_pids=floor_proc.peer_pids)
    finally:
        floor_proc.close()
    # The targets are stated for 1024 clients; smaller runs report their numbers unjudged
    # (the comparisons still run, so --quick exercises them).
    at_target = n >= 1024
    # The target is stated at 1 Hz: a paced run is reported, not judged.
    cpu_ok = busy["cpu_percent_of_one_core"] <= 5.0 if hb_s == 1.0 else None
    rss_ok = busy["rss_mb"]["max"] <= 150
    ps_ok = busy_ps["cli_ms"]["p50"] <= 100
    rows = [
        B.row(
            f"daemon CPU, {n} clients, heartbeats every {hb_s:g} s"
            + (" (paced)" if args.paced else ""),
            "<= 5% of one core",
            busy["cpu_percent_of_one_core"],
            "% core",
            baseline=idle["cpu_percent_of_one_core"],
            baseline_what="same daemon, 0 clients",
            ratio=None,
            met=cpu_ok if at_target else None,
            spread=f"per-1s p10..p90 {busy['cpu_percent_per_1s']['p10']}.."
            f"{busy['cpu_percent_per_1s']['p90']}; host reference {speed_before}/"
            f"{speed_after} ms",
        ),
        B.row(
            f"daemon CPU above the transport floor, {n} clients",
            "(profd's own work)",
            busy["cpu_percent_of_one_core"] - transport["cpu_percent_of_one_core"],
            "% core",
            baseline=transport["cpu_percent_of_one_core"],
            baseline_what="the floor: a bare ROUTER receiving the same (transport_floor.py)",
            ratio=busy["cpu_percent_of_one_core"] / transport["cpu_percent_of_one_core"]
            if transport["cpu_percent_of_one_core"]
            else None,
            spread=f"floor per-1s p10..p90 {transport['cpu_percent_per_1s']['p10']}.."
            f"{transport['cpu_percent_per_1s']['p90']}; ratio: daemon / floor",
        ),
        B.row(
            f"daemon RSS, {n} clients",
            "<= 150 MB",
            busy["rss_mb"]["max"],
            "MB",
            baseline=idle["rss_mb"]["max"],
            baseline_what="0 clients",
            met=rss_ok if at_target else None,
            spread="max of 1 s samples",
        ),
        B.row(
            f"profctl --json ps wall, {n} clients (p50)",
            "<= 100 ms",
            busy_ps["cli_ms"]["p50"],
            "ms",
            baseline=idle_ps["cli_ms"]["p50"],
            baseline_what="0 clients",
            met=ps_ok if at_target else None,
            spread=f"p99 {busy_ps['cli_ms']['p99']} ms; python+imports floor "
            f"{floor['import profctl modules']['p50']} ms",
        ),
        *(
            [
                B.row(
                    f"profctl --json top --once wall, {n} clients (p50)",
                    "<= 100 ms",
                    busy_top["cli_ms"]["p50"],
                    "ms",
                    baseline=idle_top["cli_ms"]["p50"] if idle_top else None,
                    baseline_what="0 clients",
                    met=busy_top["cli_ms"]["p50"] <= 100 if at_target else None,
                    spread=f"p99 {busy_top['cli_ms']['p99']} ms; request p50 "
                    f"{busy_top['raw_request_ms']['p50']} ms",
                )
            ]
            if busy_top
            else []
        ),
        B.row(
            f"ps control request round trip, {n} clients (p50)",
            "(part of ps <= 100 ms)",
            busy_ps["raw_request_ms"]["p50"],
            "ms",
            baseline=idle_ps["raw_request_ms"]["p50"],
            baseline_what="0 clients",
            spread=f"p99 {busy_ps['raw_request_ms']['p99']} ms" + gc_note(gc0, gc_busy, gc1),
        ),
    ]
    details = {
        "clients": n,
        "idle": idle,
        "busy": busy,
        # A bare ROUTER receiving the same connections at the same rate (transport_floor.py).
        "transport_floor": transport,
        "ps_idle": idle_ps,
        "ps_busy": busy_ps,
        "top_idle": idle_top,
        "top_busy": busy_top,
        "python_floor_ms": floor,
        # The same fixed workload before the daemon started and after the busy phase.
        "host_speed_ms": {"before": speed_before, "after": speed_after},
        "loop_profile": profile,
        # The daemon's garbage collector (status' gc, 0.3+) when the busy window began, when
        # it ended and after the ps and top runs.
        "gc": {"busy_start": gc0, "busy_end": gc_busy, "after_requests": gc1},
        "baseline": "dynolog has no way to list attached processes; compared with 0 clients",
    }
    params = {
        "clients": n,
        "window_s": window,
        "cli_runs": cli_runs,
        "raw_runs": raw_runs,
        "daemon_from": args.daemon_from,
        "paced": args.paced,
        "heartbeat_interval_told_s": hb_s,
    }
    B.write_result("daemon", args.out, quick, params, rows, details, started)


if __name__ == "__main__":
    main()
