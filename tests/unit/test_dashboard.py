"""The shipped Grafana dashboard imports as is and asks only for metrics ``/metrics`` has."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from profd.daemon.metrics import FAMILIES, render
from profd.watch.snapshot import RankSeries, Snapshot

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "profd-dashboard.json"
#: Grafana's own variables: every other ``$name`` must be a template variable.
BUILTIN = {"__rate_interval", "__range", "__interval"}


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row holds its panels
    return out


def exprs(doc: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(doc) for t in p.get("targets", [])]


def sample_names() -> set[str]:
    """Every sample name the page has when every family has a sample."""
    full = Snapshot(
        at=0.0,
        ranks=(RankSeries("h", "j", "r", 0, (1,) * 19, 0.1, 1, (("fwd", 0.1),)),),
        sessions=(("pending", 0),),
    )
    page = render(full, 0.0).decode()
    return {s.name for f in text_string_to_metric_families(page) for s in f.samples}


def test_it_imports_as_is() -> None:
    doc = dashboard()
    assert doc["uid"] == "profd-step-ledger" and doc["title"]
    assert 36 <= doc["schemaVersion"] <= 41
    assert "id" not in doc or doc["id"] is None  # an id would clash with the importer's
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["type"] == "query"
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids))
    for p in panels(doc):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        # Every panel follows the data source variable: nothing names a data source uid.
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]


def test_every_query_names_metrics_the_page_has() -> None:
    doc = dashboard()
    have = sample_names()
    variables = {v["name"] for v in doc["templating"]["list"]}
    queries = exprs(doc) + [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    used: set[str] = set()
    for q in queries:
        names = set(re.findall(r"\bprofd_[a-z0-9_]+", q))
        assert names, q
        assert names <= have, (sorted(names - have), q)
        used |= names
        assert set(re.findall(r"\$\{?(\w+)", q)) <= variables | BUILTIN, q
        assert q.count("(") == q.count(")") and q.count("{") == q.count("}"), q
    # And the dashboard shows every family, per-rank and per-daemon.
    shown = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert shown == {name for name, _, _ in FAMILIES}


def test_the_label_job_is_the_training_jobs() -> None:
    """Per-job panels filter on ``job``, the exposed label: the scrape config must keep it
    (``honor_labels``), which docs/operations.md says; daemon-level panels do not filter on
    it, since there ``job`` is the scrape job's."""
    doc = dashboard()
    for q in exprs(doc):
        per_rank = any(
            f in q
            for f in ("profd_step_duration", "profd_steps_total", "profd_region_seconds_total")
        )
        assert ('job=~"$job"' in q) == per_rank, q
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert "honor_labels: true" in ops and "honorLabels: true" in ops
