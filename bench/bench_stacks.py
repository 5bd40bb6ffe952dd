"""``profctl stacks`` (docs/design.md "Hangs"): over 64 local ranks, and ``--cluster`` over
1,024 nodes.

Local: a real daemon and ``--ranks`` real Python processes (``bench/steploop.py``), each
attached with profd_client, stepping every ``--step-ms`` on a thread of its own. Per trial,
the wall time of ``profctl stacks --json`` (py-spy reads every process, blocking mode: each
is paused while its stacks are copied), each row's ``read_ms`` (py-spy's run, its start
included), and each process's longest step gap in the window; the same gap measured over an
equal window with no read is the baseline (what the loaded scheduler alone does).

Cluster: ``bench/simnodes.py`` nodes of ``--node-ranks`` ranks answer ``stacks`` over the real
control protocol (CURVE, TCP) with a realistic document, one node with a stuck rank; the wall
time of ``profctl --cluster @nodes --json stacks`` (fan-out, every node's ranks grouped
together) and, in process, of the grouping alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import benchlib as B

from profd.watch import stackgroups
from profd.watch.stackrows import ranks_of


def profctl(env: dict[str, str], *args: str) -> tuple[float, Any]:
    t0 = time.monotonic()
    r = subprocess.run(
        [str(B.BIN / "profctl"), *args], env=env, capture_output=True, text=True, timeout=300
    )
    dt = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"profctl {args} exited {r.returncode}: {r.stderr[-2000:]}")
    return dt, json.loads(r.stdout)


def gaps(ranks: list[Any]) -> list[float]:
    return [B.ask(w, {"op": "gap"})["max_gap_ms"] for w in ranks]


def reset(ranks: list[Any]) -> None:
    for w in ranks:
        B.ask(w, {"op": "reset"})


def local(args: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    d = B.Daemon().start()
    try:
        env, ranks = B.steploop_ranks(d, args.ranks, args.step_ms)
    except BaseException:
        d.stop()
        raise
    try:
        profctl(env, "stacks", "--json")  # py-spy's first runs: its binary into the page cache
        wall, read_ms, during, quiet = [], [], [], []
        for _ in range(args.trials):
            reset(ranks)
            dt, doc = profctl(env, "stacks", "--json")
            during += gaps(ranks)
            assert len(doc["ranks"]) == args.ranks, len(doc["ranks"])
            bad = [r for r in doc["ranks"] if r["source"] != "py-spy"]
            assert not bad, bad[:2]
            assert all(sum(t["training"] for t in r["threads"]) == 1 for r in doc["ranks"])
            wall.append(dt)
            read_ms += [r["read_ms"] for r in doc["ranks"]]
            reset(ranks)
            time.sleep(dt)
            quiet += gaps(ranks)
    finally:
        B.finish_workers(ranks)
        d.stop()
    n = args.ranks
    rows = [
        B.row(
            f"profctl stacks --json, {n} local ranks (p50)",
            "<= 2 s",
            B.pct(wall, 50),
            "s",
            met=B.pct(wall, 50) <= 2.0,
            spread=f"max {max(wall):.3f} s over {len(wall)}",
        ),
        B.row(
            f"py-spy read per process, {n} ranks (read_ms p50)",
            "ms (pause)",
            B.pct(read_ms, 50),
            "ms",
            spread=f"p99 {B.pct(read_ms, 99):.1f}, max {max(read_ms):.1f}",
        ),
        B.row(
            f"longest step gap of a rank during the read ({args.step_ms:g} ms steps, p50)",
            "ms of pause",
            B.pct(during, 50),
            "ms",
            baseline=B.pct(quiet, 50),
            baseline_what="the same window without a read",
            spread=f"p99 {B.pct(during, 99):.1f}, max {max(during):.1f};"
            f" without: p99 {B.pct(quiet, 99):.1f}, max {max(quiet):.1f}",
        ),
    ]
    details = {
        "wall_s": wall,
        "read_ms": B.summary(read_ms),
        "gap_during_ms": B.summary(during),
        "gap_quiet_ms": B.summary(quiet),
    }
    return rows, details


def cluster(args: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    stuck = args.nodes // 2
    sim = B.SimNodes(args.nodes, args.node_ranks, args.procs, ["--stuck-node", str(stuck)])
    try:
        wall = []
        for _ in range(args.trials):
            dt, doc = profctl(sim.env, "--node-timeout", "30", "--json", "stacks")
            assert len(doc["ranks"]) == args.nodes * args.node_ranks, len(doc["ranks"])
            majority, suspect = doc["groups"]
            assert suspect["ranks"] == [
                {"host": f"sim{stuck:04d}", "role": "trainer", "rank": stuck * args.node_ranks + 1}
            ], suspect["ranks"]
            assert len(majority["ranks"]) == len(doc["ranks"]) - 1
            wall.append(dt)
        group_s = []
        for _ in range(args.trials):
            t0 = time.monotonic()
            stackgroups.group([r for r in ranks_of(doc["ranks"]) if r is not None])
            group_s.append(time.monotonic() - t0)
    finally:
        sim.close()
    what = f"{args.nodes} nodes x {args.node_ranks} ranks"
    rows = [
        B.row(
            f"profctl --cluster stacks --json, {what} (p50)",
            "<= 5 s",
            B.pct(wall, 50),
            "s",
            met=B.pct(wall, 50) <= 5.0,
            spread=f"max {max(wall):.3f} s over {len(wall)}",
        ),
        B.row(
            f"  of which decoding and grouping {args.nodes * args.node_ranks} ranks in profctl"
            " (p50)",
            "-",
            B.pct(group_s, 50),
            "s",
        ),
    ]
    return rows, {"cluster_wall_s": wall, "group_s": group_s, "stuck_node": stuck}


def main() -> int:
    ap = B.parser(__doc__)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--node-ranks", type=int, default=4)
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.nodes, args.procs, args.trials = 4, 16, 2, 2
    started = time.monotonic()
    rows, details = local(args)
    more, cdetails = cluster(args)
    B.write_result(
        "stacks", args.out, args.quick, vars(args), rows + more, {**details, **cdetails}, started
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
