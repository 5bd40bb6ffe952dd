"""Hang incidents on real jobs (docs/design.md "Hangs"): real daemons whose ``[watch]
stall_after`` is short, real gloo DDP jobs of ``tests/jobs/stuck.py``, stacks read by real py-spy.

* rank 1 stuck in ``stuck_in_data_loading`` while ranks 0 and 2 wait in the all-reduce: one
  ``hang`` incident naming rank 1 alone, with the grouped stacks, in the index and the spool;
  when rank 1 comes back and the job steps again, the incident is resolved;
* at 2 ranks, rank 1 holding the GIL in one C call (its agent thread starved): still
  attached, read by py-spy, named;
* a daemon restarted while a job is stalled holds its open hang incident again, and resolves
  it as soon as the job steps again (raw stepping peers: ``steppeer.py``);
* every rank in ``save_checkpoint`` at once (a pause on purpose): an incident with no
  suspect that says so;
* two daemons, a 2-node job whose node-b ranks are both stuck (each node looks uniform
  alone): ``profctl --cluster incidents`` merges the two nodes' incidents into one that
  names node-b's ranks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from clusters import Cluster
from daemonproc import BIN, free_port
from harness import JOBS, Daemon, Job, wait_for
from steppeer import step_peers

pytestmark = [pytest.mark.slow]

STALL_AFTER = 3.0
WATCH = f"""
[daemon]
heartbeat_interval = 0.5
[watch]
stall_after = {STALL_AFTER}
hold = 2.0
"""
WAIT = 120.0
#: Between two ``profctl incidents`` while waiting for one: each is a Python process, and the
#: incident comes seconds after the stall (``stall_after`` and ``hold``), not within 0.1 s.
POLL = 0.5


def hangs(read: Callable[..., Any], *args: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = read("incidents", "--kind", "hang", *args)
    return rows


def _functions(frames: list[dict[str, Any]]) -> list[str]:
    return [f["function"] for f in frames]


def test_a_stuck_rank_is_a_hang_incident_naming_it_alone_resolved_when_the_job_steps_again(
    daemon_factory: Callable[..., Daemon], torchrun: Callable[..., Job], tmp_path: Path
) -> None:
    d = daemon_factory(config=WATCH)
    release = tmp_path / "release"  # rank 1 comes back once the open incident is checked
    # With torch's flight recorder on (gloo records into it too).
    torchrun(
        "stuck.py", 3, d, PROFD_JOB="stuck", STUCK_RANK="1", STUCK_AT="30", STUCK_S=str(WAIT),
        STUCK_UNTIL=str(release), STEPS="60", TORCH_FR_BUFFER_SIZE="200",
    )  # fmt: skip
    d.wait_attached(3, WAIT, min_step=5)
    (inc,) = wait_for(lambda: hangs(d.ctl_json), WAIT, "a hang incident", every=POLL)
    assert inc["state"] == "open", inc
    assert [(s["rank"], s["host"]) for s in inc["suspects"]] == [(1, inc["host"])]
    ev = inc["evidence"]
    assert STALL_AFTER <= ev["stalled_s"] <= STALL_AFTER + 10, ev
    assert ev["stall_after_s"] == STALL_AFTER
    majority, suspect = ev["groups"]
    assert [m["rank"] for m in majority["ranks"]] == [0, 2] and majority["majority"]
    assert "backward" in _functions(majority["frames"])
    assert [m["rank"] for m in suspect["ranks"]] == [1]
    assert "stuck_in_data_loading" in _functions(suspect["frames"])
    assert suspect["where"].startswith("in stuck_in_data_loading (stuck.py:"), suspect
    assert {r["source"] for r in ev["ranks"]} == {"py-spy"}
    assert "rank 1 in stuck_in_data_loading" in ev["verdict"], ev["verdict"]
    assert inc["session"] is None  # a stalled job makes no step to capture at
    # Each rank's flight recorder, dumped by its agent thread: ranks 0 and 2 entered a
    # collective that rank 1 never reached.
    (part,) = ev["flight"]["groups"]
    assert part["kind"] == "behind" and part["op"] == "gloo:all_reduce", part
    assert [m["rank"] for m in part["behind"]] == [1]
    assert [m["rank"] for m in part["ahead"]] == [0, 2]
    assert part["behind"][0]["last"] == part["seq"] - 1

    # Kept as every incident is: in the spool, and profctl renders the groups.
    on_disk = json.loads((d.spool / "stuck" / "incidents" / f"{inc['id']}.json").read_text())
    assert on_disk["id"] == inc["id"] and on_disk["kind"] == "hang"
    text = d.ctl("incident", inc["id"])
    assert text.returncode == 0, text.stderr
    assert "suspect   rank 1: in stuck_in_data_loading" in text.stdout, text.stdout
    assert "majority  ranks 0, 2:" in text.stdout, text.stdout
    assert f"rank 1 never reached collective #{part['seq']} (gloo:all_reduce)" in text.stdout
    assert "hang" in d.log.read_text()

    # Rank 1 comes back, the job steps again: resolved, and nothing new opened.
    release.touch()

    def resolved() -> dict[str, Any] | None:
        rows = hangs(d.ctl_json)
        return rows[0] if rows and rows[0]["state"] == "resolved" else None

    done = wait_for(resolved, WAIT, "the hang to resolve")
    assert done["id"] == inc["id"] and len(hangs(d.ctl_json)) == 1


def test_a_rank_holding_the_gil_is_read_from_outside_and_named_at_2_ranks(
    daemon_factory: Callable[..., Daemon], torchrun: Callable[..., Job]
) -> None:
    d = daemon_factory(config=WATCH)
    torchrun("stuck.py", 2, d, PROFD_JOB="gil", STUCK_RANK="1", STUCK_AT="30", STUCK_HOW="gil")
    d.wait_attached(2, WAIT, min_step=5)
    (inc,) = wait_for(lambda: hangs(d.ctl_json), WAIT, "a hang incident", every=POLL)
    # One against one: the rank waiting in the all-reduce is the majority.
    assert [s["rank"] for s in inc["suspects"]] == [1], inc
    majority, suspect = inc["evidence"]["groups"]
    assert "stuck_in_data_loading" in _functions(suspect["frames"])
    assert "backward" in _functions(majority["frames"])
    by_rank = {r["rank"]: r for r in inc["evidence"]["ranks"]}
    assert by_rank[1]["source"] == "py-spy"
    (training,) = by_rank[1]["threads"]
    assert "stuck_in_data_loading" in _functions(training["frames"])
    # Its agent thread is starved, yet the rank is still attached (its process lives).
    wait_for(lambda: "rank 1) silent for" in d.log.read_text(), WAIT, "rank 1's silence")
    assert sorted(r["rank"] for r in d.ps()) == [0, 1]


def test_a_hang_restored_after_a_restart_is_resolved_when_the_job_steps_again(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    d = daemon_factory(config=WATCH)
    with step_peers(tmp_path) as spawn:
        peers = [spawn(d, "restored", rank) for rank in (0, 1)]
        # Two seconds of steps: the stall rule judges a job it saw step.
        d.wait_attached(2, WAIT, min_step=100)
        for p in peers:
            p.stop()
        (inc,) = wait_for(lambda: hangs(d.ctl_json), WAIT, "a hang incident", every=POLL)
        assert inc["state"] == "open", inc
        d.stop()
        d.start()
        # Back, still stalled: the incident is held again, still open (the default window
        # and baseline keep a restored one open for minutes without a report).
        d.wait_attached(2, WAIT)
        (held,) = hangs(d.ctl_json)
        assert (held["id"], held["state"]) == (inc["id"], "open"), held
        for p in peers:
            p.go()
        done = wait_for(
            lambda: [i for i in hangs(d.ctl_json) if i["state"] == "resolved"],
            WAIT / 2,
            "the restored incident resolved once the job steps again",
        )
    assert [i["id"] for i in done] == [inc["id"]], done
    assert "job restored steps again" in d.log.read_text()


def test_every_rank_paused_in_the_same_place_is_a_hang_with_no_suspect_that_says_so(
    daemon_factory: Callable[..., Daemon], torchrun: Callable[..., Job]
) -> None:
    d = daemon_factory(config=WATCH)
    torchrun("stuck.py", 2, d, PROFD_JOB="pause", PAUSE_AT="30", STUCK_S="600")
    d.wait_attached(2, WAIT, min_step=5)
    (inc,) = wait_for(lambda: hangs(d.ctl_json), WAIT, "a hang incident", every=POLL)
    assert inc["suspects"] == []
    (only,) = inc["evidence"]["groups"]
    assert [m["rank"] for m in only["ranks"]] == [0, 1]
    assert "save_checkpoint" in _functions(only["frames"])
    assert "paused on purpose" in inc["evidence"]["verdict"], inc["evidence"]
    listed = d.ctl("incidents")
    assert listed.returncode == 0 and "pause" in listed.stdout


def test_cluster_incidents_merge_one_jobs_hang_across_nodes_and_name_the_odd_node(
    cluster: Cluster, tmp_path: Path
) -> None:
    port = free_port()
    agents = []
    try:
        for k, name in enumerate(("node-a", "node-b")):
            d, _ = cluster.add(name, heartbeat=0.5, config=WATCH.split("\n", 3)[3])
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("PROFD_")},
                "PROFD_RUNTIME_DIR": str(d.runtime_dir),
                "PROFD_HEARTBEAT": "0.5",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "PROFD_JOB": "twonode",
                "STUCK_RANK": "2,3",
                "STUCK_AT": "30",
            }
            cmd = [
                str(BIN / "torchrun"), "--nnodes=2", f"--node-rank={k}", "--nproc-per-node=2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twonode",
                str(JOBS / "stuck.py"),
            ]  # fmt: skip
            agents.append(Job.spawn(cmd, env, tmp_path / f"agent{k}.log"))

        def both() -> list[dict[str, Any]] | None:
            r = cluster.ctl("incidents", "--kind", "hang", "--json")
            assert r.returncode == 0, r.stderr
            rows: list[dict[str, Any]] = json.loads(r.stdout)
            return rows if rows and len(rows[0].get("hosts") or ()) == 2 else None

        (merged,) = wait_for(both, WAIT, "both nodes' hang incidents, merged")
        # Alone each node looks uniform: no suspect on either.
        for node, _ in cluster.nodes[:2]:
            (own,) = hangs(node.ctl_json)
            assert own["suspects"] == [], own
        assert sorted((s["host"], s["rank"]) for s in merged["suspects"]) == [
            ("node-b", 2),
            ("node-b", 3),
        ]
        assert len(merged["merged"]) == 2 and merged["evidence"]["nodes"] == 2
        majority = merged["evidence"]["groups"][0]
        assert sorted((m["host"], m["rank"]) for m in majority["ranks"]) == [
            ("node-a", 0),
            ("node-a", 1),
        ]
        text = cluster.ctl("incident", merged["id"])
        assert text.returncode == 0, text.stderr
        assert "ranks 2-3 on node-b: in stuck_in_data_loading" in text.stdout, text.stdout
        listed = cluster.ctl("incidents")
        assert "2 nodes" in listed.stdout, listed.stdout
    finally:
        for a in agents:
            a.kill()
