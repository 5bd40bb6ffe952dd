"""A Hugging Face ``Trainer`` job under torchrun with the two profd lines (it must
behave as before identity came from the job itself).

``tests/jobs/hf_trainer.py`` trains a tiny GPT-2 made from a config on in-memory data (no hub:
``HF_HUB_OFFLINE=1``) with gradient accumulation 2. ``ps`` must list its two ranks in one job,
a capture of explicit steps must hold exactly those ``ProfilerStep`` markers on both ranks,
and each profiled step exactly one optimizer step: profd's step is the optimizer step, not
the Trainer's micro-batch.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon
from test_captures import by_rank, open_gate_when_armed, step_markers, traces, wait_session
from test_identity import one_job

pytestmark = pytest.mark.slow


def optimizer_steps_per_step(trace: Path) -> dict[int, int]:
    """For each ``ProfilerStep#N`` span, how many ``Optimizer.step#...`` spans begin in it.

    By where they begin: the optimizer step that ends step N runs the hook that ends
    ``ProfilerStep#N``, so that span closes inside it, and the previous step's optimizer span
    began before ``ProfilerStep#N`` did."""
    with gzip.open(trace, "rt", encoding="utf-8") as fh:
        spans = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    steps = {
        int(e["name"].split("#", 1)[1]): (e["ts"], e["ts"] + e["dur"])
        for e in spans
        if str(e.get("name", "")).startswith("ProfilerStep#")
    }
    begins = [e["ts"] for e in spans if str(e.get("name", "")).startswith("Optimizer.step#")]
    return {n: sum(a <= ts < b for ts in begins) for n, (a, b) in steps.items()}


def test_hf_trainer_under_torchrun(daemon: Daemon, torchrun: Any, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    gate = tmp_path / "go"
    job = torchrun(
        "hf_trainer.py",
        daemon=daemon,
        GATE=str(gate),
        STEPS="6",
        OUT=str(tmp_path / "hf-out"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONFAULTHANDLER="1",  # a crash inside torch shows up in the log with a stack
    )
    rows = one_job(daemon, 2)
    for r in rows:
        # torchrun names the job: the same source as before the job's own identity counted.
        assert r["identity_source"]["job"] == "env:TORCHELASTIC_RUN_ID", r

    res = daemon.ctl_json("start", "--job", rows[0]["job"], "--steps", "3:5")
    assert res["steps"] == [3, 4] and len(res["targets"]) == 2, res
    open_gate_when_armed(daemon, gate, res["session"])
    s = wait_session(daemon, res["session"])
    assert s["state"] == "done", s
    traced = by_rank(traces(daemon, "--session", res["session"]))
    assert sorted(traced) == [0, 1]
    for r in (0, 1):
        trace = Path(traced[r]["path"])
        assert step_markers(trace) == [3, 4], traced[r]
        # Two micro-batches per step, one optimizer step: never 0 or 2.
        assert optimizer_steps_per_step(trace) == {3: 1, 4: 1}, traced[r]

    assert job.wait() == 0, job.output()
    res_rows = sorted(job.results(), key=lambda x: x["rank"])
    assert [(x["rank"], x["world_size"], x["profd_rank"]) for x in res_rows] == [
        (0, 2, 0),
        (1, 2, 1),
    ]
    # profd counted the Trainer's optimizer steps, not its forward/backward passes.
    assert all(x["steps"] == x["global_step"] == 6 for x in res_rows), res_rows
