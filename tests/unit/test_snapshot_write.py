"""``--memory-snapshot`` at a capture's end: taken on the training thread, pickled and written
off it, and the report naming the file held until the file is whole.

The real Stepper drives a real torch.profiler capture (CPU) here; only torch.cuda.memory's
allocator history, which needs CUDA, is the test double ``MemoryHistoryDouble``
(tests/doubles/memory_history.py). A gated double holds its pickling until the test opens
the gate, so "the training thread was not waiting for the write" is seen, not timed.
"""

from __future__ import annotations

import pickle
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from profd_client import protocol as P
from profd_client.agent import Agent
from profd_client.identity import detect
from profd_client.steps import PENDING, ArmedSession, Stepper, pending_write, ready

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
from memory_history import MemoryHistoryDouble, fake_snapshot


def work() -> None:
    import torch

    x = torch.ones(4, 4)
    for _ in range(3):
        x = x * 1.5 + 1.0


def capture(tmp: Path, memory: MemoryHistoryDouble, notify: Any = None) -> Stepper:
    """Steps until a one-step capture with a memory snapshot has ended; the Stepper."""
    st = Stepper("main-r0", notify=notify or (lambda: None), memory=memory)
    for _ in range(2):
        st.tick()
    c = st.count
    st.post(
        "arm",
        ArmedSession(
            session="s1",
            job="j",
            backend="torch",
            cycles=[(c + 2, c + 2, c + 3)],
            options={"activities": ["cpu"], "memory_snapshot": True},
            incoming=tmp,
        ),
    )
    for _ in range(4):
        work()
        st.tick()
    return st


def captured(st: Stepper) -> dict[str, Any]:
    (rep,) = [m for m in st.outbox if m["t"] == P.CAPTURED]
    return rep


def test_the_snapshot_is_written_off_the_training_thread_and_its_report_waits(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    memory = MemoryHistoryDouble(entries=2000, gate=gate)
    notified = threading.Event()
    st = capture(tmp_path, memory, notify=notified.set)
    # The capture ended (the ticks returned) while the snapshot's pickling is still held.
    assert memory.started == memory.stopped == 1
    assert memory.threads == [threading.current_thread().name]
    rep = captured(st)
    write = rep[PENDING]
    assert not write.done.is_set() and not ready(rep)
    assert pending_write(list(st.outbox)) is write
    kinds = {f["kind"]: Path(f["path"]) for f in rep["files"]}
    assert set(kinds) == {"trace", "memory"} and kinds["trace"].stat().st_size > 0
    assert any("taken in" in n and "written off it" in n for n in rep["notes"])
    # A report queued behind it (the session's end) waits too: see the agent test below.
    notified.clear()
    gate.set()
    assert write.done.wait(60)
    assert notified.wait(60)  # the writer wakes the agent
    assert ready(rep) and PENDING not in rep and write.error is None
    with kinds["memory"].open("rb") as fh:
        back = pickle.load(fh)
    want = memory.taken[0]
    assert back["device_traces"] == want["device_traces"] and back["gate"] == "gated"
    assert pending_write(list(st.outbox)) is None


def test_a_snapshot_that_cannot_be_written_costs_the_snapshot_only(tmp_path: Path) -> None:
    st = capture(tmp_path, MemoryHistoryDouble(unpicklable=True))
    rep = captured(st)
    assert rep[PENDING].done.wait(60)
    assert ready(rep)
    assert [f["kind"] for f in rep["files"]] == ["trace"]
    assert Path(rep["files"][0]["path"]).exists()
    assert rep["error"] is None
    assert any(n.startswith("memory snapshot not written: TypeError") for n in rep["notes"])
    assert not list(tmp_path.rglob("*.memory.pickle"))  # nothing half written stays


def test_a_snapshot_that_fails_costs_the_snapshot_only(tmp_path: Path) -> None:
    memory = MemoryHistoryDouble(fail=True)
    st = capture(tmp_path, memory)
    rep = captured(st)
    assert PENDING not in rep and ready(rep)
    assert [f["kind"] for f in rep["files"]] == ["trace"] and rep["error"] is None
    assert any(n.startswith("memory snapshot failed: RuntimeError") for n in rep["notes"])
    assert memory.stopped == 1  # the history ends anyway


def test_the_agent_sends_nothing_behind_a_report_whose_file_is_being_written(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    st = capture(tmp_path, MemoryHistoryDouble(gate=gate))
    ident = detect({}, job="j", role="main", rank=0, world_size=1)
    agent = Agent(ident, st, "manual", True, str(tmp_path / "run"), 1.0)
    order = [m["t"] for m in st.outbox]
    assert order.index(P.CAPTURED) < order.index(P.PROGRESS, order.index(P.CAPTURED))
    agent._flush_outbox()
    # Reports before the capture's went; the capture's and the session's end wait.
    held = [m["t"] for m in st.outbox]
    assert held[0] == P.CAPTURED and P.PROGRESS in held[1:]
    assert all(m["t"] != P.CAPTURED for m in agent._unacked.values())
    gate.set()
    assert captured(st)[PENDING].done.wait(60)
    agent._flush_outbox()
    assert not st.outbox
    sent = [m["t"] for m in agent._unacked.values()]
    assert sent == order  # in the order they were made, none lost
    assert all(PENDING not in m for m in agent._unacked.values())


@pytest.mark.parametrize("entries", [10, 5000])
def test_the_double_pickles_like_a_snapshot(entries: int) -> None:
    snap = fake_snapshot(entries)
    back = pickle.loads(pickle.dumps(snap))
    assert len(back["device_traces"][0]) == entries and back["segments"]
