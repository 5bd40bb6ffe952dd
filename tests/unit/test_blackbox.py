"""The black box (``profd_client/blackbox.py``) and what is made of it (``profd/blackbox``).

A real :class:`Stepper` whose clock the test moves by hand, so every step's time is known;
the wire is the real ``blackbox_result`` encoded and decoded; the daemon's collector runs
with its real question table, a real client's box answering.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from profd.blackbox import perfetto, summary
from profd.blackbox.box import from_result
from profd.daemon.clients.agent_dumps import AgentBlackboxes
from profd.daemon.clients.blackbox_collect import BlackboxCollector, Collected
from profd.daemon.clients.registry import Client
from profd_client import protocol as P
from profd_client.blackbox import (
    MAX_AT,
    MAX_FRAMES,
    MAX_STACKS,
    SAMPLE_SLOTS,
    BlackBox,
    env_overrides,
)
from profd_client.steps import REGION_SLOTS, RING, Stepper

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def boxed(**settings: Any) -> tuple[Stepper, BlackBox, Clock]:
    clock = Clock()
    st = Stepper("main-r0", notify=lambda: None, clock=clock)
    box = BlackBox(st, {})
    box.configure(settings)
    return st, box, clock


def run(st: Stepper, clock: Clock, n: int, dt: float, region: str | None = None) -> None:
    for _ in range(n):
        if region is not None:
            with st.timer(region):
                clock.now += dt / 4
            clock.now += dt * 3 / 4
        else:
            clock.now += dt
        st.tick()


def wire(box: BlackBox, who: dict[str, Any] | None = None) -> dict[str, Any]:
    """The box as the daemon has it: encoded, decoded, converted."""
    frame = P.encode(P.BLACKBOX_RESULT, id=1, **box.snapshot())
    assert len(frame) <= P.MAX_FRAME_BYTES
    m = P.decode(frame, P.AGENT_INBOUND)
    assert type(m) is P.BlackboxResult
    return from_result(m, who or {"node": "n", "host": "h", "role": "main", "rank": 0, "pid": 1})


def test_the_last_keep_steps_steps_after_the_ring_wrapped() -> None:
    st, box, clock = boxed(keep_steps=512, keep_seconds=0.0)
    run(st, clock, RING + 1000, 0.001)
    b = wire(box)
    assert b["step0"] == st.count - 512 and len(b["ends"]) == 513
    # Every step held is the one timed: 1 ms each, the last one ending now (in wall-clock
    # seconds, good to a microsecond).
    clock_offset = b["ends"][-1] - clock.now
    gaps = [y - x for x, y in zip(b["ends"], b["ends"][1:], strict=False)]
    assert gaps == pytest.approx([0.001] * 512, abs=1e-6)
    assert b["ends"][0] - clock_offset == pytest.approx(clock.now - 0.512, abs=1e-6)


def test_keep_seconds_keeps_more_than_keep_steps_within_the_ring() -> None:
    st, box, clock = boxed(keep_steps=10, keep_seconds=30.0)
    run(st, clock, 100, 1.0)
    assert len(wire(box)["ends"]) - 1 == 30  # the steps that ended in the last 30 s
    box.configure({"keep_steps": 50, "keep_seconds": 30.0})
    assert len(wire(box)["ends"]) - 1 == 50  # keep_steps wins when it is more
    # Fast steps: keep_seconds would want more than the ring holds.
    st, box, clock = boxed(keep_steps=512, keep_seconds=120.0)
    run(st, clock, RING + 10, 0.001)
    held = box.snapshot()
    assert len(held["ends"]) // 8 == RING - 1


def test_region_records_per_step_wrap_around() -> None:
    st, box, clock = boxed(keep_steps=REGION_SLOTS, keep_seconds=0.0)
    run(st, clock, REGION_SLOTS + 100, 0.004, region="data")
    b = wire(box)
    steps = [r[0] for r in b["records"]]
    # The oldest records were overwritten: those kept are the newest, one per step, each
    # in the step it ran in (count + 1 at its exit).
    assert len(steps) == REGION_SLOTS - 1 and steps[-1] == st.count
    assert steps == list(range(st.count - len(steps) + 1, st.count + 1))
    assert all(
        r[3] == pytest.approx(0.001, abs=1e-6) and b["regions"][r[1]] == "data"
        for r in b["records"]
    )


def test_each_exit_in_the_step_it_ran_in_across_regions_and_pauses() -> None:
    st, box, clock = boxed(keep_steps=64, keep_seconds=0.0)
    run(st, clock, 3, 0.004)
    for _ in range(4):  # two regions, one of them entered twice a step, one nested
        with st.timer("data"):
            clock.now += 0.001
        with st.timer("fwd"), st.timer("fwd"):
            clock.now += 0.002
        with st.timer("data"):
            clock.now += 0.0005
        st.tick()
    with st.timer("fwd"):  # in the step not finished yet
        clock.now += 0.003
    records = wire(box)["records"]
    names = wire(box)["regions"]
    got = [(r[0], names[r[1]], round(r[3], 6)) for r in records]
    each = (("data", 0.001), ("fwd", 0.002), ("data", 0.0005))
    want = [(s, n, d) for s in range(4, 8) for n, d in each]
    assert got == [*want, (8, "fwd", 0.003)]
    # Recording paused and resumed: nothing from before the pause is read as after it,
    # nothing from the pause is recorded.
    box.configure({"enabled": False})
    assert wire(box)["records"] == []
    run(st, clock, 5, 0.004, region="data")
    box.configure({"keep_steps": 64, "keep_seconds": 0.0})
    run(st, clock, 2, 0.004, region="data")
    assert [r[0] for r in wire(box)["records"]] == [st.count - 1, st.count]


def test_memory_is_fixed_at_attach_and_within_8_mib() -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        st, box, clock = boxed()
        at_attach = tracemalloc.get_traced_memory()[0] - before
        run(st, clock, RING + 10, 0.002, region="data")
        for i in range(P.MAX_LEDGER_REGIONS - 1):  # every region a rank may time, each its ring
            with st.timer(f"r{i}"):
                clock.now += 0.001
        # The worst case for the tables: every frame text at its longest, every stack at
        # its deepest, every sample slot used.
        code = compile("def f(): pass", "x" * 300, "exec")
        smp = box.sampler
        ids = [smp.frame_id((code, i)) for i in range(MAX_FRAMES)]
        for i in range(MAX_STACKS):
            smp.stack_id(tuple(ids[(i + k) % MAX_FRAMES] for k in range(64)))
        for i in range(5000):
            smp.step[i % len(smp.step)] = i
            smp.stack[i % len(smp.stack)] = i % MAX_STACKS
        smp.n = 5000
        for i in range(MAX_AT):  # the walk's cache full, of ids of the size code ids have
            smp._at[(id(code) + 64 * i, 1000 + i)] = i
        full = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(smp.frames) == MAX_FRAMES and len(smp.stacks) == MAX_STACKS
    # The rings are arrays allocated at attach; only the tables and the step ring's floats
    # fill in, up to their bounds.
    ring = st.regions["data"]._ring
    assert ring is not None and len(ring) == 2 * REGION_SLOTS and len(st._ring) == RING
    assert at_attach < 2 * MiB and full < 8 * MiB, (at_attach, full)


def test_samples_of_the_training_thread_tagged_with_their_step() -> None:
    st, box, clock = boxed(sample_hz=1000.0)
    stop = threading.Event()
    stepped = threading.Event()

    def inner_loop() -> None:
        while not stop.is_set():
            time.sleep(0.001)

    def train() -> None:
        st.training_ident = threading.get_ident()
        run(st, clock, 5, 0.1)
        stepped.set()
        inner_loop()

    t = threading.Thread(target=train)
    t.start()
    try:
        stepped.wait(10)
        for _ in range(3):
            box.next_sample = 0.0
            box.sample(time.perf_counter())
    finally:
        stop.set()
        t.join()
    b = wire(box)
    # The box holds the steps up to 5; samples taken in step 6 (running) are kept with them.
    assert [s[1] for s in b["samples"]] == [6, 6, 6]
    stack = [b["frames"][f] for f in b["stacks"][b["samples"][0][2]]]
    assert stack[0].startswith("inner_loop (") and stack[1].startswith("train (")


def test_a_stack_read_again_through_the_walk_cache_is_the_same_stack() -> None:
    _, box, _ = boxed()
    smp = box.sampler
    parked, stop = threading.Event(), threading.Event()

    def parked_here() -> None:
        parked.set()
        stop.wait(30)

    t = threading.Thread(target=parked_here)
    t.start()
    try:
        parked.wait(10)
        ident = t.ident
        assert ident is not None
        first = [smp.sample(ident, 1, 0.0) for _ in range(3)]
        cached = len(smp._at)
        smp._compact()  # renumbers what it keeps: the cache, in old numbers, goes
        emptied = len(smp._at)
        smp.sample(ident, 2, 0.0)
    finally:
        stop.set()
        t.join()
    _, steps, stacks = smp.held()
    assert first == [True] * 3 and steps == [1, 1, 1, 2] and cached > 0 and emptied == 0
    assert len(set(stacks)) == 1 and -1 not in stacks
    texts = [smp.frames[f] for f in smp.stacks[stacks[0]]]
    line = parked_here.__code__.co_firstlineno + 2
    assert any(x.startswith("parked_here (") and x.endswith(f":{line})") for x in texts), texts


def test_a_full_stack_table_forgets_what_no_kept_sample_uses() -> None:
    _, box, _ = boxed()
    smp = box.sampler
    code = compile("def f(): pass", "f.py", "exec")

    def sample(i: int, j: int) -> None:
        sid = smp.stack_id((smp.frame_id((code, i % 7)), smp.frame_id((code, 1000 + j))))
        k = smp.n % len(smp.t)
        smp.stack[k], smp.step[k], smp.t[k] = sid, i, float(i)
        smp.n += 1

    for i in range(MAX_STACKS):  # the table full
        sample(i, i)
    for _ in range(SAMPLE_SLOTS):  # samples of one of its stacks
        sample(0, 0)
    for i in range(10):  # no kept sample uses the others now: room for new ones
        sample(i, 10_000 + i)
    _, _, stacks = smp.held()
    assert len(smp.stacks) == 11 and -1 not in stacks
    assert smp.frames[smp.stacks[stacks[-1]][1]].endswith(":11009)")
    assert smp.frames[smp.stacks[stacks[0]][1]].endswith(":1000)")


def test_settings_from_the_daemon_and_the_environment_wins() -> None:
    over = env_overrides({"PROFD_BLACKBOX_SAMPLE_HZ": "2", "PROFD_BLACKBOX_KEEP_STEPS": "x"})
    assert over == {"sample_hz": 2.0}
    st = Stepper("main-r0", notify=lambda: None)
    box = BlackBox(st, over)
    box.configure({"sample_hz": 50.0, "keep_steps": 64, "enabled": True})
    assert (box.settings.sample_hz, box.settings.keep_steps) == (2.0, 64)
    box.configure({"enabled": False})
    assert box.due(0.0) is None and not box.log.on
    assert env_overrides({"PROFD_BLACKBOX": "0"}) == {"enabled": False}


def boxes_of_two_ranks() -> list[dict[str, Any]]:
    """Two ranks of one lockstep job on nodes whose clocks differ by 1000 s; rank 1's step
    10 is slow, inside its region, and rank 0 waits for it outside its own."""
    out = []
    for rank in (0, 1):
        st, box, clock = boxed(keep_steps=100)
        clock.now += 1000.0 * rank
        run(st, clock, 9, 0.010, region="data")
        with st.timer("data"):
            clock.now += 0.5 if rank == 1 else 0.0025
        clock.now += 0.0075 if rank == 1 else 0.505
        st.tick()
        run(st, clock, 5, 0.010, region="data")
        who = {"node": f"node{rank}", "host": "h", "role": "main", "rank": rank, "pid": 10 + rank}
        out.append(wire(box, {"job": "j", "world_size": 2, **who}))
    return out


def test_the_trace_aligns_ranks_by_step_and_holds_every_track(tmp_path: Path) -> None:
    boxes = boxes_of_two_ranks()
    path = tmp_path / "bb.json.gz"
    perfetto.write(boxes, path)
    doc = json.loads(gzip.decompress(path.read_bytes()))
    ev = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert names == {1: "node0/main rank 0", 2: "node1/main rank 1"}
    # Aligned by the global step despite the 1000 s between the nodes' clocks.
    ends = {(e["pid"], e["args"]["step"]): e["ts"] + e["dur"] for e in ev if e.get("cat") == "step"}
    assert ends[(1, 15)] == pytest.approx(ends[(2, 15)])
    assert all(ends[(1, n)] == pytest.approx(ends[(2, n)]) for n in range(2, 16))
    regions = [e for e in ev if e.get("cat") == "region" and e["pid"] == 2]
    assert {e["name"] for e in regions} == {"data"} and all(e["dur"] > 0 for e in regions)
    check_chrome_format(doc)


def check_chrome_format(doc: dict[str, Any]) -> None:
    """The Chrome trace-event format's rules for the event kinds the trace uses. (Perfetto's
    trace processor, from the ``perfetto`` package, fetches its binary on first use: it
    cannot run without the network, so the format is checked here instead.)"""
    frames = doc["stackFrames"]
    for node in frames.values():
        assert isinstance(node["name"], str) and node.get("parent", next(iter(frames))) in frames
    opened: dict[tuple[Any, str], int] = {}
    for e in doc["traceEvents"]:
        assert e["ph"] in {"M", "X", "i", "b", "e"} and isinstance(e["name"], str), e
        assert isinstance(e["pid"], int), e
        if e["ph"] == "M":
            assert e["name"] in {
                "process_name", "process_sort_index", "thread_name", "thread_sort_index"
            }, e  # fmt: skip
            continue
        assert isinstance(e["ts"], float | int) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["tid"], int), e
        elif e["ph"] == "i":
            assert e["s"] == "t" and ("sf" not in e or e["sf"] in frames), e
        else:  # async: every begin has its end, after it, under the same id
            key = (e["cat"], e["id"])
            if e["ph"] == "b":
                opened[key] = e["ts"]
            else:
                assert opened.pop(key) <= e["ts"], e
    assert not opened


def test_the_summary_names_the_slowest_step_and_where_its_time_went() -> None:
    doc = summary.summarize(boxes_of_two_ranks())
    r0, r1 = doc["ranks"]
    assert (r0["steps"], r0["first_step"], r0["last_step"]) == (14, 2, 15)
    s = r1["slowest"]
    assert s["step"] == 10 and s["seconds"] == pytest.approx(0.5075)
    assert s["regions"]["data"] == pytest.approx(0.5)
    assert s["outside_regions_s"] == pytest.approx(0.0075)
    assert r0["slowest"]["outside_regions_s"] == pytest.approx(0.505)
    assert doc["common_steps"] == [2, 15]  # step 1 is untimed (attach to its end)
    assert "slowest step 10" in summary.text(doc)[1]


def client(ident: bytes, rank: int, blackbox: bool = True) -> Client:
    return Client(
        ident=ident, host="h", pid=100 + rank, job="j", role="main", rank=rank, local_rank=rank,
        world_size=3, step_mode="manual", allowed=True, torch=None, device=None,
        blackbox=blackbox,
    )  # fmt: skip


def test_the_collector_names_ranks_without_a_box_gone_or_silent() -> None:
    """Rank 0 answers, rank 1's client predates the black box, rank 2 exits meanwhile."""
    asked: list[tuple[bytes, bytes]] = []
    here = {b"a", b"c"}
    agent = AgentBlackboxes(
        lambda ident, frame: asked.append((ident, frame)), lambda i: i not in here
    )
    got: list[Collected] = []
    c0, c1, c2 = client(b"a", 0), client(b"b", 1, blackbox=False), client(b"c", 2)
    BlackboxCollector(agent, "node0").collect([c0, c1, c2], got.append, first=[2])
    assert [i for i, _ in asked] == [b"c", b"a"]  # the ranks named first
    _, box, _ = boxed()
    for ident, frame in asked:
        m = P.decode(frame, P.CLIENT_INBOUND)
        if ident == b"a":
            reply = P.decode(
                P.encode(P.BLACKBOX_RESULT, id=m.id, **box.snapshot()), P.AGENT_INBOUND
            )
            agent.result(c0, reply)
    assert not got  # rank 2 still due
    here.discard(b"c")
    agent.expire(time.monotonic())  # well before the deadline
    (doc,) = got
    assert [b["rank"] for b in doc.boxes] == [0]
    why = {m.rank: m.why for m in doc.missing}
    assert "no black box" in why[1] and "exited" in why[2]


def test_blackbox_config_and_what_the_welcome_carries(tmp_path: Path) -> None:
    from profd.config import ConfigError, load

    p = tmp_path / "profd.toml"
    p.write_text("[blackbox]\nkeep_steps = 64\nsample_hz = 0\n")
    cfg = load(p, env={})
    assert cfg.blackbox.welcome() == {
        "enabled": True, "keep_steps": 64, "keep_seconds": 120.0, "sample_hz": 0.0
    }  # fmt: skip
    welcome = P.decode(
        P.encode(
            P.WELCOME, spool="/s", hb_interval=1.0, daemon="x", blackbox=cfg.blackbox.welcome()
        ),
        P.CLIENT_INBOUND,
    )
    _, box, _ = boxed()
    box.configure(P.fields_of(welcome.blackbox))
    assert box.settings.keep_steps == 64 and box.due(0.0) is None  # no sampling at 0 Hz
    for bad in ("keep_steps = 0", "sample_hz = 5000", "enabled = 1", "keep = 3"):
        p.write_text(f"[blackbox]\n{bad}\n")
        with pytest.raises(ConfigError, match="blackbox"):
            load(p, env={})
