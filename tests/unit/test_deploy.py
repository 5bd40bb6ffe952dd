"""The shipped deployment files agree with the code that reads them.

Nothing here needs a cluster: the Kubernetes manifest is parsed, its profd.toml is loaded by
profd's own config loader, and every path that file names must be where the DaemonSet mounts
it; the example pod must mount the runtime dir the daemon uses.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from profd.config import load

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kubernetes" / "profd.yaml"


def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


def mounted(container: dict[str, Any], path: str) -> str:
    """The volume name mounted at or above ``path``."""
    best = max(
        (
            m
            for m in container["volumeMounts"]
            if PurePosixPath(path).is_relative_to(m["mountPath"])
        ),
        key=lambda m: len(m["mountPath"]),
    )
    name: str = best["name"]
    return name


def test_the_daemonset_mounts_every_path_its_config_names(tmp_path: Path) -> None:
    d = docs()
    toml = tmp_path / "profd.toml"
    toml.write_text(d["ConfigMap"]["data"]["profd.toml"])
    cfg = load(toml, env={})
    spec = d["DaemonSet"]["spec"]["template"]["spec"]
    [c] = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert c["command"][-1] == "/etc/profd/profd.toml" and mounted(c, str(c["command"][-1]))

    assert cfg.cluster.listen is not None and cfg.cluster.listen.endswith(":7717")
    assert {"containerPort": 7717, "name": "control", "protocol": "TCP"} in c["ports"]
    assert spec["hostNetwork"] is True and spec["hostPID"] is True

    key = volumes[mounted(c, str(cfg.cluster.server_key))]
    # The daemon refuses a secret key file others can read: the Secret must not be 0644.
    assert key["secret"]["defaultMode"] & 0o077 == 0, oct(key["secret"]["defaultMode"])
    assert "configMap" in volumes[mounted(c, str(cfg.cluster.authorized_keys))]

    runtime = volumes[mounted(c, str(cfg.runtime_dir))]
    assert runtime["hostPath"]["path"] == str(cfg.runtime_dir) == "/run/profd"
    assert "hostPath" in volumes[mounted(c, str(cfg.state_dir))]


def test_a_training_pod_sees_the_daemons_runtime_dir() -> None:
    d = docs()
    ds = d["DaemonSet"]["spec"]["template"]["spec"]
    pod = d["Pod"]["spec"]
    [trainer] = pod["containers"]
    name = mounted(trainer, "/run/profd/agent.sock")
    theirs = {v["name"]: v for v in pod["volumes"]}[name]["hostPath"]["path"]
    ours = {v["name"]: v for v in ds["volumes"]}["runtime"]["hostPath"]["path"]
    # Where the client looks first (/run/profd) is the node's dir the daemon binds in.
    assert theirs == ours == "/run/profd"


def test_prometheus_finds_the_metrics_port_the_config_opens(tmp_path: Path) -> None:
    d = docs()
    toml = tmp_path / "profd.toml"
    toml.write_text(d["ConfigMap"]["data"]["profd.toml"])
    cfg = load(toml, env={})
    template = d["DaemonSet"]["spec"]["template"]
    [c] = template["spec"]["containers"]
    assert cfg.metrics.host == "0.0.0.0"
    assert {"containerPort": cfg.metrics.port, "name": "metrics", "protocol": "TCP"} in c["ports"]
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(cfg.metrics.port)
    assert notes["prometheus.io/path"] == "/metrics"

    monitor = {
        m["kind"]: m
        for m in yaml.safe_load_all((MANIFEST.parent / "servicemonitor.yaml").read_text())
        if m
    }
    svc, sm = monitor["Service"], monitor["ServiceMonitor"]
    pod_labels = template["metadata"]["labels"]
    assert svc["metadata"]["namespace"] == sm["metadata"]["namespace"] == "profd"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    [port] = svc["spec"]["ports"]
    assert port["targetPort"] == "metrics" and port["port"] == cfg.metrics.port
    [endpoint] = sm["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    # The training job's `job` label survives the scrape (not renamed exported_job).
    assert endpoint["honorLabels"] is True
