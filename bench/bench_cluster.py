"""Cluster start and cluster ps over many simulated nodes, against serial triggering.

``bench/simnodes.py`` runs the nodes, a few dozen per process, each speaking the real control
protocol over TCP with CURVE on its own port. profctl is the real command line:
``profctl --cluster @nodes start --next`` (probe every node, plan once, start every node with
one session id and the same steps) and ``profctl --cluster @nodes --json ps``.

Measured per trial: from launching ``profctl start`` to each node receiving its start (its
ranks armed), p50/p99/max over nodes; and the wall time of ``ps`` over all nodes.

Baseline, in the same run: dynolog's ``unitrace.py`` triggers hosts one after another with
``os.system("dyno --hostname H gputrace ...")``. The same here: one ``profctl --cluster H
start --next`` process per host, in turn, timed over the first ``--serial-sample`` hosts and
extrapolated linearly to all of them (all 1,024 would take minutes); and, as its lower bound
without a process per host, one request per host in turn from one process for every host.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import benchlib as B

from profd import control_schema as C


def profctl(env: dict[str, str], *args: str, timeout: float = 300) -> tuple[float, Any]:
    t0 = time.monotonic()
    r = subprocess.run(
        [str(B.BIN / "profctl"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    dt = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"profctl {args} exited {r.returncode}: {r.stderr[-2000:]}")
    return dt, json.loads(r.stdout)


def arms(workers: list[subprocess.Popen[str]]) -> list[tuple[str, int, float]]:
    out: list[tuple[str, int, float]] = []
    for w in workers:
        out += [tuple(a) for a in B.ask(w, {"cmd": "arms"})["arms"]]  # type: ignore[misc]
    return out


def main() -> int:
    ap = B.parser(__doc__)
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--serial-sample", type=int, default=32)
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.procs, args.trials, args.serial_sample = 16, 2, 2, 4
    started = time.monotonic()
    sim = B.SimNodes(args.nodes, args.ranks, args.procs)
    workers, ports, env = sim.workers, sim.ports, sim.env
    try:
        timeout = ["--node-timeout", "30"]

        ps_s: list[float] = []
        for _ in range(args.trials):
            dt, rows = profctl(env, *timeout, "--json", "ps")
            assert len(rows) == args.nodes * args.ranks, len(rows)
            ps_s.append(dt)

        armed_p50, armed_p99, armed_max, start_wall = [], [], [], []
        for _ in range(args.trials):
            t0 = time.time()
            dt, res = profctl(env, *timeout, "start", "--next", "--json")
            got = [a for a in arms(workers) if a[0] == res["session"]]
            assert len({a[1] for a in got}) == args.nodes, (len(got), args.nodes)
            lat = [a[2] - t0 for a in got]
            armed_p50.append(B.pct(lat, 50))
            armed_p99.append(B.pct(lat, 99))
            armed_max.append(max(lat))
            start_wall.append(dt)

        # Baseline 1: one trigger process per host, in turn (dynolog's unitrace.py).
        sample = ports[: args.serial_sample]
        one = dict(env)
        t0 = time.monotonic()
        for p in sample:
            one["PROFD_CLUSTER"] = f"127.0.0.1:{p}"
            profctl(one, *timeout, "start", "--next", "--json")
        per_host = (time.monotonic() - t0) / len(sample)
        arms(workers)  # drop them
        serial_procs_s = per_host * args.nodes

        # Baseline 2: one request per host in turn from one process (its lower bound).
        from profd.ctl.cluster import Fanout, load_keys, parse_node

        ck = load_keys(env["PROFD_CLIENT_KEY"], env["PROFD_SERVER_KEY"])
        spec = {"next": True, "session": "serial-baseline", "cycles": [[5000, 5000, 5001]]}
        t0w = time.time()
        for p in ports:
            with Fanout(ck, 30) as f:
                f.ask([parse_node(f"127.0.0.1:{p}")], C.C_START, {"spec": spec})
        serial = [a[2] - t0w for a in arms(workers) if a[0] == "serial-baseline"]
        serial_inproc_s = max(serial)
    finally:
        sim.close()

    p99 = B.pct(armed_p99, 50)
    rows_out = [
        B.row(
            f"cluster start -> every rank armed p99, {args.nodes} nodes x {args.ranks} ranks",
            "<= 1 s",
            p99,
            "s",
            baseline=serial_procs_s,
            baseline_what=f"serial profctl per host ({args.serial_sample} measured, x{args.nodes})",
            met=p99 <= 1.0,
            spread=f"p50 {B.pct(armed_p50, 50):.3f} s, all armed {B.pct(armed_max, 50):.3f} s,"
            f" trials {len(armed_p99)}",
        ),
        B.row(
            f"cluster start, serial requests from one process, {args.nodes} nodes (all armed)",
            "(baseline)",
            serial_inproc_s,
            "s",
        ),
        B.row(
            f"profctl --cluster ps, {args.nodes} nodes (p50)",
            "<= 2 s",
            B.pct(ps_s, 50),
            "s",
            met=B.pct(ps_s, 50) <= 2.0,
            spread=f"max {max(ps_s):.3f} s over {len(ps_s)}",
        ),
    ]
    B.write_result(
        "cluster",
        args.out,
        args.quick,
        vars(args),
        rows_out,
        {
            "ps_s": ps_s,
            "armed_p50_s": armed_p50,
            "armed_p99_s": armed_p99,
            "armed_max_s": armed_max,
            "start_wall_s": start_wall,
            "serial_per_host_s": per_host,
            "serial_inproc_all_armed_s": serial_inproc_s,
        },
        started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
