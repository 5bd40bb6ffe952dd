"""One fan-in for every "act once the last answer is in" (profd.daemon.clients.fanin), and
the stacks read through it (profd.daemon.clients.stack_sources) with no py-spy: every rank
asked of its agent thread, one answering, one silent, one sending its flight recorder too,
on a real Reactor, AgentStacks and Registry; the rows that come out keep the wire's shape."""

from __future__ import annotations

import select
import threading
from typing import Any

import msgpack
import pytest

from profd.daemon.clients.agent_dumps import AgentStacks
from profd.daemon.clients.fanin import FanIn
from profd.daemon.clients.pyspy_reader import StackReader, job_doc
from profd.daemon.clients.registry import Client, Registry
from profd.daemon.clients.stack_sources import RankStacks
from profd.reactor import Reactor
from profd.watch.rankrow import RankRow, ReadStatus
from profd.watch.stackrows import Source, StackRank, to_maps
from profd_client import protocol as P


def test_done_runs_once_after_the_last_part() -> None:
    calls: list[int] = []
    fan = FanIn(3, lambda: calls.append(1))
    fan.arrived()
    fan.arrived()
    assert calls == [] and fan.left == 1
    fan.arrived()
    assert calls == [1] and fan.left == 0
    with pytest.raises(RuntimeError):
        fan.arrived()
    with pytest.raises(ValueError):
        FanIn(0, lambda: None)


def wire(row: StackRank) -> Any:
    """The map a ``stacks`` reply carries, as its reader unpacks it."""
    return msgpack.unpackb(msgpack.packb(to_maps(row)))


def test_threads_arriving_at_once_run_done_exactly_once() -> None:
    calls: list[str] = []
    fan = FanIn(8 * 500, lambda: calls.append(threading.current_thread().name))
    start = threading.Barrier(8)

    def worker() -> None:
        start.wait()
        for _ in range(500):
            fan.arrived()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and fan.left == 0


def _client(rank: int, flight: bool = False) -> Client:
    return Client(
        ident=f"peer-{rank}".encode(),
        host="n1",
        pid=4000 + rank,
        job="j",
        role="worker",
        rank=rank,
        local_rank=rank,
        world_size=3,
        step_mode="optimizer",
        allowed=True,
        torch="2.13.0",
        device="cpu",
        version=P.VERSION,
        flight=flight,
    )


def test_ranks_py_spy_cannot_read_are_asked_of_their_agent_and_flights_beside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PROFD_PYSPY", "")  # no py-spy: every rank falls back to its agent
    reactor = Reactor()
    sent: list[tuple[bytes, P.DumpStacks]] = []
    agent = AgentStacks(
        lambda ident, frame: sent.append((ident, P.decode(frame, P.CLIENT_INBOUND, reply=True)))
    )
    registry = Registry()
    clients = [_client(0), _client(1, flight=True), _client(2)]
    for c in clients:
        registry.add(c)
    stacks = RankStacks(StackReader(reactor.call_soon), agent, registry)
    got: list[list[RankRow]] = []
    try:
        stacks.read(clients, got.append)
        # The flight recorder is asked first, beside py-spy's reads.
        assert [(i, m.stacks, m.flight) for i, m in sent] == [(b"peer-1", False, True)]
        while len(sent) < 4:  # py-spy's (empty) reads come back: each agent is asked
            select.select([reactor.fd], [], [], 10.0)
            reactor.run_pending()
        asked = {ident: m.id for ident, m in sent[1:]}
        assert set(asked) == {b"peer-0", b"peer-1", b"peer-2"}
        frames = [{"function": "train_step", "file": "/home/u/train.py", "line": 41}]
        threads = [{"name": "MainThread", "tid": 4000, "frames": frames}]
        # Fields of an agent's thread map beyond what the protocol checks are not read: a
        # peer's claim to be the training thread, or a GIL flag that is not a bool.
        odd = [{**threads[0], "training": "yes", "owns_gil": 7}]
        agent.result(clients[0], P.StacksResult(v=3, id=asked[b"peer-0"], threads=odd))
        agent.result(clients[1], P.StacksResult(v=3, id=asked[b"peer-1"], threads=threads))
        assert got == []  # rank 2 and rank 1's flight recorder have not answered
        agent.result(
            clients[1], P.StacksResult(v=3, id=sent[0][1].id, threads=[], flight_error="off")
        )
        assert got == []
        agent.expire(float("inf"))  # rank 2's agent thread stays silent
    finally:
        stacks.reader.close()
        reactor.close()
    (rows,) = got
    no_pyspy = "py-spy not found (or turned off: PROFD_PYSPY empty)"
    assert [r.status for r in rows] == [ReadStatus.READ, ReadStatus.READ, ReadStatus.UNREAD]
    assert [r.stacks.source for r in rows] == [Source.AGENT, Source.AGENT, None]
    assert rows[1].stacks.flight_error == "off" and rows[0].stacks.flight_error is None
    assert rows[2].stacks.error == f"{no_pyspy}; its agent thread did not answer in 2s"
    # The wire's rank map, unchanged by the types.
    assert wire(rows[0].stacks) == {
        "host": "n1",
        "role": "worker",
        "rank": 0,
        "pid": 4000,
        "source": "agent",
        "threads": [{"name": "MainThread", "tid": 4000, "frames": frames, "training": True}],
        "error": f"read by its agent thread ({no_pyspy})",
    }
    assert wire(rows[1].stacks)["flight_error"] == "off"
    assert wire(rows[2].stacks) == {
        "host": "n1",
        "role": "worker",
        "rank": 2,
        "pid": 4002,
        "source": None,
        "threads": [],
        "error": rows[2].stacks.error,
    }
    doc = job_doc("j", rows)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2]
    assert len(doc["groups"]) == 1 and doc["groups"][0]["ranks"][1]["rank"] == 1
    # Named by the node that read it, its own host name kept beside.
    moved = rows[0].on_node("node-a")
    assert moved.host == "node-a" and moved.client_host == "n1"
    assert rows[0].on_node("n1") is rows[0].stacks


@pytest.mark.parametrize("pyspy", ["", "/bin/true"])
def test_a_read_that_starts_past_the_budget_says_why_it_has_no_stacks(
    pyspy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool that gets to a process after the request's budget reports it as not read;
    without py-spy the row says that at once, whenever the pool gets to it (there was
    nothing to wait for)."""
    monkeypatch.setenv("PROFD_PYSPY", pyspy)
    from profd.daemon.clients.pyspy_reader import StackTarget

    got: list[list[RankRow]] = []
    reader = StackReader(lambda f, *a: f(*a), budget=-1.0)
    try:
        done = threading.Event()
        reader.read(
            [StackTarget("h", "main", 0, 7, 7, None)], lambda rows: (got.append(rows), done.set())
        )
        assert done.wait(10)
    finally:
        reader.close()
    ((row,),) = got
    assert row.stacks.error == (
        "py-spy not found (or turned off: PROFD_PYSPY empty)"
        if not pyspy
        else "not read: the request's time ran out"
    )
