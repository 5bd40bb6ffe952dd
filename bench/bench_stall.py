"""Training stall at capture end: profd's client versus torch.profiler + gzip trace handler.

Both capture the same steps (1 warm-up + 2 recorded) of the same loop with the same options
(CPU activity, record_shapes, with_stack), in the same process, alternating which goes
first. profd: the real training-thread path, a :class:`profd_client.steps.Stepper` with an
armed session (what the agent thread posts on ARM); the stall is the wall time of the
``tick()`` that ends the capture (stops the profiler and writes the raw trace into the
spool; gzip and the rest happen in the daemon). Baseline: ``torch.profiler.profile`` with
``on_trace_ready=tensorboard_trace_handler(dir, use_gzip=True)``; the stall is the wall time
of the ``prof.step()`` that ends the active window (it stops, exports and gzips) plus the
following ``prof.stop()``. Small and large (tens of MB) traces: many small ops per step.

Target: profd stall <= 0.6x the baseline's.

With a memory snapshot (``--memory-snapshot``): the same profd capture of the small loop with
no snapshot, with one, and with one pickled and written on the training thread as
``torch.cuda.memory._dump_snapshot`` does (what the client did before). CUDA's allocator
history is not on this machine: the snapshot is the test double of tests/doubles (a
``_snapshot()``-shaped object of 2,000 and 100,000 trace entries, built before the capture,
so torch's own cost of taking it is not in these figures). Also measured: how long the
writer thread takes, and the steps the loop ran meanwhile (pickle holds the GIL while it
encodes, so those steps are slower).

Target: stall with a snapshot <= stall without + 50 ms.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B

sys.path.insert(0, str(B.ROOT / "tests" / "doubles"))
from memory_history import MemoryHistoryDouble

#: Trace entries of the snapshot double, small and large (the client records at most 100,000).
SNAPSHOT_ENTRIES = {"small": 2_000, "large": 100_000}
SNAPSHOT_STACKS = 2_000  # distinct tracebacks among the entries (torch shares repeated ones)


class DumpOnTrainingThread:
    """The baseline: the snapshot pickled and written inside the snapshot call, on the
    training thread, as ``torch.cuda.memory._dump_snapshot`` does; what it hands on is
    empty, so the client's own writer has next to nothing left to do."""

    def __init__(self, double: MemoryHistoryDouble, path: Path) -> None:
        self.double, self.path = double, path

    def available(self) -> bool:
        return True

    def start(self) -> None:
        self.double.start()

    def snapshot(self) -> object:
        with open(self.path, "wb") as fh:
            pickle.dump(self.double.snapshot(), fh)
        return {}

    def stop(self) -> None:
        self.double.stop()


OPTIONS = {"activities": ["cpu"], "record_shapes": True, "with_stack": True}
WARMUP, ACTIVE = 1, 2


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def make_work(n_ops: int) -> Any:
    import torch

    x0 = torch.randn(8, 8)

    def work() -> None:
        x = x0
        for _ in range(n_ops):
            x = x * 1.0001 + 0.5

    return work


def run_profd(
    work: Any, tmp: Path, memory: Any = None, options: dict[str, Any] = OPTIONS
) -> dict[str, Any]:
    from profd_client.steps import PENDING, ArmedSession, Stepper

    st = Stepper("main-r0", notify=lambda: None, **({"memory": memory} if memory else {}))
    before = []
    for _ in range(3):
        t0 = time.perf_counter()
        work()
        st.tick()
        before.append((time.perf_counter() - t0) * 1000)
    c = st.count
    w, a = c + 2, c + 2 + WARMUP
    armed = ArmedSession(
        session="bench",
        job="bench-stall",
        backend="torch",
        cycles=[(w, a, a + ACTIVE)],
        options=dict(options, memory_snapshot=memory is not None),
        incoming=tmp,
    )
    st.post("arm", armed)
    ticks = []
    gc.collect()
    for _ in range(1 + WARMUP + ACTIVE + 1):
        work()
        t0 = time.perf_counter()
        st.tick()
        ticks.append((time.perf_counter() - t0) * 1000)
    reports = [m for m in st.outbox if m["t"] == "captured"]
    assert reports and not reports[0]["error"], reports
    rep = reports[0]
    assert rep["steps"] == list(range(a, a + ACTIVE)), rep["steps"]
    # The tick that closes the window is the one that stopped the profiler and wrote the file.
    end_tick = ticks[1 + WARMUP + ACTIVE - 1]
    extra: dict[str, Any] = {}
    write = rep.get(PENDING)
    if write is not None:
        # The loop goes on while the writer pickles: how long that takes, and its steps.
        during = []
        while not write.done.is_set() and len(during) < 10_000:
            t0 = time.perf_counter()
            work()
            st.tick()
            during.append((time.perf_counter() - t0) * 1000)
        write.done.wait()
        assert write.error is None, write.error
        extra = {
            "write_ms": write.took_ms,
            "steps_during_write": len(during),
            "step_ms_during_write_p50": round(B.pct(during, 50), 3) if during else None,
            "longest_step_ms_during_write": round(max(during), 3) if during else None,
            "loop_ms_during_write": round(sum(during), 3),
            "step_ms_before_p50": round(B.pct(before, 50), 3),
        }
    return {
        **extra,
        "stall_ms": end_tick,
        "client_reported_stall_ms": rep["stall_ms"],
        "bytes": dir_bytes(tmp),
        "file": "raw .pt.trace.json (gzip happens in the daemon)",
        "other_ticks_ms": [
            round(t, 3) for i, t in enumerate(ticks) if i != 1 + WARMUP + ACTIVE - 1
        ],
    }


def run_torch(work: Any, tmp: Path) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    prof = profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=WARMUP, active=ACTIVE, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(tmp), use_gzip=True),
        record_shapes=True,
        with_stack=True,
    )
    del torch
    gc.collect()
    prof.start()
    steps = []
    for _ in range(WARMUP + ACTIVE):
        work()
        t0 = time.perf_counter()
        prof.step()
        steps.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    prof.stop()
    stop_ms = (time.perf_counter() - t0) * 1000
    files = list(tmp.glob("*.pt.trace.json.gz"))
    assert len(files) == 1, files
    return {
        "stall_ms": steps[-1] + stop_ms,
        "bytes": dir_bytes(tmp),
        "file": "gzipped .pt.trace.json.gz",
        "other_steps_ms": [round(t, 3) for t in steps[:-1]],
    }


def main() -> None:
    args = B.parser(__doc__).parse_args()
    started = time.monotonic()
    import torch

    torch.set_num_threads(1)
    quick = args.quick
    sizes = (
        {"small": (20, 2), "large": (500, 2)} if quick else {"small": (100, 7), "large": (5000, 3)}
    )  # ops per step (2 torch ops each), repetitions (>= 2: both orders)
    base = Path(tempfile.mkdtemp(prefix="profd-bench-stall-"))
    res: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        for name, (n_ops, reps) in sizes.items():
            work = make_work(n_ops)
            for _ in range(3):
                work()
            res[name] = {"profd": [], "torch": []}
            for r in range(reps):
                order = ("profd", "torch") if r % 2 == 0 else ("torch", "profd")
                for v in order:
                    tmp = base / f"{name}-{v}-{r}"
                    tmp.mkdir()
                    fn = run_profd if v == "profd" else run_torch
                    res[name][v].append(fn(work, tmp))
                    shutil.rmtree(tmp, ignore_errors=True)
            print(
                f"{name}: profd {[round(x['stall_ms']) for x in res[name]['profd']]} ms, "
                f"torch {[round(x['stall_ms']) for x in res[name]['torch']]} ms",
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    details: dict[str, Any] = {}
    for name, (n_ops, reps) in sizes.items():
        p = [x["stall_ms"] for x in res[name]["profd"]]
        t = [x["stall_ms"] for x in res[name]["torch"]]
        ps, ts = B.summary(p, 1), B.summary(t, 1)
        pb = B.pct([x["bytes"] for x in res[name]["profd"]], 50)
        tb = B.pct([x["bytes"] for x in res[name]["torch"]], 50)
        rows.append(
            B.row(
                f"stall at capture end, {name} trace ({pb / 1e6:.1f} MB raw)",
                "<= 0.6x baseline",
                ps["p50"],
                "ms",
                baseline=ts["p50"],
                baseline_what=f"torch.profiler+gzip handler, {tb / 1e6:.1f} MB gz",
                met=ps["p50"] <= 0.6 * ts["p50"],
                spread=f"profd {ps['min']}..{ps['max']}, torch {ts['min']}..{ts['max']} ms",
            )
        )
        details[name] = {
            "ops_per_step": 2 * n_ops,
            "repetitions": reps,
            "profd_stall_ms": ps,
            "torch_stall_ms": ts,
            "profd_raw_bytes_p50": pb,
            "torch_gz_bytes_p50": tb,
            "runs": res[name],
        }
    params = {
        "options": OPTIONS,
        "warmup": WARMUP,
        "active": ACTIVE,
        "sizes_ops_reps": sizes,
        "threads": 1,
        "tmp_fs": os.statvfs(tempfile.gettempdir()).f_bsize,
    }
    snap_rows, details["memory_snapshot"] = snapshot_figures(quick, base)
    rows += snap_rows
    params["snapshot_entries"] = SNAPSHOT_ENTRIES
    B.write_result("stall", args.out, quick, params, rows, details, started)


def snapshot_figures(quick: bool, base: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Stall of the small loop's capture without a memory snapshot, with one (written off the
    training thread) and with one written on it, rotating the order every repetition."""
    work = make_work(20 if quick else 100)
    for _ in range(3):
        work()
    reps = 3 if quick else 7
    sizes = {"small": 500, "large": 5_000} if quick else SNAPSHOT_ENTRIES
    rows, details = [], {}
    base.mkdir(parents=True, exist_ok=True)
    try:
        for name, entries in sizes.items():
            double = MemoryHistoryDouble(entries=entries, stacks=min(entries, SNAPSHOT_STACKS))
            pickled = len(pickle.dumps(double.base))
            runs: dict[str, list[dict[str, Any]]] = {"none": [], "off": [], "on": []}
            variants = ("none", "off", "on")
            for r in range(reps):
                for v in variants[r % 3 :] + variants[: r % 3]:
                    tmp = base / f"snap-{name}-{v}-{r}"
                    tmp.mkdir()
                    memory: Any = None
                    if v == "off":
                        memory = double
                    elif v == "on":
                        memory = DumpOnTrainingThread(double, tmp / "inline.pickle")
                    runs[v].append(run_profd(work, tmp, memory, {"activities": ["cpu"]}))
                    shutil.rmtree(tmp, ignore_errors=True)
            st = {v: [x["stall_ms"] for x in runs[v]] for v in variants}
            sm = {v: B.summary(x, 1) for v, x in st.items()}
            print(
                f"snapshot {name}: stall none {sm['none']['p50']} ms, written off the training "
                f"thread {sm['off']['p50']} ms, on it {sm['on']['p50']} ms",
                file=sys.stderr,
            )
            delta = sm["off"]["p50"] - sm["none"]["p50"]
            write_ms = B.summary([x["write_ms"] for x in runs["off"]], 1)
            rows.append(
                B.row(
                    f"stall at capture end with a memory snapshot, {entries:,} entries "
                    f"({pickled / 1e6:.1f} MB pickle, CPU double)",
                    "<= no snapshot + 50 ms",
                    sm["off"]["p50"],
                    "ms",
                    baseline=sm["on"]["p50"],
                    baseline_what="pickled on the training thread (_dump_snapshot)",
                    met=delta <= 50,
                    spread=f"no snapshot {sm['none']['p50']} ms; the writer thread took "
                    f"{write_ms['p50']} ms",
                )
            )
            details[name] = {
                "entries": entries,
                "pickle_bytes": pickled,
                "stall_ms": sm,
                "writer_ms": write_ms,
                "runs": runs,
            }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows, details


if __name__ == "__main__":
    main()
