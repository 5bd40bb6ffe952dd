"""Where a session's files live, and when a cluster session's manifests are all in S3."""

from __future__ import annotations

from profd.store import layout
from profd_client import protocol as P


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


def test_final_files_have_one_path_below_the_spool_and_the_s3_prefix() -> None:
    assert layout.session_parts("train", "s1") == ("train", "s1")
    assert layout.session_key("train", "s1") == "train/s1"
    assert layout.cycle_parts("train", "s1", 3) == ("train", "s1", "c3")
    assert layout.manifest_parts("train", "s1") == ("train", "s1", "session.json")
    assert layout.manifest_key("train", "s1") == "train/s1/session.json"
    # A cluster session's manifest is the node's own, its name made safe for a path.
    assert layout.manifest_key("train", "s1", "node a/1") == "train/s1/session.node_a_1.json"
    assert layout.key(("a", "b", "c")) == "a/b/c"


def test_processes_write_raw_files_into_their_own_dir_per_revision() -> None:
    me = P.target_dir("host-a", 42)
    assert layout.incoming_parts("train", "s1") == (".incoming", "train", "s1")
    # A re-planned revision's files are kept apart from the stale ones of revision 0; the
    # directory keeps its on-disk name.
    assert layout.revision_dir(2) == "plan2"
    assert layout.incoming_parts("train", "s1", 2) == (".incoming", "train", "s1", "plan2")
    assert layout.home_parts("train", "s1", 0, "host-a", 42) == (".incoming", "train", "s1", me)
    assert layout.capture_parts("train", "s1", 2, "host-a", 42, 1) == (
        ".incoming",
        "train",
        "s1",
        "plan2",
        me,
        "c1",
    )
    # Another process's dir, or the same pid on another host, is another dir.
    assert layout.home_parts("train", "s1", 0, "host-b", 42)[-1] != me
    assert layout.raw_names("main-r3") == {
        "trace": "main-r3.pt.trace.json",
        "memory": "main-r3.memory.pickle",
    }
    assert layout.nsys_parts("train", "s1") == (".incoming", "train", "s1", "nsys")
