"""profctl --cluster against real daemons on this machine, each with its own node name, state
and TCP port on 127.0.0.1, CURVE keys made by ``profctl keys new``.

Raw agent peers (``rawpeer.py``) stand in for training processes: enough for rows to list.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from clusters import Cluster, free_port
from daemonproc import BIN, wait_for
from rawpeer import HELLO, TracePeer, pack, small_trace, spawn_peer

from profd import control_schema as C
from profd_client import protocol as P

DOUBLES = Path(__file__).resolve().parent / "doubles"
EXIT_NODES_MISSING, EXIT_AUTH_FAILED = 4, 5


@pytest.fixture
def peers() -> Iterator[list[subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for p in made:
        p.kill()
        p.wait()


def test_keys_new_writes_a_pyzmq_key_pair(cluster: Cluster) -> None:
    public, secret = cluster.keys / "alice.key", cluster.keys / "alice.key_secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    pub, sec = zmq.auth.load_certificate(secret)
    assert sec is not None and zmq.auth.load_certificate(public) == (pub, None)
    r = subprocess.run(
        [str(BIN / "profctl"), "keys", "new", "alice", "--dir", str(cluster.keys)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "exists" in r.stderr  # never replaces a key


def test_ps_status_sessions_show_stop_across_nodes(
    cluster: Cluster, peers: list[subprocess.Popen[bytes]]
) -> None:
    for i, name in enumerate(("node-a", "node-b", "node-c")):
        d, _ = cluster.add(name)
        peers.append(spawn_peer(d, "train", rank=i, world_size=3))
        d.wait_attached(1)

    rows = cluster.json("ps")
    assert sorted((r["host"], r["rank"]) for r in rows) == [
        ("node-a", 0),
        ("node-b", 1),
        ("node-c", 2),
    ]
    # The peers' own hostname is not the node's: it stays, as client_host.
    assert {r["client_host"] for r in rows} == {"hostile-test"}
    text = cluster.ctl("ps")
    assert text.returncode == 0 and "node-b" in text.stdout

    status = cluster.json("status")
    assert sorted((s["host"], s["clients"]) for s in status) == [
        ("node-a", 1),
        ("node-b", 1),
        ("node-c", 1),
    ]
    assert {s["address"] for s in status} == {a for _, a in cluster.nodes}

    # A session started on one node (cluster start is another issue): listed with its host.
    d_b = cluster.nodes[1][0]
    sid = d_b.ctl_json("start", "--job", "train", "--next")["session"]
    sessions = cluster.json("sessions")
    assert [(s["host"], s["id"]) for s in sessions] == [("node-b", sid)]
    shown = cluster.json("show", sid)
    assert shown["id"] == sid
    assert [(t["host"], t["rank"]) for t in shown["targets"]] == [("node-b", 1)]
    assert [n["host"] for n in shown["nodes"]] == ["node-b"]

    # An operator over TCP is privileged: it may cancel any user's session.
    cancelled = cluster.json("cancel", sid)
    assert [(r["host"], r["session"]) for r in cancelled] == [(cluster.nodes[1][1], sid)]
    unknown = cluster.ctl("stop", "nosuchsession")
    assert unknown.returncode == 1 and "nosuchsession" in unknown.stderr


def test_one_node_answers_locally_in_the_shapes_it_answers_over_tcp(
    cluster: Cluster, peers: list[subprocess.Popen[bytes]]
) -> None:
    """The local daemon is a cluster of one node: the same commands, the same ``--json``
    shapes, ``host`` on every row; local rows keep what they had (the client's hostname as
    ``host``, the daemon's name as ``node``)."""
    d, _ = cluster.add("node-a")
    peers.append(spawn_peer(d, "train"))
    d.wait_attached(1)

    [local_ps] = d.ctl_json("ps")
    [tcp_ps] = cluster.json("ps")
    assert (local_ps["host"], local_ps["node"]) == ("hostile-test", "node-a")
    assert (tcp_ps["host"], tcp_ps["client_host"]) == ("node-a", "hostile-test")
    assert set(tcp_ps) - {"client_host"} <= set(local_ps)

    started = d.ctl_json("start", "--job", "train", "--next")
    sid = started["session"]
    assert [(n["host"], n["state"]) for n in started["nodes"]] == [("node-a", "started")]
    assert started["missing_ranks"] == []

    [local_row] = d.ctl_json("sessions")
    [tcp_row] = cluster.json("sessions")
    assert local_row["host"] == tcp_row["host"] == "node-a"
    assert set(tcp_row) <= set(local_row)

    local_show, tcp_show = d.ctl_json("show", sid[:12]), cluster.json("show", sid[:12])
    assert local_show["id"] == tcp_show["id"] == sid
    assert [n["host"] for n in local_show["nodes"]] == [n["host"] for n in tcp_show["nodes"]]
    assert set(tcp_show) <= set(local_show)
    assert [t["host"] for t in local_show["targets"]] == ["hostile-test"]

    # A document every node answers: the local daemon's own, one row per node over TCP.
    local_status = d.ctl_json("status")
    assert local_status["host"] == "node-a" and "address" in local_status
    assert [s["host"] for s in cluster.json("status")] == ["node-a"]
    assert d.ctl_json("cancel", sid)["session"] == sid
    # A refusal: one line, exit 1, and with --json its code, either way.
    for r in (d.ctl("--json", "stop", "nosuchsession"), cluster.ctl("--json", "stop", "nosuch")):
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
        assert json.loads(r.stdout)["code"] == "unknown_session"


def test_traces_and_pull_across_nodes(cluster: Cluster, ctx: zmq.Context, tmp_path: Path) -> None:
    cluster.add("node-a")
    d_b, _ = cluster.add("node-b")
    sid, _ = TracePeer(ctx, d_b, "jobb").capture(small_trace)
    wait_for(lambda: d_b.ctl_json("show", sid)["state"] == "done", 60, "session done")

    rows = cluster.json("traces", "--session", sid)
    assert [(r["host"], r["session"], r["cycle"]) for r in rows] == [("node-b", sid, 0)]
    assert cluster.json("traces", "--host", "node-a") == []

    out = tmp_path / "pulled"
    pulled = cluster.json("pull", sid, "-o", str(out))
    assert pulled["session"] == sid
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert f"{sid}/session.node-b.json" in names
    assert any(n.startswith(f"{sid}/c0/") and ".pt.trace.json" in n for n in names)


def test_unknown_and_missing_keys_are_refused_and_logged(cluster: Cluster) -> None:
    d, address = cluster.add("node-a")

    bad = cluster.ctl("ps", key="mallory")
    assert bad.returncode == EXIT_AUTH_FAILED
    assert f"authentication failed for {address}" in bad.stderr
    assert bad.stdout == ""
    mallory = zmq.auth.load_certificate(cluster.keys / "mallory.key")[0].decode()
    wait_for(lambda: mallory in d.log.read_text(), 10, "the refusal in the daemon's log")
    assert "refused control connection from 127.0.0.1: unknown key" in d.log.read_text()

    none = cluster.ctl("ps", key=None)
    assert none.returncode == EXIT_AUTH_FAILED
    assert f"authentication failed for {address}: no --key given" in none.stderr
    wait_for(lambda: d.log.read_text().count("unknown key") == 2, 10, "the second refusal logged")

    # A daemon's public key that is not this daemon's: the handshake fails, said as such.
    wrong = cluster.ctl("ps", PROFD_SERVER_KEY=str(cluster.keys / "alice.key"))
    assert wrong.returncode == EXIT_AUTH_FAILED
    assert "is --server-key that daemon's public key?" in wrong.stderr

    # The key that is authorized still works, and --json on a refusal says why.
    assert cluster.json("ps") == []
    j = cluster.ctl("--json", "status", key="mallory")
    assert json.loads(j.stdout)["code"] == "auth"


def test_one_fan_out_tells_a_refused_node_from_the_answering_ones(
    cluster: Cluster, tmp_path: Path
) -> None:
    """All nodes share profctl's one socket: a refusal by a node reached by host name is
    told apart from the nodes that answer on the same socket."""
    _, good = cluster.add("node-a")
    nobody = tmp_path / "nobody-authorized"
    nobody.mkdir()
    _, strict = cluster.add("node-b", authorized_keys=str(nobody))
    by_name = "localhost:" + strict.rsplit(":", 1)[1]
    r = cluster.ctl("--json", "ps", nodes=[good, by_name])
    assert r.returncode == EXIT_AUTH_FAILED, r.stderr
    assert f"authentication failed for {by_name}" in r.stderr
    assert good not in r.stderr
    assert json.loads(r.stdout) == []  # node-a answered: no processes there


def test_with_few_descriptors_the_fan_out_still_answers_for_every_node(cluster: Cluster) -> None:
    """A profctl whose descriptor limit cannot keep a connection to every node asks them a
    window at a time, dropping each connection after its answer."""
    cluster.add("node-a")
    cluster.add("node-b")
    cluster.add("node-c")
    # profctl keeps 64 descriptors for Python and ZeroMQ and counts 2 per node: 66 leaves
    # room for one node at a time.
    rows = cluster.ctl("--json", "status", max_fds=66)
    assert rows.returncode == 0, rows.stderr
    assert sorted(r["host"] for r in json.loads(rows.stdout)) == ["node-a", "node-b", "node-c"]


def test_tcp_serves_control_requests_only(cluster: Cluster) -> None:
    d, address = cluster.add("node-a")
    pub, sec = zmq.auth.load_certificate(cluster.keys / "alice.key_secret")
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.curve_publickey, s.curve_secretkey = pub, sec
        s.curve_serverkey = zmq.auth.load_certificate(cluster.keys / "daemon.key")[0]
        s.connect(f"tcp://{address}")
        s.send_multipart([b"", pack(HELLO)])
        assert s.poll(30_000)
        reply = P.unpack(s.recv_multipart()[-1])
        assert reply["t"] == "error" and reply["code"] == "type"
    finally:
        ctx.destroy(linger=0)
    assert d.ps() == []  # nobody attached over TCP


def test_a_node_that_is_down_is_named_with_its_own_exit_code(
    cluster: Cluster, peers: list[subprocess.Popen[bytes]]
) -> None:
    d, up = cluster.add("node-a")
    peers.append(spawn_peer(d, "train"))
    d.wait_attached(1)
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    r = cluster.ctl("--node-timeout", "1", "ps", "--json", nodes=[up, down])
    assert r.returncode == EXIT_NODES_MISSING
    assert [row["host"] for row in json.loads(r.stdout)] == ["node-a"]
    assert f"{down} did not answer within 1s" in r.stderr
    assert "1 of 2 node(s) did not answer" in r.stderr

    alone = cluster.ctl("--node-timeout", "1", "status", nodes=[down])
    assert alone.returncode == EXIT_NODES_MISSING
    assert alone.stdout == "" and f"{down} did not answer" in alone.stderr


def test_slurm_job_names_the_nodes(cluster: Cluster, tmp_path: Path) -> None:
    """``slurm:123`` through the scontrol test double: its hosts are the nodes asked (none
    runs a daemon on the default port, so each is named as not answering)."""
    calls = tmp_path / "scontrol-calls"
    r = cluster.ctl(
        "--node-timeout",
        "1",
        "status",
        PROFD_CLUSTER="slurm:123",
        PATH=f"{DOUBLES}:{os.environ['PATH']}",
        FAKE_SLURM_JOBS=json.dumps({"123": "127.0.0.2,127.0.0.3"}),
        FAKE_SLURM_CALLS=str(calls),
    )
    assert r.returncode == EXIT_NODES_MISSING, r.stderr
    assert "127.0.0.2:7717 did not answer" in r.stderr
    assert "127.0.0.3:7717 did not answer" in r.stderr
    assert calls.read_text().splitlines() == ["show job 123", "show hostnames 127.0.0.2,127.0.0.3"]


def test_a_daemon_without_keys_or_with_a_readable_secret_refuses_to_start(
    cluster: Cluster,
) -> None:
    def refused(config: str) -> str:
        d = cluster.make(config=config, start=False)
        d.launch()
        assert d.proc is not None
        rc = d.proc.wait(30)
        d.proc = None
        assert rc != 0
        lines = [ln for ln in d.log.read_text().splitlines() if ln.strip()]
        assert len(lines) == 1, lines
        return lines[0]

    port = free_port()
    no_keys = refused(f'[cluster]\nlisten = "tcp://127.0.0.1:{port}"\n')
    assert "server_key" in no_keys and "authorized_keys" in no_keys

    open_secret = cluster.keys / "open.key_secret"
    open_secret.write_bytes((cluster.keys / "daemon.key_secret").read_bytes())
    open_secret.chmod(0o644)
    readable = refused(
        f'[cluster]\nlisten = "tcp://127.0.0.1:{port}"\nserver_key = "{open_secret}"\n'
        f'authorized_keys = "{cluster.base / "authorized"}"\n'
    )
    assert "readable by group or others" in readable and "chmod 600" in readable

    public_only = refused(
        f'[cluster]\nlisten = "tcp://127.0.0.1:{port}"\n'
        f'server_key = "{cluster.keys / "daemon.key"}"\n'
        f'authorized_keys = "{cluster.base / "authorized"}"\n'
    )
    assert "no secret key" in public_only


def test_bad_node_lists_and_missing_keys_are_usage_errors(cluster: Cluster) -> None:
    bad = cluster.ctl("ps", nodes=["gpu01:99999"])
    assert bad.returncode == 2 and "port must be 1-65535" in bad.stderr
    no_server_key = cluster.ctl("ps", nodes=["127.0.0.1:1"], PROFD_SERVER_KEY="")
    assert no_server_key.returncode == 2 and "--server-key" in no_server_key.stderr


def test_a_fan_out_to_more_nodes_than_libzmq_allows_sockets_by_default_answers_for_each() -> None:
    """600 nodes at once, each its own connection and its own answer. A fan-out with a
    socket per node once raised "Too many open files" after about 340 nodes (libzmq's 1,023
    sockets per context); it has one socket for all nodes now. Nothing listens on these
    ports, so every node is a timeout."""
    from profd.ctl.cluster import ClientKeys, Fanout, parse_node

    public, secret = zmq.curve_keypair()
    server, _ = zmq.curve_keypair()
    keys = ClientKeys(public, secret, server)
    # 600 distinct ports, bound here and never listened on: every connection is refused.
    held = [socket.socket() for _ in range(600)]
    for h in held:
        h.bind(("127.0.0.1", 0))
    nodes = [parse_node(f"127.0.0.1:{h.getsockname()[1]}") for h in held]
    try:
        with Fanout(keys, timeout=1.0) as f:
            answers = f.ask(nodes, C.C_PS, {})
    finally:
        for h in held:
            h.close()
    assert len(answers) == 600
    assert {a.failure for a in answers} == {"timeout"}
    # A node listed twice is asked once, and answered in both places.
    with Fanout(keys, timeout=0.5) as f:
        twice = f.ask([nodes[0], nodes[1], nodes[0]], C.C_PS, {})
    assert [a.node for a in twice] == [nodes[0], nodes[1], nodes[0]]
    assert {a.failure for a in twice} == {"timeout"}
