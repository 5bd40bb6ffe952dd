"""The incident kinds' registry (profd.watch.kinds): every place that names kinds reads them
there, and each kind's module is listed in it."""

from __future__ import annotations

import importlib
import pkgutil

import click

import profd.watch.kinds
from profd.ctl.commands.incidents import incidents as incidents_command
from profd.daemon import metrics
from profd.daemon.watch.incident_store import describe
from profd.daemon.watch.sinks import IncidentCounts
from profd.watch.incident_record import Incident, Suspect
from profd.watch.kinds import registry as kinds


def _incident(kind: str, suspects: list[Suspect], evidence: dict[str, object]) -> Incident:
    return Incident(
        id=f"20261126-000000-{kind}-abcdef",
        kind=kind,
        job="train",
        role="worker",
        host="n1",
        suspects=suspects,
        detected_at=1_800_000_000.0,
        step=42,
        evidence=dict(evidence),
        session="sess-1",
    )


def test_every_kind_module_is_listed_once_with_a_unique_name_and_label() -> None:
    modules = {
        m.name
        for m in pkgutil.iter_modules(profd.watch.kinds.__path__)
        if m.name not in ("kind", "registry")
    }
    listed = [importlib.import_module(f"profd.watch.kinds.{m}").KIND for m in sorted(modules)]
    assert sorted(listed, key=lambda k: k.name) == sorted(kinds.ALL, key=lambda k: k.name)
    assert len(set(kinds.names())) == len(kinds.ALL) == len(set(kinds.labels()))
    assert kinds.names() == ("regression", "slow_rank", "straggler", "hang", "spike")


def test_profctl_choices_and_metric_labels_come_from_the_registry() -> None:
    (kind_opt,) = [p for p in incidents_command.params if p.name == "kind"]
    assert isinstance(kind_opt.type, click.Choice)
    assert tuple(kind_opt.type.choices) == kinds.names()
    assert kinds.labels() == metrics.INCIDENT_KINDS
    counts = IncidentCounts()
    counts.save(_incident("hang", [], {}), new=True)
    counts.save(_incident("hang", [], {}), new=False)  # saved again: not a new one
    assert counts.published() == tuple((k.label, int(k.name == "hang")) for k in kinds.ALL)


def test_describe_is_each_kinds_text_then_the_step_and_capture() -> None:
    slow = [Suspect("n1", "worker", 3)]
    cases = {
        "regression": (
            [],
            {"window_ms": 120.0, "baseline_ms": 100.0, "ratio": 1.2},
            "job train slowed down: step 120.0 ms against 100.0 ms before (+20%)",
        ),
        "slow_rank": (
            slow,
            {"step_ms": 140.0, "peers_ms": 100.0, "ratio": 1.4},
            "job train: worker rank 3 on n1 steps in 140.0 ms against 100.0 ms of its role (+40%)",
        ),
        "straggler": (slow, {}, "straggler in job train: worker rank 3 on n1"),
        "hang": (
            slow,
            {"stalled_s": 61.2, "ranks_here": 4, "verdict": "rank 3 in secret_fn"},
            "job train stalled for 61s, 4 rank(s) here; suspects: worker rank 3 on n1",
        ),
        "spike": (
            slow,
            {"step_ms": 5012.0, "median_ms": 101.0},
            "job train: a step of 5.0 s against a median of 101.0 ms on worker rank 3 on n1",
        ),
    }
    assert set(cases) == set(kinds.names())
    for name, (suspects, evidence, text) in cases.items():
        inc = _incident(name, suspects, evidence)
        kind = kinds.get(name)
        assert kind is not None
        who = ", ".join(f"{s.role} rank {s.rank} on {s.host}" for s in suspects)
        assert kind.text(inc, who) == text
        assert describe(inc) == f"{text} at step 42; capture sess-1"
    # A kind this version does not know (a newer daemon's, in the index) is still described.
    assert describe(_incident("oom", slow, {})).startswith("oom in job train: worker rank 3")


def test_capture_and_scope_flags() -> None:
    assert [k.name for k in kinds.ALL if k.job_wide] == ["regression", "hang", "spike"]
    assert [k.name for k in kinds.ALL if not k.captures] == ["hang", "spike"]
    oom = kinds.known("oom")
    assert not (oom.job_wide or oom.captures or oom.job_changed or oom.suspects_from_blackbox)
    assert oom.tick_rule is None and kinds.get("oom") is None
