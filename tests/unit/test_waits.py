"""A rank's collective wait (profd_client.waits) from flight-recorder dumps.

The timed dumps are synthetic, in the shape torch's ``_dump_nccl_trace`` returns with
``TORCH_NCCL_ENABLE_TIMING=1`` (no GPU here); the untimed one is a real gloo process group's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
from test_client_ledger import Clock

from profd_client import protocol as P
from profd_client.steps import Stepper
from profd_client.waits import BUDGET, Waits, seconds_of, tally

ROOT = Path(__file__).resolve().parents[2]
_NS = 1_800_000_000_000_000_000


def entry(seq: int, ms: float | None, state: str = "completed", retired: bool = True,
          pg: str = "0", p2p: bool = False, started: bool = True) -> dict[str, Any]:  # fmt: skip
    """One entry as torch's NCCL flight recorder dumps it."""
    t0 = _NS + seq * 10_000_000
    e: dict[str, Any] = {
        "record_id": seq - 1,
        "pg_id": int(pg) if pg.isdigit() else 1,
        "process_group": (pg, "default_pg" if pg == "0" else "sub"),
        "collective_seq_id": 0 if p2p else seq,
        "p2p_seq_id": seq if p2p else 0,
        "op_id": seq,
        "profiling_name": "nccl:all_reduce",
        "time_created_ns": t0,
        "input_sizes": [[1024]],
        "output_sizes": [[1024]],
        "state": state,
        "time_discovered_started_ns": t0 + 1000 if started and state != "scheduled" else 0,
        "time_discovered_completed_ns": t0 + 2_000_000 if state == "completed" else 0,
        "retired": retired,
        "timeout_ms": 600_000,
        "is_p2p": p2p,
    }
    if ms is not None:
        e["duration_ms"] = ms
    return e


class Recorder:
    """The dump a process's recorder would give: its ring of ``size`` newest entries."""

    def __init__(self, size: int = 64) -> None:
        self.entries: list[dict[str, Any]] = []
        self.size = size
        self.dumps = 0

    def add(self, *es: dict[str, Any]) -> None:
        self.entries = (self.entries + list(es))[-self.size :]

    def __call__(self) -> dict[str, Any]:
        self.dumps += 1
        return {"version": "2.10", "pg_status": {}, "entries": [dict(e) for e in self.entries]}


def rig(size: int = 64) -> tuple[Waits, Stepper, Recorder, Clock]:
    st = Stepper("main-r0", notify=lambda: None, clock=Clock())
    rec = Recorder(size)
    mono = Clock()
    return Waits(st, dump=rec, clock=mono, enabled=True), st, rec, mono


def run(st: Stepper, rec: Recorder, steps: int, first_seq: int, ms: float) -> int:
    """``steps`` steps of one all-reduce each, ``ms`` long; the next sequence number."""
    seq = first_seq
    for _ in range(steps):
        st.tick()
        rec.add(entry(seq, ms))
        seq += 1
    return seq


def test_each_read_sums_the_collectives_finished_since_the_last_over_its_steps() -> None:
    w, st, rec, mono = rig()
    seq = run(st, rec, 5, 1, 4.0)
    assert w.take() is None  # the first read only says where the next one starts
    mono.now += 1.0
    seq = run(st, rec, 10, seq, 4.0)
    got = w.take()
    assert got is not None and abs(got[0] - 0.040) < 1e-9 and got[1] == 10
    # An all-reduce still running holds back those after it in its group; another group's
    # count; a point-to-point op has its own sequence.
    mono.now += 1.0
    rec.add(entry(seq, None, state="started", retired=False), entry(seq + 1, 2.0),
            entry(1, 3.0, pg="7"), entry(1, 1.0, p2p=True))  # fmt: skip
    st.tick()
    got = w.take()
    assert got is not None and abs(got[0] - 0.004) < 1e-9 and got[1] == 1
    # Finished now (its duration measured as it retired): it and the one it held back count.
    rec.entries[-4] = entry(seq, 5.0)
    mono.now += 1.0
    got = w.take()
    assert got is not None and abs(got[0] - 0.007) < 1e-9 and got[1] == 0
    # Completed but not retired yet, with a start time: its duration is not known yet.
    rec.add(entry(seq + 2, None, retired=False))
    mono.now += 1.0
    got = w.take()
    assert got == [0.0, 0]
    # As valid on the wire as in a ledger.
    buckets = [0] * (len(P.STEP_BUCKETS) + 1)
    ledger = {"at": 1, "n": 1, "sum": 0.03, "q": [0.03] * 4, "b": buckets, "wait": got}
    frame = P.encode(P.HEARTBEAT, step=1, ledger=ledger)
    assert P.decode(frame, P.AGENT_INBOUND)["ledger"].wait == (0.0, 0)


def test_entries_the_ring_dropped_unread_send_nothing_and_the_next_read_goes_on() -> None:
    w, st, rec, mono = rig(size=8)
    seq = run(st, rec, 4, 1, 1.0)
    w.take()
    mono.now += 1.0
    seq = run(st, rec, 20, seq, 1.0)  # more than the ring holds
    assert w.take() is None and w.off is None
    mono.now += 1.0
    run(st, rec, 3, seq, 1.0)
    got = w.take()
    assert got is not None and abs(got[0] - 0.003) < 1e-9 and got[1] == 3


def test_reads_are_spaced_to_their_budget() -> None:
    w, st, rec, mono = rig()
    seq = run(st, rec, 2, 1, 1.0)
    w.take()
    mono.now += 0.0001
    assert w.take() is None and rec.dumps == 1  # not due: no dump at all
    mono.now += w.cost / BUDGET + 1e-9
    run(st, rec, 2, seq, 1.0)
    assert w.take() is not None and rec.dumps == 2


def test_untimed_backends_and_a_recorder_off_send_nothing_ever() -> None:
    # NCCL without TORCH_NCCL_ENABLE_TIMING: completed, no start time, no duration.
    w, st, rec, mono = rig()
    seq = run(st, rec, 2, 1, 1.0)
    w.take()
    rec.add(entry(seq, None, started=False))
    mono.now += 1.0
    assert w.take() is None and w.off is not None and "without a start time" in w.off
    mono.now += 100.0
    assert w.take() is None and rec.dumps == 2  # off for good: no more dumps
    assert seconds_of(entry(1, None, state="scheduled", retired=False)) is None
    assert tally([entry(3, 2.0), entry(4, 2.0)], {("0", False): 3}).seconds == 0.002
    off = Waits(st, dump=rec, enabled=False)
    assert off.take() is None and off.off == "its flight recorder is off"


_GLOO = r"""
import json, sys, time, torch.distributed as dist, torch
from profd_client import flight
from profd_client.steps import Stepper
from profd_client.waits import Waits
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
st = Stepper("main-r0", notify=lambda: None)
ticks = iter(range(1 << 30))
w = Waits(st, clock=lambda: next(ticks) * 1000.0)
t = torch.ones(8)
dist.all_reduce(t)
st.tick()
first = w.take()
second = []
# An entry retires once its work is done with (asynchronously): read until one has.
for _ in range(200):
    dist.all_reduce(t)
    st.tick()
    second.append(w.take())
    if w.off:
        break
    time.sleep(0.05)
second = [x for x in second if x is not None] or None
# The newest entry retires asynchronously too: on a slow machine, a moment after the loop.
for _ in range(200):
    last = flight.timing_dump()["entries"][-1]
    if last.get("retired"):
        break
    time.sleep(0.05)
print(json.dumps({"first": first, "second": second, "off": w.off, "cost": w.cost,
                  "last": {k: last.get(k) for k in ("state", "retired", "duration_ms",
                           "time_discovered_started_ns", "time_discovered_completed_ns")}}))
dist.destroy_process_group()
"""


def test_gloo_on_cpu_records_no_timings_so_no_wait_is_sent(tmp_path: Path) -> None:
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "64",
           "PYTHONPATH": f"{ROOT}:{ROOT / 'client'}"}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", _GLOO, str(tmp_path / "store")], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["first"] is None and out["second"] is None, out
    assert out["off"] and "without a start time or a duration" in out["off"], out
    # What torch gives on gloo: every entry retires "scheduled", never started nor timed.
    assert out["last"] == {"state": "scheduled", "retired": True, "duration_ms": None,
                           "time_discovered_started_ns": None,
                           "time_discovered_completed_ns": None}, out  # fmt: skip
    assert msgspec.json.decode(r.stdout.strip().splitlines()[-1])["cost"] >= 0
