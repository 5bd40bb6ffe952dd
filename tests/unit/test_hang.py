"""The hang rule and diagnosis (profd.watch.hang_diagnosis) on synthetic data from 2 to 8,192 ranks:
the stall clock's false alarms on steady jittery jobs and its detection latency, the verdict
of grouped stacks, and one job's hang merged across nodes."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import pytest
from test_stackgroups import IN_ALLREDUCE, IN_CHECKPOINT, IN_LOAD, TORCH, fr, rank

from profd.ctl.commands import incidents
from profd.watch import hang_diagnosis as hang
from profd.watch.incident_record import seen_by
from profd.watch.stackrows import Frame, Member, StackRank, to_maps


def test_stall_after_is_the_config_else_the_larger_of_60s_and_20_steps() -> None:
    assert hang.stall_limit(None, None) == 60.0
    assert hang.stall_limit(None, 0.5) == 60.0
    assert hang.stall_limit(None, 4.0) == 80.0
    assert hang.stall_limit(7.5, 4.0) == 7.5


def _run(
    clock: hang.StallClock, n: int, ticks: int, step_s: float, rng: random.Random, t0: float = 0.0
) -> tuple[float, float]:
    """A lockstep job of ``n`` ranks, steps of ``step_s`` ± 10 %, heartbeats at 1 Hz for
    ``ticks`` seconds: the longest quiet time seen and the last limit."""
    steps = [0] * n
    due = [step_s * rng.uniform(0.9, 1.1)] * n
    worst, limit = 0.0, 0.0
    for t in range(1, ticks + 1):
        now = t0 + t
        for i in range(n):
            while due[i] <= now:
                steps[i] += 1
                due[i] += step_s * rng.uniform(0.9, 1.1)
        quiet = clock.observe(now, ((i, steps[i], 1.0 / step_s) for i in range(n)))
        limit = hang.stall_limit(None, clock.step_s)
        if quiet is not None:
            worst = max(worst, quiet)
    return worst, limit


@pytest.mark.parametrize(("n", "steps"), [(2, 10_000), (64, 10_000), (1024, 2_000), (8192, 300)])
def test_a_steady_jittery_job_never_stalls(n: int, steps: int) -> None:
    # Steps of 1 s ± 10 %, one heartbeat tick a step: 10,000 steps up to 64 ranks, fewer
    # above (the rule is per job: its cost, not its outcome, grows with the ranks).
    worst, limit = _run(hang.StallClock(), n, steps, 1.0, random.Random(n))
    assert limit == 60.0
    assert worst <= 2.0  # the gap between two heartbeats, never near the limit
    false_alarms = int(worst >= limit)
    assert false_alarms == 0


def test_long_steps_raise_the_limit_so_a_slow_job_is_not_a_hang() -> None:
    # 8 s steps: the limit is 20 of them, and the quiet between steps stays far below.
    worst, limit = _run(hang.StallClock(), 8, 2_000, 8.0, random.Random(1))
    assert limit == pytest.approx(160.0, rel=0.01)
    assert worst < 10.0


@pytest.mark.parametrize("n", [2, 8, 1024, 8192])
def test_a_job_that_stops_is_stalled_one_heartbeat_after_the_limit(n: int) -> None:
    clock = hang.StallClock()
    _run(clock, n, 30, 0.2, random.Random(2))
    stopped = {i: clock.ranks[i].step for i in range(n)}
    at = None
    for t in range(31, 200):
        quiet = clock.observe(float(t), ((i, stopped[i], 0.0) for i in range(n)))
        assert quiet is not None
        if quiet >= hang.stall_limit(None, clock.step_s):
            at = t
            break
    assert at is not None and 30 + 60 <= at <= 30 + 60 + 1


def test_one_rank_still_stepping_keeps_the_job_alive() -> None:
    clock = hang.StallClock()
    assert clock.observe(1.0, [("a", 1, 0.0), ("b", 1, 1.0)]) is None  # none seen stepping
    for t in range(2, 200):
        quiet = clock.observe(float(t), [("a", min(t, 5), 0.0), ("b", t, 1.0)])
        assert quiet == 0.0


def test_a_job_never_seen_stepping_is_not_judged_and_a_late_rank_counts_from_its_attach() -> None:
    clock = hang.StallClock()
    for t in range(1, 300):
        assert clock.observe(float(t), [("a", 0, 0.0), ("b", 0, 0.0)]) is None
    clock.observe(300.0, [("a", 1, 0.0), ("b", 0, 0.0)])
    assert clock.observe(310.0, [("a", 1, 0.0), ("b", 0, 0.0)]) == 10.0
    # A rank attaching now: the job's quiet time starts again from it.
    assert clock.observe(311.0, [("a", 1, 0.0), ("b", 0, 0.0), ("c", 0, 0.0)]) == 0.0
    # A restart (its step counted from 1 again) is a change of step, not a stall.
    assert clock.observe(320.0, [("a", 1, 0.0), ("b", 1, 0.0), ("c", 0, 0.0)]) == 0.0
    # A rank gone is forgotten.
    clock.observe(321.0, [("a", 1, 0.0)])
    assert list(clock.ranks) == ["a"]


def test_ranks_that_gave_no_stacks_are_said_and_never_make_the_others_look_uniform() -> None:
    lone = hang.diagnose([rank(0, None), rank(1, IN_LOAD), rank(2, None)])
    assert lone.suspects == ()
    assert lone.verdict == (
        "rank 1 in load_batch (data.py:88) -> read; ranks 0, 2 gave no stacks:"
        " no majority to compare with"
    )
    two = hang.diagnose(
        [rank(0, IN_ALLREDUCE), rank(1, IN_LOAD), rank(2, None), rank(3, IN_ALLREDUCE)]
    )
    assert [m.rank for m in two.suspects] == [1]
    assert two.verdict.endswith("; rank 2 gave no stacks")


def _ids(members: Sequence[dict[str, Any] | Member]) -> list[int]:
    return [m.rank if isinstance(m, Member) else int(m["rank"]) for m in members]


@pytest.mark.parametrize("n", [2, 3, 64, 1024, 8192])
def test_diagnose_names_the_one_rank_elsewhere(n: int) -> None:
    odd = n // 2
    found = hang.diagnose([rank(i, IN_LOAD if i == odd else IN_ALLREDUCE) for i in range(n)])
    assert _ids(found.suspects) == [odd]
    assert _ids(found.groups[0].ranks) == [i for i in range(n) if i != odd]
    assert found.groups[1].where == "in load_batch (data.py:88) -> read"
    assert found.verdict.startswith(f"rank {odd} in load_batch (data.py:88)")
    # Only the training thread is kept, and at most KEEP_FRAMES of it.
    assert all(len(r.threads) == 1 and r.threads[0].training for r in found.ranks)


def test_diagnose_keeps_only_the_innermost_frames() -> None:
    deep = [Frame(f"f{i}", "/job/train.py", i) for i in range(500)]
    (r,) = hang.diagnose([rank(0, deep)]).ranks
    assert [f.function for f in r.threads[0].frames] == [f"f{i}" for i in range(hang.KEEP_FRAMES)]


def test_native_frames_are_kept_beside_the_python_ones_and_do_not_split_groups() -> None:
    native = [Frame(f"sre_{i}", "/lib/libpython3.11.so", 0, native=True) for i in range(40)]
    a = hang.diagnose([rank(0, [*native, *IN_LOAD]), rank(1, [*native[1:], *IN_LOAD])])
    assert len(a.groups) == 1  # the native frames differ, the Python ones do not
    kept = a.ranks[0].threads[0].frames
    assert sum(1 for f in kept if f.native) == hang.KEEP_NATIVE
    assert [f.function for f in kept if not f.native] == [f.function for f in IN_LOAD]


def test_diagnose_uniform_ranks_say_why_there_is_no_suspect() -> None:
    paused = hang.diagnose([rank(i, IN_CHECKPOINT) for i in range(8)])
    assert paused.suspects == () and "paused on purpose" in paused.verdict
    waiting = hang.diagnose([rank(i, IN_ALLREDUCE) for i in range(8)])
    assert waiting.suspects == () and "another node" in waiting.verdict
    unread = hang.diagnose([rank(i, None) for i in range(2)])
    assert unread.suspects == () and unread.groups == ()
    assert unread.verdict.startswith("no rank's stacks could be read: ")


#: The training thread ending an nsys capture range: the step hook, the client's
#: NsysRange.finish, torch's profiler stop (cudaProfilerStop, native below it).
IN_NSYS_STOP = [
    Frame("cudaProfilerStop", "/usr/lib/libcudart.so.13", 0, native=True),
    fr("stop", "/opt/venv/lib/python3.12/site-packages/torch/cuda/profiler.py", 67),
    fr("NsysRange.finish", "/opt/venv/lib/python3.12/site-packages/profd_client/nsysrange.py", 57),
    fr("StepCounter._advance", "/opt/venv/lib/python3.12/site-packages/profd_client/steps.py", 385),
    fr("Optimizer.profile_hook_step.<locals>.wrapper", TORCH, 487),
    fr("<module>", "/home/u/job/cudajob.py", 84),
]


def test_uniform_ranks_inside_cudaprofilerstop_are_named_nsys_flushing_not_a_pause() -> None:
    for frames in (IN_NSYS_STOP, [f for f in IN_NSYS_STOP if not f.native]):
        found = hang.diagnose([rank(i, frames) for i in range(2)])
        assert found.suspects == ()
        v = found.verdict
        assert "inside cudaProfilerStop while nsys flushes" in v, v
        assert "paused on purpose" not in v and "cudajob.py:84" in v
    # Waiting in the CUDA sync before the stop is the GPU's work, not nsys's flush.
    syncing = [
        fr("synchronize", "/opt/venv/lib/python3.12/site-packages/torch/cuda/__init__.py", 985),
        fr(
            "NsysRange._sync",
            "/opt/venv/lib/python3.12/site-packages/profd_client/nsysrange.py",
            87,
        ),
        *IN_NSYS_STOP[2:],
    ]
    assert "cudaProfilerStop" not in hang.diagnose([rank(0, syncing)]).verdict
    # The same torch call outside profd's nsys range (the job's own) is not named so.
    own = [IN_NSYS_STOP[1], fr("profile_window", "/home/u/job/cudajob.py", 70)]
    assert "paused on purpose" in hang.diagnose([rank(0, own)]).verdict


def _incident(host: str, ranks: list[StackRank], at: float, **kw: Any) -> dict[str, Any]:
    found = hang.diagnose(ranks)
    doc = {
        "id": f"{int(at)}-hang-{host}",
        "kind": "hang",
        "job": "j",
        "role": "trainer",
        "host": host,
        "suspects": to_maps(found.suspects),
        "detected_at": at,
        "step": 30,
        "evidence": {"stalled_s": 3.5, **found.evidence()},
        "session": None,
        "state": kw.get("state", "open"),
        "resolved_at": kw.get("resolved_at"),
        "comparison": None,
        "notes": [],
    }
    # As the index holds it, and as profctl gets it: JSON.
    out: dict[str, Any] = json.loads(json.dumps(doc))
    return out


@pytest.mark.parametrize("nodes", [2, 16, 1024])
def test_a_node_uniform_alone_stands_out_once_merged(nodes: int) -> None:
    odd = nodes - 1
    incs = [
        _incident(
            f"n{k}",
            [
                rank(8 * k + i, IN_LOAD if k == odd else IN_ALLREDUCE, host=f"n{k}")
                for i in range(8)
            ],
            1000.0 + k * 0.01,
        )
        for k in range(nodes)
    ]
    assert all(i["suspects"] == [] for i in incs)  # each node alone looks uniform
    (one,) = hang.merged(incs)
    assert one["hosts"] == sorted(f"n{k}" for k in range(nodes))
    assert len(one["merged"]) == nodes and one["evidence"]["nodes"] == nodes
    assert {s["host"] for s in one["suspects"]} == {f"n{odd}"}
    assert _ids(one["suspects"]) == list(range(8 * odd, 8 * odd + 8))
    assert one["state"] == "open"


def test_hangs_far_apart_are_not_merged_and_other_kinds_pass_through() -> None:
    a = _incident("a", [rank(0, IN_LOAD, host="a")], 1000.0, state="resolved", resolved_at=1010.0)
    b = _incident("b", [rank(1, IN_ALLREDUCE, host="b")], 1000.0 + 2 * hang.MERGE_S)
    other = {**a, "id": "x", "kind": "slow_rank"}
    out = hang.merged([a, b, other])
    assert sorted(i["id"] for i in out) == sorted([a["id"], b["id"], "x"])
    assert hang.merged_with(b, [a, b]) is b
    c = _incident(
        "c", [rank(2, IN_ALLREDUCE, host="c")], 1000.0 + 5, state="resolved", resolved_at=1020.0
    )
    both = hang.merged_with(a, [a, b, c])
    assert both["merged"] == [a["id"], c["id"]] and both["state"] == "resolved"
    assert both["resolved_at"] == 1020.0 and _ids(both["suspects"]) == [0]


def test_a_merge_with_a_nodes_stacks_withheld_keeps_each_nodes_suspects_and_says_so() -> None:
    # Node b's incident as another user gets it (incident.seen_by): no ranks, no groups.
    a = _incident("a", [rank(i, IN_ALLREDUCE, host="a") for i in range(4)], 1000.0)
    b = _incident("b", [rank(4 + i, IN_LOAD if i == 0 else IN_ALLREDUCE, host="b")
                        for i in range(4)], 1000.5)  # fmt: skip
    b["owner"] = a["owner"] = 1001
    theirs = [seen_by(i, 7, False) for i in (a, b)]
    assert all("ranks" not in i["evidence"] and i["evidence"]["withheld"] for i in theirs)
    (one,) = hang.merged(theirs)
    assert one["evidence"]["verdict"].startswith("stacks withheld:")
    assert one["evidence"]["withheld"] is True
    assert _ids(one["suspects"]) == [4] and "load_batch" not in str(one)
    # A daemon before the flag withheld the same way, without it: told apart all the same.
    for i in theirs:
        del i["evidence"]["withheld"]
    (older,) = hang.merged(theirs)
    assert older == one


def test_a_verdict_that_reads_like_a_withheld_one_is_not_taken_for_it() -> None:
    # The job's own code can put any text in a verdict's frames; only the flag (or, from an
    # older daemon, stacks gone from the evidence) says the stacks were withheld.
    a = _incident("a", [rank(i, IN_ALLREDUCE, host="a") for i in range(4)], 1000.0)
    b = _incident("b", [rank(4 + i, IN_LOAD if i == 0 else IN_ALLREDUCE, host="b")
                        for i in range(4)], 1000.5)  # fmt: skip
    b["evidence"]["verdict"] = "stacks withheld: not really"
    (one,) = hang.merged([a, b])
    assert "withheld" not in one["evidence"]
    assert not one["evidence"]["verdict"].startswith("stacks withheld:")


def test_a_merge_leaves_out_stored_rows_that_are_not_rank_rows_and_counts_them() -> None:
    # A lying peer's (or a damaged record's) evidence: one map without a role, one not a
    # map; the other node's ranks and its good rows are grouped, and the count said.
    a = _incident("a", [rank(i, IN_ALLREDUCE, host="a") for i in range(4)], 1000.0)
    b = _incident("b", [rank(4 + i, IN_LOAD if i == 0 else IN_ALLREDUCE, host="b")
                        for i in range(4)], 1000.5)  # fmt: skip
    del b["evidence"]["ranks"][1]["role"]
    b["evidence"]["ranks"].append("not a rank")
    (one,) = hang.merged([a, b])
    assert one["evidence"]["ranks_unread"] == 2
    assert len(one["evidence"]["ranks"]) == 7 and _ids(one["suspects"]) == [4]
    said = incidents.text({**one, "hosts": ["a", "b"]})
    assert "2 stored rank rows did not read as rank rows: left out above" in said
    b2 = _incident("b", [rank(4, IN_LOAD, host="b")], 1000.5)
    assert "ranks_unread" not in hang.merged([a, b2])[0]["evidence"]
