"""The warehouse end to end: two real daemons (nodes ``n1`` and ``n2``) exporting to one
S3-compatible server (moto), stepping raw peers attached to each (one job, two ranks a
node), and profctl reading what they exported.

* ``profctl query`` with ``--warehouse s3://...`` and no daemon sees both nodes' rank
  minutes, each exactly once;
* on ``n2``, whose export waits (a long ``flush_every``), profctl without ``--warehouse``
  sees its rows not flushed yet (the daemon's overlays) beside ``n1``'s objects, each once,
  and again once after ``n2`` flushed;
* a ``spike`` (one 5 s step in a rank's ledger) on ``n1`` is an incident whose lost
  rank-hours in ``profctl goodput`` are what ``profctl incident`` says it lost.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonproc import BIN
from harness import Daemon, wait_for
from s3fixtures import BUCKET, MotoServer, moto_server  # noqa: F401  (the fixture)
from steppeer import StepPeer, step_peers

from profd.store.index import Database
from profd_client import protocol as P

WAIT = 30.0
URL = f"s3://{BUCKET}/warehouse/"
#: A spike is judged against the rank's median over the window; it resolves after ``hold``.
WATCH = "[watch]\nwindow = 10.0\nhold = 1.0\n"
RANK_MINUTES = "SELECT node, count(*) AS n FROM rank_minutes GROUP BY node ORDER BY node"
SPIKE_S = 5.0
STEP_S = 0.1


def config(flush_every: float) -> str:
    return f'[warehouse]\nurl = "{URL}"\nflush_every = {flush_every}\n{WATCH}'


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[Any]:
    with step_peers(tmp_path) as spawn:
        yield spawn


def no_daemon_env(tmp: Path, srv: MotoServer) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PROFD_", "AWS_"))}
    e["PROFD_RUNTIME_DIR"] = str(tmp / "no-daemon")  # nothing answers there
    return {**e, **srv.env()}


def profctl_json(env: dict[str, str], *args: str) -> Any:
    r = subprocess.run(
        [str(BIN / "profctl"), "--json", *args], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {r["node"]: r["n"] for r in rows}


def indexed_minutes(d: Daemon) -> int:
    """The rank minutes the daemon's index holds: what its warehouse rows must number."""
    db = Database(d.state_dir / "index.db")
    try:
        return int(db.conn.execute("SELECT count(*) FROM step_minutes").fetchone()[0])
    finally:
        db.close()


def settled_minutes(d: Daemon, quiet_s: float = 3.0) -> int:
    """:func:`indexed_minutes` once it is at least 2 and has not changed for ``quiet_s``
    (several of the daemon's ticks, which write the minutes that closed)."""
    seen = [-1, time.monotonic()]

    def settled() -> int | None:
        n = indexed_minutes(d)
        if n != seen[0]:
            seen[:] = [n, time.monotonic()]
            return None
        return n if n >= 2 and time.monotonic() - seen[1] >= quiet_s else None

    return int(wait_for(settled, WAIT, "the node's minutes to be indexed", every=0.5))


def exported(srv: MotoServer, table: str, node: str) -> list[str]:
    return [k for k in srv.objects(f"warehouse/{table}/") if f"/{node}~" in k]


def test_two_nodes_one_warehouse(
    daemon_factory: Callable[..., Daemon],
    moto_server: MotoServer,  # noqa: F811
    peers: Callable[..., StepPeer],
    tmp_path: Path,
) -> None:
    d1 = daemon_factory(config=config(0.5), PROFD_NODE_NAME="n1", **moto_server.env())
    # n2's export waits: its rows stay unflushed until it starts again with a short one.
    d2 = daemon_factory(config=config(3600), PROFD_NODE_NAME="n2", **moto_server.env())
    ranks = {
        r: peers(d, "wh", rank=r, step_s=STEP_S, v=P.VERSION, world_size=4)
        for d, rs in ((d1, (0, 1)), (d2, (2, 3)))
        for r in rs
    }
    for d in (d1, d2):
        d.wait_attached(2, timeout=WAIT, min_step=30)  # a median the spike rule trusts

    # One rank of n1 stalls for 5 s once: a spike, resolved after the hold.
    spiked = ranks[1]
    spiked.spike(SPIKE_S)
    wait_for(spiked.spiked, WAIT, "the spike's ledger to be sent")
    inc = wait_for(lambda: d1.ctl_json("incidents", "--kind", "spike"), WAIT, "a spike")[0]
    doc = wait_for(
        lambda: (x := d1.ctl_json("incident", inc["id"]))["state"] == "resolved" and x,
        WAIT,
        "the spike to be resolved",
    )
    lost = doc["lost_rank_s"]
    assert SPIKE_S - 2 * STEP_S <= lost <= SPIKE_S, doc  # its excess, one rank held up

    # Every rank detaches: each node's index holds its minutes (minute rows close then).
    for p in ranks.values():
        p.bye()
    wait_for(lambda: not d1.polled_ps() and not d2.polled_ps(), WAIT, "every rank detached")
    # At least one minute of each of a node's two ranks (two each if the run crossed a
    # minute); a detached rank's minute may be indexed a moment after ps stops listing it,
    # and a minute closed at the boundary with the next tick: the count is read once settled.
    n1, n2 = (settled_minutes(d) for d in (d1, d2))
    wait_for(lambda: d1.ctl_json("status")["warehouse"]["pending_partitions"] == 0, WAIT, "n1")

    # n2 without --warehouse: n1's objects, and n2's rows from its daemon, each once.
    assert d2.ctl_json("status")["warehouse"]["pending_partitions"] > 0
    assert exported(moto_server, "rank_minutes", "n2") == []
    assert counts(d2.ctl_json("query", RANK_MINUTES)) == {"n1": n1, "n2": n2}
    # And no daemon: only what is in S3 (n2's rows not yet).
    bare = no_daemon_env(tmp_path, moto_server)
    assert counts(profctl_json(bare, "query", RANK_MINUTES, "--warehouse", URL)) == {"n1": n1}

    # n2 flushes (started again with a short flush_every: its first flush is at start).
    d2.stop()
    assert d2.config is not None
    d2.config.write_text(config(0.5))
    d2.start()
    wait_for(lambda: d2.ctl_json("status")["warehouse"]["pending_partitions"] == 0, WAIT, "n2")
    assert exported(moto_server, "rank_minutes", "n2")
    assert counts(d2.ctl_json("query", RANK_MINUTES)) == {"n1": n1, "n2": n2}
    assert counts(profctl_json(bare, "query", RANK_MINUTES, "--warehouse", URL)) == {
        "n1": n1,
        "n2": n2,
    }

    # The spike's cost, from the warehouse: what its daemon says it lost.
    by_incident = profctl_json(bare, "goodput", "--by", "incident", "--warehouse", URL)
    (row,) = [r for r in by_incident if r["id"] == inc["id"]]
    assert (row["kind"], row["node"], row["state"]) == ("spike", "n1", "resolved")
    assert row["rank_hours_lost"] > 0
    assert row["rank_hours_lost"] == pytest.approx(lost / 3600.0, rel=1e-9)
    (job,) = profctl_json(bare, "goodput", "--warehouse", URL)
    assert job["job"] == "wh" and job["rank_hours_lost"] == pytest.approx(lost / 3600.0)
