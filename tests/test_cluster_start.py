"""``profctl --cluster start`` with a real two-node torchrun job.

Four daemons on this machine (own dirs, node names, TCP ports, CURVE keys from ``profctl keys
new``); two torchrun agents (``--nnodes 2``, c10d rendezvous on 127.0.0.1) of one job, each
node's two ranks attached to a different daemon, the other two daemons idle. profctl plans
once for all four ranks and arms both nodes with one session id and the same absolute steps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clusters import Cluster, free_port
from daemonproc import BIN, wait_for
from harness import JOBS, Daemon, Job, step_markers
from s3fixtures import BUCKET, MotoServer, moto_server
from test_s3 import PREFIX, URL, s3_config

pytestmark = pytest.mark.slow
__all__ = ["moto_server"]  # the fixture, imported so pytest finds it

WAIT = 120.0


def launch_two_nodes(
    cluster: Cluster, logs: Path, config: str = "", env: dict[str, str] | None = None
) -> list[Job]:
    """Four daemons: node-a and node-b each with one torchrun agent (2 ranks) of job
    ``twonode``, node-c and node-d with nothing attached (they answer, and take no part)."""
    port = free_port()
    agents = []
    for k, name in enumerate(("node-a", "node-b")):
        d, _ = cluster.add(name, heartbeat=0.5, config=config, env=env)
        job_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PROFD_")},
            "PROFD_RUNTIME_DIR": str(d.runtime_dir),
            "PROFD_HEARTBEAT": "0.5",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "STEPS": "1000000",
            "STEP_SLEEP": "0.05",
        }
        cmd = [
            str(BIN / "torchrun"),
            "--nnodes=2",
            f"--node-rank={k}",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=twonode",
            str(JOBS / "train.py"),
        ]
        agents.append(Job.spawn(cmd, job_env, logs / f"agent{k}.log"))
    for name in ("node-c", "node-d"):
        cluster.add(name, heartbeat=0.5, config=config, env=env)
    return agents


def stop_agents(agents: list[Job]) -> None:
    for a in agents:
        a.kill()  # the whole tree: torchrun's workers run in sessions of their own


@pytest.fixture
def two_nodes(cluster: Cluster, tmp_path: Path) -> Iterator[list[tuple[Daemon, str]]]:
    agents = launch_two_nodes(cluster, tmp_path)
    try:
        yield cluster.nodes
    finally:
        stop_agents(agents)


def stepping(cluster: Cluster) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        r = cluster.ctl("ps", "--json")
        rows = json.loads(r.stdout) if r.returncode == 0 else []
        return rows if len(rows) == 4 and all(x["steps_per_s"] > 0 for x in rows) else None

    rows: list[dict[str, Any]] = wait_for(ready, WAIT, "4 ranks stepping on 2 nodes", every=0.3)
    return rows


def traces(cluster: Cluster, sid: str) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for r in cluster.json("traces", "--session", sid)}


def test_one_plan_arms_ranks_on_two_nodes_with_the_same_steps(
    cluster: Cluster, two_nodes: list[tuple[Daemon, str]], tmp_path: Path
) -> None:
    rows = stepping(cluster)
    node_of = {r["rank"]: r["host"] for r in rows}
    assert sorted(node_of) == [0, 1, 2, 3]
    assert set(node_of.values()) == {"node-a", "node-b"}
    assert node_of[1] != node_of[2], node_of  # c10d puts ranks 0,1 and 2,3 on one agent each
    assert len({r["job"] for r in rows}) == 1, rows

    # Explicit steps on ranks that live on different nodes, ~3 s ahead. On a loaded machine
    # the ranks can pass them before the plan reaches both nodes, and the start is refused
    # as it must be: then again, further on.
    for _ in range(3):
        first = max(r["step"] for r in rows) + 60
        r = cluster.ctl(
            "start", "--ranks", "1,2", "--steps", f"{first}:{first + 2}", "--wait",
            "--timeout", str(WAIT), "--json",
        )  # fmt: skip
        if "already passed" not in r.stderr:
            break
        rows = stepping(cluster)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["state"] == "done", res
    got = traces(cluster, res["session"])
    assert sorted(got) == [1, 2] and got[1]["host"] != got[2]["host"], got
    for rank in (1, 2):
        assert step_markers(Path(got[rank]["path"])) == [first, first + 1], rank

    # --next: the first step every rank on every node can make, the same on all four.
    r = cluster.ctl("start", "--next", "--wait", "--timeout", str(WAIT), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["state"] == "done", res
    got = traces(cluster, res["session"])
    assert sorted(got) == [0, 1, 2, 3], got
    assert {tuple(step_markers(Path(t["path"]))) for t in got.values()} == {tuple(res["steps"])}
    # One session id on both nodes.
    assert {n["host"] for n in cluster.json("show", res["session"])["nodes"]} == {
        "node-a",
        "node-b",
    }
    # The cross-rank report of a cluster session: every rank of both nodes in one report.
    report = cluster.json("report", res["session"], "-o", str(tmp_path / "report.html"))
    assert sorted(x["rank"] for x in report["ranks"]) == [0, 1, 2, 3], report["ranks"]
    assert set(report) >= {"session", "steps", "ranks", "stragglers", "verdict"}
    assert (tmp_path / "report.html").stat().st_size > 0


def test_a_node_that_is_down_is_named_and_the_session_is_partial(
    cluster: Cluster, two_nodes: list[tuple[Daemon, str]]
) -> None:
    stepping(cluster)
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    nodes = [a for _, a in two_nodes] + [down]  # four daemons and one that is down
    r = cluster.ctl(
        "--node-timeout", "2", "start", "--next", "--wait", "--timeout", str(WAIT), "--json",
        nodes=nodes,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    res = json.loads(r.stdout)
    assert res.get("state") == "partial", (res, r.stderr)
    # It planned from the steps the answering nodes gave after the down node's timeout.
    assert "asking the 4 answering node(s) again" in r.stderr, r.stderr
    assert down in res["final"]["error"], res
    [left] = [n for n in res["final"]["nodes"] if n["address"] == down]
    assert left["state"] == "no answer", left
    assert sorted(t["rank"] for t in res["final"]["targets"]) == [0, 1, 2, 3]


def test_a_two_node_session_is_one_s3_directory_that_pulls_and_loads_as_one(
    cluster: Cluster, tmp_path: Path, moto_server: MotoServer
) -> None:
    agents = launch_two_nodes(cluster, tmp_path, config=s3_config(), env=moto_server.env())
    try:
        stepping(cluster)
        r = cluster.ctl("start", "--next", "--wait", "--timeout", str(WAIT), "--json")
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["state"] == "done", res
    finally:
        stop_agents(agents)
    sid, job = res["session"], res["job"]
    base = f"{PREFIX}/{job}/{sid}/"

    def complete() -> dict[str, int] | None:
        objs = moto_server.objects(base)
        names = {k[len(base) :] for k in objs}
        want = {"session.node-a.json", "session.node-b.json"}
        return (
            objs if want <= names and len([n for n in names if n.startswith("c0/")]) >= 4 else None
        )

    objs = wait_for(complete, WAIT, "both nodes' uploads", every=0.5)
    names = sorted(k[len(base) :] for k in objs)
    # One directory: every rank's trace in c0, one manifest per node, none overwritten.
    assert "session.json" not in names, names
    assert {n for n in names if n.startswith("c0/") and n.endswith(".pt.trace.json.gz")} == {
        f"c0/main-r{r}.pt.trace.json.gz" for r in range(4)
    }
    nodes = {
        json.loads(moto_server.get(base + n))["node"] for n in names if n.startswith("session.")
    }
    assert nodes == {"node-a", "node-b"}

    # Read as one from S3 alone: no daemon involved.
    env = {**moto_server.env(), "PROFD_CLUSTER": ""}
    listed = cluster.ctl("traces", "--s3", URL, "--session", sid, "--json", nodes=[], **env)
    assert listed.returncode == 0, listed.stderr
    assert "manifests are in S3" not in listed.stderr  # both nodes' are there
    rows = json.loads(listed.stdout)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], rows
    out = tmp_path / "pulled"
    r = cluster.ctl("pull", sid, "--s3", URL, "-o", str(out), nodes=[], **env)
    assert r.returncode == 0, r.stderr
    cycle = out / sid / "c0"
    assert sorted(p.name for p in cycle.glob("*.pt.trace.json.gz")) == [
        f"main-r{r}.pt.trace.json.gz" for r in range(4)
    ]
    assert (out / sid / "session.node-a.json").is_file()
    assert (out / sid / "session.node-b.json").is_file()

    from hta.trace_analysis import TraceAnalysis

    analyzer = TraceAnalysis(trace_dir=str(cycle))
    assert sorted(analyzer.t.traces) == [0, 1, 2, 3]

    # A node whose manifest is not there (still uploading, or its daemon died): what the
    # other node uploaded is listed and pulled, and every reader says the session is short.
    moto_server.client().delete_object(Bucket=BUCKET, Key=base + "session.node-b.json")
    short = "only 1 of 2 nodes' manifests are in S3 (node-a)"
    partial = cluster.ctl("traces", "--s3", URL, "--session", sid, "--json", nodes=[], **env)
    assert partial.returncode == 0 and short in partial.stderr, partial.stderr
    assert len(json.loads(partial.stdout)) == 2
    again = cluster.ctl("pull", sid, "--s3", URL, "-o", str(tmp_path / "again"), nodes=[], **env)
    assert again.returncode == 0 and short in again.stderr, again.stderr
    page = tmp_path / "short.html"
    report = cluster.ctl("report", sid, "--s3", URL, "-o", str(page), nodes=[], **env)
    assert report.returncode == 0 and short in report.stderr, report.stderr
    assert page.is_file()
