"""The report's pieces on synthetic statistics: the straggler rule, renderers, diff."""

from __future__ import annotations

import json
import random
import re
from typing import Any

from kineto_synth import sync_job_events
from stats_synth import synthetic_session

from profd.pipeline.parsed import ParsedTrace
from profd.pipeline.rankstats import rank_stats
from profd.report.diff import diff_reports, diff_text
from profd.report.html import HEAT_ROWS
from profd.report.model import build_report
from profd.report.renderers import TextRenderer, renderers, report_doc
from profd.report.straggler import RankSteps, find_stragglers


def traced_session(compute: list[list[float]], **kw: Any) -> dict[str, Any]:
    """A session whose statistics the pipeline's own code made from synthetic traces."""
    targets = []
    for r, ev in enumerate(sync_job_events(compute, **kw)):
        st = rank_stats(ParsedTrace.from_events(ev, "t", {}, 30))
        targets.append(
            {"host": "h", "pid": r, "role": "trainer", "rank": r, "results": [{"stats": st}]}
        )
    return {"id": "S", "job": "j", "targets": targets}


def noisy(ranks: int, steps: int, seed: int, slow: int | None = None, extra: float = 0.0):
    rng = random.Random(seed)
    return [
        [3000 + rng.uniform(-600, 600) + (extra if r == slow else 0) for _ in range(steps)]
        for r in range(ranks)
    ]


def stragglers(session: dict[str, Any]) -> list[int]:
    return [s["rank"] for s in report_doc(build_report(session))["stragglers"]]


def test_straggler_is_the_rank_others_wait_for_on_cpu_and_gpu_traces() -> None:
    for gpu in (False, True):
        for seed in range(5):
            s = traced_session(noisy(4, 8, seed, slow=2, extra=6000), gpu=gpu)
            assert stragglers(s) == [2], (gpu, seed)


def test_no_straggler_when_ranks_differ_only_by_noise() -> None:
    for seed in range(20):
        assert stragglers(traced_session(noisy(3, 8, seed))) == [], seed


def test_a_lead_smaller_than_the_noise_is_no_straggler() -> None:
    # Rank 1 computes 300 µs more on average, inside ±600 µs of noise per step.
    for seed in range(10):
        assert stragglers(traced_session(noisy(3, 8, seed, slow=1, extra=300))) == [], seed


def test_rule_edge_cases() -> None:
    one = find_stragglers([RankSteps([1, 1, 1], [9, 9, 9])], 10)
    assert one.stragglers == () and "single rank" in one.reason
    few = find_stragglers([RankSteps([1], [9]), RankSteps([5], [5])], 10)
    assert few.stragglers == () and "fewer than" in few.reason
    two = find_stragglers(
        [RankSteps([1, 1.2, 0.9, 1.1], [9, 8.8, 9.1, 8.9]), RankSteps([6, 6.1, 5.9, 6], [4] * 4)],
        10,
    )
    assert two.stragglers == (0,)
    # Half the ranks or more "ahead" of the median is the job's shape, not a straggler.
    half = [RankSteps([1] * 4, [9] * 4)] * 3 + [RankSteps([6] * 4, [4] * 4)] * 2
    assert find_stragglers(half, 10).stragglers == ()


def test_several_stragglers_among_many_ranks() -> None:
    rows = [RankSteps([20.0 + (k % 3) * 0.5] * 6, [80.0] * 6) for k in range(64)]
    for slow in (5, 40):
        rows[slow] = RankSteps([1.0] * 6, [99.0] * 6)
    assert find_stragglers(rows, 100).stragglers == (5, 40)


def test_renderers_are_deterministic_and_json_has_the_contract_keys() -> None:
    rep = build_report(synthetic_session(16, straggler=3))
    for r in renderers().values():
        assert r.render(rep) == r.render(build_report(synthetic_session(16, straggler=3)))
    doc = json.loads(renderers()["json"].render(rep))
    assert {"session", "steps", "ranks", "stragglers"} <= set(doc)
    assert set(doc["ranks"][0]) >= {"host", "role", "rank", "step_ms", "compute_ms"}
    assert set(doc["ranks"][0]) >= {"collective_ms"}
    assert [(s["rank"], s["host"]) for s in doc["stragglers"]] == [(3, "node0000")]
    assert set(doc["stragglers"][0]) >= {"host", "role", "rank", "why"}
    assert "aten::op03" in doc["stragglers"][0]["why"]


def test_8192_ranks_stay_readable() -> None:
    rep = build_report(synthetic_session(8192, steps=6, straggler=5000))
    assert [s.index for s in rep.stragglers] == [5000]
    page = renderers()["html"].render(rep)
    # The heat maps aggregate: at most HEAT_ROWS rows of cells each, and the page stays small.
    rects_per_map = len(rep.steps) * HEAT_ROWS
    assert page.count("<rect") < 2 * rects_per_map + 200
    assert len(page) < 3_000_000
    assert "trainer r5000 @node0625" in page  # the straggler is named, not averaged away
    assert re.search(r"r4992-r5055", page)  # its group in the heat map
    text = TextRenderer().render(rep)
    assert len(text.splitlines()) < 60 and "straggler: trainer r5000" in text


def test_diff_sorts_by_impact() -> None:
    a = build_report(synthetic_session(8, seed=1))
    b = build_report(synthetic_session(8, seed=1, straggler=None, compute_ms=130.0))
    d = diff_reports(a, b)
    assert d["ops"][0]["name"] == "aten::op00"  # the biggest op grows the most
    deltas = [abs(o["delta_ms"]) for o in d["ops"]]
    assert deltas == sorted(deltas, reverse=True)
    assert d["summary"]["step"]["delta_ms"] > 25
    assert [s["a_step"] for s in d["steps"]] != [] and d["steps"][0]["a_step"] == d["steps"][0][
        "b_step"
    ]


def with_ops(session: dict[str, Any], ops: dict[str, float], ranks: range) -> dict[str, Any]:
    """``session`` whose ``ranks`` list exactly ``ops`` (ms over all steps) as their top."""
    for t in session["targets"]:
        if t["rank"] in ranks:
            st = t["results"][0]["stats"]
            st["ops"] = [[n, 1, ms, 0.0] for n, ms in ops.items()]
    return session


def test_diff_says_not_recorded_instead_of_a_drop_to_zero() -> None:
    # A lists Optimizer.step on every rank; B on 1 of 4 (below the others' top lists), and
    # LogSoftmaxBackward0 appears in B only. Neither is a change to or from 0.
    a = with_ops(synthetic_session(4), {"aten::mm": 50.0, "Optimizer.step#SGD.step": 2.0}, range(4))
    b = with_ops(synthetic_session(4), {"aten::mm": 60.0, "LogSoftmaxBackward0": 2.3}, range(4))
    b = with_ops(
        b, {"aten::mm": 60.0, "LogSoftmaxBackward0": 2.3, "Optimizer.step#SGD.step": 2.1}, range(1)
    )
    d = diff_reports(build_report(a), build_report(b))
    rows = {o["name"]: o for o in d["ops"]}
    opt, soft, mm = rows["Optimizer.step#SGD.step"], rows["LogSoftmaxBackward0"], rows["aten::mm"]
    assert (opt["a_ms"], opt["b_ms"], opt["delta_ms"], opt["not_recorded"]) == (
        0.2,
        None,
        None,
        "b",
    )
    assert (soft["a_ms"], soft["b_ms"], soft["delta_ms"], soft["not_recorded"]) == (
        None,
        0.23,
        None,
        "a",
    )
    assert mm["delta_ms"] == 1.0 and mm["not_recorded"] is None
    text = diff_text(d)
    line = next(ln for ln in text.splitlines() if ln.startswith("Optimizer.step#SGD.step"))
    assert line.split()[1:] == ["0.200", "-", "-", "not", "recorded", "in", "B"], line
    assert "0.000" not in line
    assert "(-: not recorded" in text


def test_diff_knows_a_median_when_most_ranks_list_the_operator() -> None:
    # 3 of 4 ranks list it: the one that does not sits below the median, which is known.
    a = with_ops(synthetic_session(4), {"aten::mm": 50.0, "aten::add": 4.0}, range(4))
    b = with_ops(synthetic_session(4), {"aten::mm": 50.0, "aten::add": 6.0}, range(4))
    b = with_ops(b, {"aten::mm": 50.0}, range(1))
    row = next(
        o for o in diff_reports(build_report(a), build_report(b))["ops"] if o["name"] == "aten::add"
    )
    assert (row["a_ms"], row["b_ms"], row["not_recorded"]) == (0.4, 0.6, None)


def test_text_report_and_diff_keep_a_hostile_operator_name_on_one_line() -> None:
    # An operator name is whatever the traced code called its range: a newline or an escape
    # sequence in it must neither forge a line nor reach the terminal raw; --json stays exact.
    evil = "fake\nstraggler: rank 0\x1b]52;c;aGk=\x07"
    a = with_ops(synthetic_session(4), {"aten::mm": 50.0, evil: 9.0}, range(4))
    b = with_ops(synthetic_session(4), {"aten::mm": 60.0, evil: 9.5}, range(4))
    ra, rb = build_report(a), build_report(b)
    for text in (TextRenderer().render(ra), diff_text(diff_reports(ra, rb))):
        assert "\x1b" not in text and "\x07" not in text
        assert not any(ln.startswith("straggler: rank 0") for ln in text.splitlines()), text
        assert "fake\\x0astraggler: rank 0\\x1b]52;c;aGk=\\x07" in text
    assert evil in {o.name for o in ra.ops}
