"""profctl --cluster's pure logic: node lists, the session state across nodes, cluster rows.

``slurm[:JOBID]`` runs ``tests/doubles/scontrol`` (a test double) put on PATH.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from profd.ctl.cluster import Node, on_node, parse_node, parse_nodes
from profd.ctl.connection import LocalNode
from profd.ctl.errors import EXIT_NODES_MISSING, CtlError, NoAnswer
from profd.ctl.nodes import Answer, Gathered
from profd.states import combine

DOUBLES = Path(__file__).resolve().parent.parent / "doubles"


@pytest.mark.parametrize(
    ("text", "node"),
    [
        ("gpu01", Node("gpu01", 7717)),
        ("gpu01:9000", Node("gpu01", 9000)),
        (" 10.0.0.5:7718 ", Node("10.0.0.5", 7718)),
        ("[::1]:7719", Node("::1", 7719)),
        ("[fe80::1]", Node("fe80::1", 7717)),
        ("fe80::1", Node("fe80::1", 7717)),  # bare IPv6: colons are not a port
    ],
)
def test_parse_node(text: str, node: Node) -> None:
    assert parse_node(text) == node


@pytest.mark.parametrize("text", ["gpu01:", "gpu01:0", "gpu01:70000", "gpu01:x", "[::1", ":80"])
def test_bad_node(text: str) -> None:
    with pytest.raises(CtlError):
        parse_node(text)


def test_address_and_endpoint() -> None:
    assert Node("::1", 7719).endpoint == "tcp://[::1]:7719"
    assert Node("gpu01").address == "gpu01:7717"


def test_list_keeps_order_and_drops_duplicates() -> None:
    nodes = parse_nodes("b:1, a:2,b:1,,c")
    assert [n.address for n in nodes] == ["b:1", "a:2", "c:7717"]


def test_file_one_per_line(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("# the job's nodes\nn0:7001\n\nn1  # spare\nn0:7001\n")
    assert [n.address for n in parse_nodes(f"@{f}")] == ["n0:7001", "n1:7717"]


def test_missing_file_and_empty_list(tmp_path: Path) -> None:
    with pytest.raises(CtlError, match="No such file"):
        parse_nodes(f"@{tmp_path / 'none'}")
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(CtlError, match="names no nodes"):
        parse_nodes(f"@{tmp_path / 'empty'}")


@pytest.fixture
def slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The scontrol test double on PATH; the file its calls are logged to."""
    monkeypatch.setenv("PATH", f"{DOUBLES}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.setenv("FAKE_SLURM_JOBS", json.dumps({"123": "gpu01,gpu02", "7": "solo"}))
    calls = tmp_path / "calls"
    monkeypatch.setenv("FAKE_SLURM_CALLS", str(calls))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    return calls


def test_slurm_job(slurm: Path) -> None:
    assert [n.address for n in parse_nodes("slurm:123")] == ["gpu01:7717", "gpu02:7717"]
    assert slurm.read_text().splitlines() == ["show job 123", "show hostnames gpu01,gpu02"]


def test_slurm_job_from_environment(slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert [n.host for n in parse_nodes("slurm")] == ["solo"]
    # Inside the allocation its own node list is used as it is.
    monkeypatch.setenv("SLURM_JOB_NODELIST", "x1,x2")
    assert [n.host for n in parse_nodes("slurm")] == ["x1", "x2"]
    assert slurm.read_text().splitlines()[-1] == "show hostnames x1,x2"


def test_slurm_errors(slurm: Path) -> None:
    with pytest.raises(CtlError, match="no job id"):
        parse_nodes("slurm")
    with pytest.raises(CtlError, match="Invalid job id"):
        parse_nodes("slurm:999")
    with pytest.raises(CtlError, match="not a job id"):
        parse_nodes("slurm:12;rm")


def test_no_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CtlError, match="scontrol not found"):
        parse_nodes("slurm:1")


@pytest.mark.parametrize(
    ("states", "state"),
    [
        (["done", "done"], "done"),
        (["done", "capturing", "armed"], "armed"),
        (["done", "failed"], "partial"),
        (["partial", "done"], "partial"),
        (["failed", "cancelled"], "failed"),
        (["cancelled", "cancelled"], "cancelled"),
    ],
)
def test_combined_state(states: list[str], state: str) -> None:
    assert combine(states) == state


def test_cluster_row_names_its_node() -> None:
    n = Node("10.0.0.5", 7717)
    assert on_node({"host": "pod-7", "node": "gpu05", "pid": 1}, n) == {
        "host": "gpu05",
        "client_host": "pod-7",
        "pid": 1,
    }
    assert on_node({"host": "gpu05", "node": "gpu05"}, n) == {"host": "gpu05"}
    # A daemon that does not name itself: the address it was reached at.
    assert on_node({"id": "s1"}, n) == {"id": "s1", "host": "10.0.0.5:7717"}


def test_answered_is_the_one_rule_for_refusals() -> None:
    a, b = Node("a"), Node("b")
    unknown = CtlError("no session 's'", code="unknown_session")
    denied = CtlError("not yours", code="permission")
    # A node that does not know the session is no error while another answers.
    g = Gathered([Answer(a, error=unknown), Answer(b, data=[{"id": "s"}])])
    assert [x.node for x in g.answered()] == [b]
    assert g.rows() == [{"id": "s", "host": "b:7717"}]
    # Nobody answered: a refusal that says more than "unknown" is the result.
    with pytest.raises(CtlError, match="not yours"):
        Gathered([Answer(a, error=unknown), Answer(b, error=denied)]).answered()
    with pytest.raises(CtlError, match="no session"):
        Gathered([Answer(a, error=unknown)]).rows()
    # Nobody answered at all: the exit code says why.
    silent = Gathered([Answer(a, failure="timeout", why="a did not answer")])
    with pytest.raises(NoAnswer, match="a did not answer") as exc:
        silent.answered()
    assert exc.value.exit_code == EXIT_NODES_MISSING


def test_the_local_node_keeps_its_rows_and_names_those_without_a_host() -> None:
    n = LocalNode("/run/profd/control.sock")
    assert n.local and not Node("a").local
    assert n.named({"host": "pod-7", "node": "gpu05"}) == {"host": "pod-7", "node": "gpu05"}
    assert n.named({"id": "s1", "node": "gpu05"}) == {"id": "s1", "node": "gpu05", "host": "gpu05"}
    assert n.named({"session": "s1"}) == {"session": "s1"}
