"""What the CPU operator tables count: the user's operators, nothing of profd's.

On synthetic kineto traces laid out as torch writes them with ``with_stack`` for a job
attached to profd (``kineto_synth.with_stack_job_events``): profd's agent thread and frames,
Python frames around every operator, addresses in names, gloo's collective on two threads.
Each test checks one property in the per-trace tables (``ParsedTrace``), the per-rank
statistics (``rank_stats``) and the report built from them, where it shows.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from kineto_synth import PROFD_FRAMES, with_stack_job_events

from profd.pipeline.ops import OpStat, is_profd_frame, strip_addresses
from profd.pipeline.parsed import ParsedTrace
from profd.pipeline.rankstats import rank_stats
from profd.pipeline.summary import Summary
from profd.report.model import OPS_NOTE, build_report, ops_over_step
from profd.report.renderers import renderers

COMPUTE = [[1000.0, 1100.0, 1000.0, 1200.0], [3000.0, 3100.0, 2900.0, 3000.0]]
# Not the user's: profd's frames, what runs inside them, its thread's bootstrap.
NOT_USERS = re.compile(r"profd_client|zmq/|msgpack/|threading\.py|_record_function_enter_new")


def parsed(events: list[dict[str, Any]]) -> ParsedTrace:
    return ParsedTrace.from_events(events, "t", {"session": "S"}, 50)


def session(per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    targets = [
        {
            "host": "h",
            "pid": r,
            "role": "main",
            "rank": r,
            "results": [{"stats": rank_stats(parsed(ev))}],
        }
        for r, ev in enumerate(per_rank)
    ]
    return {"id": "S", "job": "j", "targets": targets}


def x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def by_name(rows: Any) -> dict[str, OpStat]:
    return {o.name: o for o in rows}


# --- (a) profd's threads and frames -------------------------------------------------------------
def test_profd_threads_and_frames_never_appear() -> None:
    for ev in with_stack_job_events(COMPUTE):
        p = parsed(ev)
        names = [o.name for o in (*p.cpu_ops, *p.call_sites)]
        assert names and not [n for n in names if NOT_USERS.search(n)], names
        # The op profd's step hook runs is profd's; the user's region opened inside profd's
        # frame is the user's.
        ops = by_name(p.cpu_ops)
        assert "aten::empty" not in ops and "forward" in ops
        summary = Summary().render(p)
        assert not NOT_USERS.search(summary), summary
        st = rank_stats(p)
        assert not [o for o in st["ops"] if NOT_USERS.search(o[0])]
    # The synthetic job does have them: the test would see them if they leaked.
    raw = {e["name"] for e in with_stack_job_events(COMPUTE)[0]}
    assert set(PROFD_FRAMES) <= raw and "zmq/sugar/poll.py(80): poll" in raw


def test_profd_frames_are_recognised_by_package_not_by_word() -> None:
    assert is_profd_frame("profd_client/steps.py(239): _advance")
    assert is_profd_frame("/opt/venv/lib/python3.12/site-packages/profd_client/agent.py(9): run")
    assert not is_profd_frame("my_profd_client/steps.py(1): f")
    assert not is_profd_frame("train.py(3): profd_client")
    # A user's thread that calls profd_client (a region on a worker thread) stays: only
    # profd's own frames go.
    events = [
        x("threading.py(1002): _bootstrap", 0, 1000, tid=7, cat="python_function"),
        x("worker.py(5): loop", 10, 900, tid=7, cat="python_function"),
        x("profd_client/capture.py(249): enter", 20, 10, tid=7, cat="python_function"),
        x("aten::add", 100, 50, tid=7),
    ]
    p = parsed(events)
    assert [o.name for o in p.cpu_ops] == ["aten::add"]
    assert "worker.py(5): loop" in by_name(p.call_sites)


# --- (b) Python frames are call sites -----------------------------------------------------------
def test_python_frames_are_call_sites_and_leave_operator_times_alone() -> None:
    for ev in with_stack_job_events(COMPUTE):
        with_stack = parsed(ev)
        without = parsed([e for e in ev if e["cat"] != "python_function"])
        # The same operators, to the float: only profd's op needs the frames to be told apart.
        assert list(with_stack.cpu_ops) == [o for o in without.cpu_ops if o.name != "aten::empty"]
        assert not [o for o in with_stack.cpu_ops if re.search(r"\.py\(\d+\)|^<built-in", o.name)]
        sites = by_name(with_stack.call_sites)
        assert {"train.py(30): step", "<built-in method mm of type object>"} <= set(sites)
        assert not without.call_sites
        summary = Summary().render(with_stack)
        ops_part, sites_part = summary.split("## Python call sites (--with-stack)")
        assert "train.py(30): step" in sites_part and "train.py" not in ops_part


# --- (c) addresses ------------------------------------------------------------------------------
def test_addresses_are_stripped_so_one_operator_is_one_row() -> None:
    assert (
        strip_addresses("<built-in method run_backward of torch._C._EngineBase object at 0x7f39ab>")
        == "<built-in method run_backward of torch._C._EngineBase object>"
    )
    assert strip_addresses("hook 0x7f39a1b2c3d0 done") == "hook 0x… done"
    assert strip_addresses("aten::view(0x1)") == "aten::view(0x1)"  # no address
    # One call site whatever object it was called on, in one trace ...
    ev = with_stack_job_events(COMPUTE)
    sites = by_name(parsed(ev[0]).call_sites)
    assert sites["<built-in method mm of type object>"].calls == len(COMPUTE[0])
    # ... and one operator row across ranks, whose addresses differ.
    for r, events in enumerate(ev):
        events.append(x(f"my_hook <function f at 0x7f{r}0aa0e110>", 1_999_000, 30, tid=100 + r))
        events[-1]["pid"] = 100 + r
    report = build_report(session(ev))
    rows = [o for o in report.ops if o.name.startswith("my_hook")]
    assert [o.name for o in rows] == ["my_hook <function f>"]
    assert rows[0].min_ms > 0
    text = renderers()["text"].render(report) + renderers()["html"].render(report)
    assert not re.search(r"0x[0-9a-f]{6,}", text)


# --- (d) wall-clock time ------------------------------------------------------------------------
def test_an_operator_on_several_threads_at_once_counts_its_wall_clock_time() -> None:
    ev = with_stack_job_events(COMPUTE)
    p = parsed(ev[0])
    steps_us = sum(ms for _, ms in p.steps.durations_ms) * 1000
    gloo = by_name(p.cpu_ops)["gloo:all_reduce"]
    summed = sum(e["dur"] for e in ev[0] if e["name"] == "gloo:all_reduce")
    assert summed > steps_us  # two threads at once: the sum would exceed the steps
    waits = [
        e["dur"] for e in ev[0] if e["name"] == "gloo:all_reduce" and e["tid"] == 900
    ]  # one thread's calls: the wall-clock time
    assert gloo.calls == 2 * len(COMPUTE[0])
    assert gloo.self_us == pytest.approx(sum(waits)) and gloo.total_us == gloo.self_us
    st = rank_stats(p)
    assert dict((c[0], c[2]) for c in st["collectives"])["gloo:all_reduce"] == pytest.approx(
        sum(waits) / 1000, abs=0.001
    )
    report = build_report(session(ev))
    assert report.ops and ops_over_step(report) == []
    for o in report.ops:
        assert o.median_ms <= report.median_step_ms, (o, report.median_step_ms)
    assert OPS_NOTE in renderers()["text"].render(report)


def test_self_time_of_overlapping_calls_is_the_union_of_their_own_segments() -> None:
    events = [
        x("ProfilerStep#1", 0, 200, cat="user_annotation"),
        x("X", 0, 100, tid=1),
        x("Y", 20, 20, tid=1),  # a child: not X's self time on thread 1
        x("X", 30, 100, tid=2),  # overlaps thread 1's X, and covers its child
        x("X", 10, 40, tid=1),  # recursion: inside thread 1's first X
        x("Z", 0, 50, tid=3),
        x("Z", 100, 50, tid=4),  # on another thread, at another time: a plain sum
    ]
    ops = by_name(parsed(events).cpu_ops)
    # Thread 1: X's own time 0-20 and 40-100 (the inner X's own 10-20 and 40-50 included);
    # thread 2: 30-130. The union: 0-20 and 30-130.
    assert ops["X"].self_us == pytest.approx(120)
    assert ops["X"].total_us == pytest.approx(130)
    assert ops["X"].calls == 3
    assert ops["Z"].self_us == ops["Z"].total_us == 100
    one_thread = by_name(parsed([x("A", 0, 100), x("A", 10, 40), x("B", 20, 10)]).cpu_ops)
    assert one_thread["A"].self_us == pytest.approx(90) and one_thread["A"].total_us == 100


def test_a_report_says_why_an_operator_exceeds_the_step() -> None:
    # An operator that runs outside the profiled steps too: more per step than the step.
    per_rank = []
    for r in range(2):
        ev = [
            x("ProfilerStep#1", 1000, 100, cat="user_annotation"),
            x("ProfilerStep#2", 1100, 100, cat="user_annotation"),
            x("aten::copy_", 0, 900),  # before the first step
            x("aten::copy_", 1010, 150),
        ]
        for e in ev:
            e["pid"] = e["tid"] = r
        per_rank.append(ev)
    report = build_report(session(per_rank))
    (over,) = ops_over_step(report)
    assert over.name == "aten::copy_" and over.median_ms > report.median_step_ms
    for kind in ("text", "html"):
        assert "outside the profiled steps" in renderers()[kind].render(report)
