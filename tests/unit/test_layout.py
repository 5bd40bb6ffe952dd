"""Where a session's files live, and when a cluster session's manifests are all in S3."""

from __future__ import annotations

from profd.store import layout


def test_a_cluster_session_names_one_manifest_per_node() -> None:
    assert layout.manifest_name(None) == "session.json"
    assert layout.manifest_name("node a/1") == "session.node_a_1.json"
    assert layout.is_manifest("session.json") and layout.is_manifest("session.node-b.json")
    assert not layout.is_manifest("session.json.tmp") and not layout.is_manifest("c0/x.json")


def test_a_cluster_session_is_short_until_every_started_node_uploaded() -> None:
    def m(node: str, nodes: int | None) -> dict[str, object]:
        return {"node": node, "request": {"next": True} | ({"nodes": nodes} if nodes else {})}

    assert layout.missing_manifests([m("a", 3), m("b", 3), m("c", 3)]) is None
    gap = layout.missing_manifests([m("b", 3), m("a", 3)])
    assert gap is not None and gap.startswith("only 2 of 3 nodes' manifests are in S3 (a, b)")
    # A single-node session, or one from a coordinator that did not say: nothing to wait for.
    assert layout.missing_manifests([m("a", None)]) is None
    assert layout.missing_manifests([]) is None
